"""``activation="auto"``: keep a chunk's graph while the path's kept activations fit a budget, recompute the rest.

Under ``keep`` every inner chunk's activations stay saved until its pop, so the path's sum is the peak; under
``recompute`` none do, and every inner chunk is forwarded twice. Both are exact, and so is any mix: the walk
decides per sibling batch of inner chunks. It keeps a batch when the bytes already kept on the path, plus the
batch's predicted bytes, plus room for the largest batch that may run on top of it (the largest batch in
its chunks' subtrees: a leaf batch, or a recomputed pop), plus the path's key/value buffers stay within
``activation_memory_budget``; otherwise it recomputes the batch at its pop. Top-down, this keeps the long shared
prefixes near the root (forwarded once for every rollout below them) and recomputes deeper inner nodes when memory
runs out; leaves never need recompute.

The prediction is linear: ``body bytes per computed token x tokens + head bytes per scored position x
positions``, the two rates measured once per model and dtype by a probe forward (a 64-token sequence, saved
tensors counted by :class:`~lightning_dta.engine.memory.SavedTensorMeter`), with a 25% margin.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from lightning_dta.contracts import Objective, TokenData
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.device import to_device
from lightning_dta.engine.forward import forward_batch, loss_inputs
from lightning_dta.engine.layer_kinds import ATTENTION, LAYER_KINDS, model_layer_kinds
from lightning_dta.engine.memory import SavedTensorMeter
from lightning_dta.engine.model_info import ModelInfo, tensor_parallel_mesh
from lightning_dta.engine.sibling_batch import SiblingBatch

PROBE_TOKENS = 64
MARGIN = 1.1
MAX_BATCH_SHARE = 0.5  # one batch (the room kept free on top of the path) predicts at most this share of the budget

_RATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measure_rates(model: nn.Module, info: ModelInfo, dtype: torch.dtype, loss_fn: Objective
                  ) -> tuple[float, float, float]:
    """Bytes saved for backward per computed token (the body), per scored position (the head and the
    log-prob/entropy blocks) and per (rollout, position) entry of the loss grid, from probe forwards with grad
    and no backward. Cached per model, dtype, attention path and loss."""
    from lightning_dta.engine.walk import Chunk  # walk imports this module's users

    key = (dtype, info.packs_siblings, model.training, loss_fn)
    cached = _RATES.setdefault(model, {})
    if key in cached:
        return cached[key]
    vocab = info.vocab_size or 2
    tree = PrefixTree.from_rollouts([Rollout(input_ids=[(7 * i) % vocab for i in range(PROBE_TOKENS)])])
    chunk = Chunk.first(tree.root.children[0], None)
    batch = SiblingBatch.of(tree, [chunk], info.packs_siblings)
    targets = to_device(tree.tokens(chunk.node)[1:][None], info.device)
    with torch.enable_grad(), torch.random.fork_rng(devices=[info.device] if info.device.type == "cuda" else []):
        with SavedTensorMeter(model) as body:
            forward_batch(model, info, batch, None, [torch.arange(0)])
        with SavedTensorMeter(model) as whole:
            logits, _, _ = forward_batch(model, info, batch, None, [torch.arange(PROBE_TOKENS - 1)])
            # log-probs and entropies, or a critic's values (the temperature does not change what is saved)
            loss_inputs(loss_fn, logits[0], targets, dtype, 1.0)
        rows, columns = 8, 16
        scores = torch.zeros(rows, columns, dtype=dtype, device=info.device, requires_grad=True)
        data = _probe_data(rows, columns, dtype, info.device)
        with SavedTensorMeter(model) as grid:
            entropy = torch.zeros(1, columns, dtype=dtype, device=info.device, requires_grad=True)
            loss_fn(scores * 1.0, entropy * 1.0, data, dict.fromkeys(loss_fn.metric_sums, 0.0))
    rates = (body.peak_bytes / PROBE_TOKENS, max(whole.peak_bytes - body.peak_bytes, 0) / (PROBE_TOKENS - 1),
             grid.peak_bytes / (rows * columns))
    mesh = tensor_parallel_mesh(model)
    if mesh is not None:  # tensor-parallel peers walk one tree in lockstep: they must take the same decisions
        agreed = torch.tensor(rates, dtype=torch.float64, device=info.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
        rates = tuple(agreed.tolist())
    cached[key] = rates
    return rates


def _probe_data(rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> TokenData:
    def full(value: float) -> torch.Tensor:
        return torch.full((rows, columns), value, dtype=dtype, device=device)

    return TokenData(mask=full(1.0), advantages=full(1.0), old=full(-1.0), prox=full(-1.0), ref=full(-1.0),
                     weight=torch.ones(rows, 1, dtype=dtype, device=device), any_ref=True,
                     seq_log_weight=torch.zeros(rows, 1, dtype=dtype, device=device),
                     seq_log_ratio=torch.zeros(rows, 1, dtype=dtype, device=device), returns=full(0.0),
                     old_values=full(0.0))


def path_kv_bytes(config, capacity: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """The path's key/value buffers for ``capacity`` positions (not their gradients): attention layers x 2 x kv
    heads x capacity x head dim (a tensor-parallel rank holds ``1/tp_size`` of the heads). The budget counts them in
    full: attention saves views of them for backward. The recurrent layers of a hybrid keep no keys/values (their
    fixed-size states at the path's chunk ends are not counted here)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = model_layer_kinds(config)
    # a kind the engine does not know counts as attention (the walk refuses it; a plan stays on the safe side)
    layers = config.num_hidden_layers if kinds is None else sum(LAYER_KINDS.get(k, ATTENTION).keys_values
                                                                for k in kinds)
    if layers == 0:  # a pure state-space model
        return 0
    heads = config.num_attention_heads
    # optional config fields: not every model family has them
    kv_heads = (getattr(config, "num_key_value_heads", None) or heads) // tp_size
    # optional config fields: not every model family has them
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * capacity * torch.empty((), dtype=dtype).element_size()


@dataclass
class ActivationBudget:
    """The walk's account of kept activations against ``budget`` bytes (see the module docstring).

    ``reserve_tokens`` bounds every chunk and sibling batch: the tree's longest chunk, unless room for it (half of
    what the path's buffers leave) is smaller, then chunks are cut to that. A kept batch must leave room for one such
    batch on top of the path."""

    budget: int
    body_per_token: float
    head_per_position: float
    per_grid_entry: float
    fixed: int  # the path's key/value buffers
    longest_chunk: int  # tokens of the tree's longest chunk under the user's chunk_size
    kept: int = 0

    def __post_init__(self) -> None:
        if self.fixed >= self.budget:
            raise ValueError(f"activation_memory_budget={self.budget} bytes is below the path's key/value buffers "
                             f"alone ({self.fixed} bytes for this tree's longest path). Fix: a larger budget, or "
                             "activation='recompute'")
        per_token = MARGIN * (self.body_per_token + self.head_per_position + self.per_grid_entry)
        fitting = int(MAX_BATCH_SHARE * (self.budget - self.fixed) / max(per_token, 1e-9))
        self.reserve_tokens = max(1, min(self.longest_chunk, fitting))
        self.reserve = self.predict(self.reserve_tokens, self.reserve_tokens, self.reserve_tokens)

    @classmethod
    def for_tree(cls, tree: PrefixTree, engine, rates: tuple[float, float, float], path_bytes: int
                 ) -> ActivationBudget:
        """The budget ``engine.activation_memory_budget`` for ``tree``, with the three ``rates`` of
        :func:`measure_rates` and the path's key/value buffers (``path_bytes``)."""
        chunk = engine.chunk_size
        longest = max(n.length if chunk is None else min(n.length, chunk) for n in tree.iter_nodes())
        return cls(engine.activation_memory_budget, *rates, path_bytes, longest)

    def predict(self, tokens: int, positions: int, grid_entries: int) -> int:
        return int(MARGIN * (self.body_per_token * tokens + self.head_per_position * positions
                             + self.per_grid_entry * grid_entries))

    def try_keep(self, predicted: int, room: int) -> bool:
        """Keep a batch of inner chunks (``predicted`` bytes) if the path, it and the largest batch that may run
        while it is kept (``room`` bytes) fit."""
        if self.fixed + self.kept + predicted + room > self.budget:
            return False
        self.kept += predicted
        return True

    def release(self, predicted: int) -> None:
        self.kept -= predicted
