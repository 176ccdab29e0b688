"""Per-token loss inputs of a step, flattened once, and gathered per chunk of the tree.

Every engine asks the same question: "for the positions ``start .. start+L-1`` of these rollouts, what does
each position predict, and with which mask, advantage and log-probs?". Position ``p`` predicts token
``p+1``; a rollout's last position predicts nothing. The answer, :class:`ChunkTargets`, is a ``[R, L]`` grid;
rows and columns with nothing to train are dropped before the model's head is even evaluated.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_dta.contracts import Objective, StepTokens, TokenData
from lightning_dta.core.rollout import RolloutError
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.device import expected_sync, to_device

_NAN = float("nan")


def _flat(values: list[float] | None, length: int, per_token: bool = False) -> torch.Tensor:
    """One rollout's optional per-token field as float64 (NaN where not given; entry 0 is never used)."""
    if values is None:
        return torch.full((length,), _NAN, dtype=torch.float64)
    if isinstance(values, (int, float)):
        return torch.full((length,), float(values), dtype=torch.float64)
    out = torch.tensor([_NAN if v is None else float(v) for v in values], dtype=torch.float64)
    if not per_token:
        out[0] = _NAN
    return out


def prepared_tokens(tree: PrefixTree, loss_fn: Objective) -> StepTokens:
    """The tree's per-token inputs as ``loss_fn`` decides them before the walk (:meth:`Objective.prepare`), in
    float64 on the CPU: the one place both the normaliser and the walk's data come from, so they agree."""
    lengths = [len(t) for t in tree.token_tensors]
    tokens = StepTokens(
        mask=torch.cat(tree.loss_masks).to(torch.float64),
        advantages=torch.cat([_flat(r.advantages, len(r), per_token=True) for r in tree.rollouts]),
        old=torch.cat([_flat(r.old_logprobs, len(r)) for r in tree.rollouts]),
        prox=torch.cat([_flat(r.prox_logprobs, len(r)) for r in tree.rollouts]),
        owner=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long)),
        num_rollouts=len(lengths))
    return loss_fn.prepare(tokens)


def counted_masks(tokens: StepTokens, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Per-rollout masks of the pairs the normalisers count."""
    return list(torch.split(tokens.counted, list(lengths)))


def tree_loss_normalizer(tree: PrefixTree, loss_fn: Objective) -> tuple[float, ...]:
    """This tree's share of the step's loss normalisers (counts); sum them elementwise over trees and ranks for a
    global step."""
    tokens = prepared_tokens(tree, loss_fn)
    return tuple(loss_fn.normalizer(counted_masks(tokens, [len(t) for t in tree.token_tensors])))


@dataclass
class ChunkTargets:
    """What a chunk's forward must score: grid data plus the columns whose logits are needed."""

    columns: torch.Tensor  # [C] offsets within the chunk whose logits are needed (CPU)
    token_ids: torch.Tensor  # [R, C] the tokens to score (what each position predicts, per rollout)
    data: TokenData  # [R, C] loss inputs
    rollouts: torch.Tensor  # [R] rollout indices of the rows

    @property
    def empty(self) -> bool:
        return self.columns.numel() == 0


def warn_if_nothing_to_learn(step: StepData, loss_fn: Objective) -> None:
    """A whole step whose trained tokens all have advantage 0 (and no KL or entropy term) has loss 0 and gradient 0:
    say so instead of returning zeros in silence (typically: advantages never estimated)."""
    trained = step.mask > 0
    if not loss_fn.advantage_only:
        return
    if trained.any() and not step.advantages[trained].any():
        warnings.warn("every trained token of this step has advantage 0, so the loss and its gradient are 0. Fix: "
                      "estimate advantages first (lightning_dta.core.advantages.grpo_advantages(rollouts), or "
                      "RolloutDataModule(advantage_estimator='grpo'))", UserWarning, stacklevel=3)


class StepData:
    """Flat per-token tensors of all rollouts of a tree (on the CPU, where the indexing is cheap)."""

    def __init__(self, tree: PrefixTree, loss_fn: Objective | None = None,
                 normalizer: Sequence[float] | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.tree = tree
        self.device = torch.device(device)
        self.dtype = dtype
        self.lengths = torch.tensor([len(t) for t in tree.token_tensors], dtype=torch.long)
        self.offsets = torch.cumsum(self.lengths, 0) - self.lengths
        self.tokens = torch.cat(tree.token_tensors)
        self.owner = torch.repeat_interleave(torch.arange(len(self.lengths)), self.lengths)  # each token's rollout
        self.ref = torch.cat([self._optional(r.ref_logprobs, len(r)) for r in tree.rollouts])
        self.any_ref = any(r.ref_logprobs is not None for r in tree.rollouts)
        self.seq_log_weight = None  # [R]: the objective's per-rollout log-weight, when it asks for one
        if loss_fn is not None:
            prepared = prepared_tokens(tree, loss_fn)  # what the loss decided before the walk (rejection, ...)
            counted = counted_masks(prepared, self.lengths.tolist())
            self.normalizer = tuple(float(n) for n in (loss_fn.normalizer(counted) if normalizer is None
                                                       else normalizer))
            self.weights = loss_fn.rollout_weights(torch.stack([m.sum() for m in counted]), self.normalizer)
            # Stored in the loss's dtype (float32 unless the model is float64): a large step holds millions of these.
            self.mask, self.advantages = prepared.mask.to(dtype), prepared.advantages.to(dtype)
            self.old, self.prox = prepared.old.to(dtype), prepared.prox.to(dtype)
            if prepared.seq_log_weight is not None:
                self.seq_log_weight = prepared.seq_log_weight.to(dtype)
        else:
            self.normalizer = (1.0,)
            self.weights = torch.ones(len(tree.rollouts), 1, dtype=torch.float64)
            self.mask = torch.cat(tree.loss_masks)
            self.advantages = torch.cat([self._per_token(r.advantages, len(r)) for r in tree.rollouts])
            self.old = torch.cat([self._optional(r.old_logprobs, len(r)) for r in tree.rollouts])
            self.prox = torch.cat([self._optional(r.prox_logprobs, len(r)) for r in tree.rollouts])
        self.token_counts = torch.stack([m.sum() for m in torch.split(self.mask, self.lengths.tolist())])
        self.fields = self._token_fields(loss_fn)  # the objective's own per-token fields (a critic's returns)
        self.seq_log_ratio: torch.Tensor | None = None  # [R]: GSPO's log-ratio, set by set_current_logprobs

    def _token_fields(self, loss_fn: Objective | None) -> dict[str, torch.Tensor]:
        """Flat grids of the per-token rollout fields the objective reads; a required one must be present on every
        rollout with a trained token."""
        if loss_fn is None:
            return {}
        for name in loss_fn.required_fields:
            for index, (rollout, count) in enumerate(zip(self.tree.rollouts, self.token_counts)):
                if getattr(rollout, name) is None and count > 0:  # a Rollout field named by the objective
                    raise RolloutError(index, name, f"is missing, and the {type(loss_fn).__name__} regresses on it",
                                       "estimate advantages with advantage_estimator='gae' (it writes returns) or "
                                       "give one value per token")
        return {name: torch.cat([self._optional(getattr(r, name), len(r)) for r in self.tree.rollouts])
                for name in loss_fn.token_fields}

    def _per_rollout_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over each rollout's trained tokens of a flat per-token tensor (0 for a rollout with none)."""
        trained = self.mask > 0
        totals = torch.zeros(len(self.lengths), dtype=torch.float64).index_add_(
            0, self.owner[trained], values[trained].to(torch.float64))
        return (totals / self.token_counts.clamp(min=1).to(torch.float64)).to(self.dtype)

    def set_current_logprobs(self, logprobs: list[torch.Tensor]) -> None:
        """GSPO: the per-rollout ``mean over trained tokens of (logp - prox)`` from the current weights' log-probs
        (``tree_logprobs``: entry ``t - 1`` is token ``t``); prox defaults to old, old to logp itself. The
        log-probs come to the host in one deliberate read (the step's sequence weights are host data)."""
        flat = torch.cat([lp.detach() for lp in logprobs]).to(torch.float64)
        with expected_sync(flat.device):
            flat = flat.cpu()
        current = torch.cat([torch.cat([torch.zeros(1, dtype=torch.float64), lp])
                             for lp in torch.split(flat, [len(lp) for lp in logprobs])])
        prox = torch.where(torch.isnan(self.prox), self.old, self.prox).to(torch.float64)
        prox = torch.where(torch.isnan(prox), current, prox)
        self.seq_log_ratio = self._per_rollout_mean(current - prox)

    def _per_token(self, value: float | list[float], length: int) -> torch.Tensor:
        if isinstance(value, (int, float)):
            return torch.full((length,), float(value), dtype=self.dtype)
        return torch.tensor(value, dtype=self.dtype)

    def _optional(self, values: list[float] | None, length: int) -> torch.Tensor:
        if values is None:
            return torch.full((length,), _NAN, dtype=self.dtype)
        out = torch.tensor([_NAN if v is None else float(v) for v in values], dtype=self.dtype)
        out[0] = _NAN  # index 0 is never used
        return out

    def _grid(self, rollouts: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indices of the targets of positions ``start .. start+length-1`` and their validity."""
        target_pos = torch.arange(start + 1, start + length + 1)
        lengths = self.lengths[rollouts]
        valid = target_pos[None, :] < lengths[:, None]
        index = self.offsets[rollouts][:, None] + torch.minimum(target_pos[None, :], lengths[:, None] - 1)
        return index, valid

    def targets(self, rollouts: list[int] | torch.Tensor, start: int, length: int, *,
                all_positions: bool = False) -> ChunkTargets:
        """The grid for positions ``start .. start+length-1`` of ``rollouts``.

        With ``all_positions`` every valid target is kept (log-prob extraction); otherwise only trained ones.
        """
        rollouts = torch.as_tensor(rollouts, dtype=torch.long)
        index, valid = self._grid(rollouts, start, length)
        mask = self.mask[index] * valid
        keep = valid if all_positions else mask > 0
        rows = keep.any(1)
        columns = torch.nonzero(keep.any(0)).flatten()
        if not bool(rows.all()):
            rollouts, index, mask, keep = rollouts[rows], index[rows], mask[rows], keep[rows]
        index, mask, keep = index[:, columns], mask[:, columns], keep[:, columns]
        def on_device(t: torch.Tensor) -> torch.Tensor:  # a non-blocking copy from pinned memory on CUDA
            return to_device(t.to(self.dtype), self.device)

        data = TokenData(mask=on_device(mask), advantages=on_device(self.advantages[index]),
                         old=on_device(self.old[index]), prox=on_device(self.prox[index]),
                         ref=on_device(self.ref[index]), weight=on_device(self.weights[rollouts]),
                         any_ref=self.any_ref,
                         seq_log_weight=None if self.seq_log_weight is None else on_device(
                             self.seq_log_weight[rollouts][:, None]),
                         seq_log_ratio=None if self.seq_log_ratio is None else on_device(
                             self.seq_log_ratio[rollouts][:, None]),
                         **{name: on_device(values[index]) for name, values in self.fields.items()})
        token_ids = to_device(self.tokens[index], self.device)
        return ChunkTargets(columns=columns, token_ids=token_ids, data=data, rollouts=rollouts)


def check_tree_fits_model(tree: PrefixTree, vocab_size: int | None, max_positions: int | None) -> None:
    """Refuse token ids outside the vocabulary and rollouts longer than the model's positions."""
    for index, tokens in enumerate(tree.token_tensors):
        if vocab_size is not None and int(tokens.max()) >= vocab_size:
            pos = int(torch.nonzero(tokens >= vocab_size)[0])
            raise RolloutError(index, "input_ids", f"token {pos} is {int(tokens[pos])}, outside the model's "
                               f"vocabulary [0, {vocab_size})", "use the tokenizer that matches the model")
        if max_positions is not None and len(tokens) > max_positions:
            raise RolloutError(index, "input_ids", f"has {len(tokens)} tokens, more than the model's maximum "
                               f"positions ({max_positions})", "truncate the rollout or use a longer-context model")
