"""The planner prices hybrids (recurrent layers next to attention): FLOPs per token of each layer kind, attention
only on the attention layers, and the fixed-size recurrent states the path holds.

The FLOP references are written from the layers' definitions with the tiny models' sizes (tests/helpers/models.py),
and the matmul part is checked against ``torch.utils.flop_counter`` on the real forward; the state bytes against
the tensors the engine's :class:`~lightning_dta.engine.recurrent_state.PathStates` really holds in a walk.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import lightning_dta as dta
from lightning_dta.engine import EngineOptions, recurrent_state
from lightning_dta.engine.activation_budget import path_kv_bytes
from lightning_dta.engine.step_data import StepData
from lightning_dta.plan import ModelShape
from lightning_dta.plan.cli import MIXERS_PER_RANK, main
from lightning_dta.plan.flops import tensor_parallel_config
from lightning_dta.plan.mixers import meta_model, recurrent_state_bytes
from lightning_dta.plan.predict import PlannedWalk, path_state_bytes
from lightning_dta.plan.rates import ActivationRates
from lightning_dta.shapes.models import hybrid_preset_config
from lightning_dta.shapes.workloads import WORKLOADS
from tests.helpers.models import CONV_KERNEL, SCAN_CHUNK, make_model, random_tree_rollouts

HIDDEN, VOCAB, INTERMEDIATE = 32, 48, 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # the tiny hybrids' attention (tests/helpers/models.py)
ATTENTION_PROJECTIONS = HIDDEN * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS)  # q, k, v, o
GDN_V_HEADS, GDN_K_HEADS, GDN_DIM, GDN_CHUNK = 4, 2, 8, 64


def _gated_deltanet(with_solves: bool = True, tp: int = 1) -> int:
    """One Gated DeltaNet layer's MACs per token: projections (qkv, z, a, b, out), the depthwise conv over q, k and
    v, and the chunked delta rule per value head (Yang et al. 2025, section 3.3): K_b K^T and Q K^T within the chunk
    (2 C dk), the two triangular solves (C/2 (dv + dk)), the reads of the chunk's start state (2 dk dv), the
    intra-chunk product with the new values (C dv), the state update (dk dv). On one of ``tp`` tensor-parallel ranks
    the mixer runs whole but each projection computes 1/tp of its output columns (then gathered)."""
    key_dim, value_dim = GDN_K_HEADS * GDN_DIM, GDN_V_HEADS * GDN_DIM
    conv_channels = 2 * key_dim + value_dim
    projections = HIDDEN * conv_channels + HIDDEN * value_dim + 2 * HIDDEN * GDN_V_HEADS + value_dim * HIDDEN
    c, d = GDN_CHUNK, GDN_DIM
    solves = c * (d + d) // 2 if with_solves else 0
    core = GDN_V_HEADS * (2 * c * d + solves + 2 * d * d + c * d + d * d)
    return projections // tp + conv_channels * CONV_KERNEL + core


def _qwen3_5_macs(with_solves: bool = True, tp: int = 1) -> int:
    """The tiny qwen3_5: Gated DeltaNet, full attention (q_proj doubled: Qwen3.5's output gate), Gated DeltaNet;
    a gated MLP after each. On one of ``tp`` ranks: 1/tp of the attention heads and of the MLP's columns."""
    gated_attention = ATTENTION_PROJECTIONS + HIDDEN * HEADS * HEAD_DIM
    return 2 * _gated_deltanet(with_solves, tp) + (gated_attention + 3 * (3 * HIDDEN * INTERMEDIATE)) // tp


def _nemotron_h_macs() -> int:
    """The tiny nemotron_h: a Mamba2 block, an attention block, an MLP block (relu2: up and down only). Mamba2
    (Dao and Gu 2024, section 6): in_proj to z, x, B, C, dt; conv over x, B, C; out_proj; SSD per token: C B^T per
    group (G Q N), the masked product with x (H Q P), the chunk state and the read of the start state (2 H N P)."""
    heads, dim, state, groups, inner = 8, 8, 8, 1, 64
    conv_channels = inner + 2 * groups * state
    mamba = (HIDDEN * (inner + conv_channels + heads) + conv_channels * CONV_KERNEL + inner * HIDDEN
             + groups * SCAN_CHUNK * state + heads * SCAN_CHUNK * dim + 2 * heads * state * dim)
    return mamba + ATTENTION_PROJECTIONS + 2 * HIDDEN * INTERMEDIATE


def _lfm2_macs(tp: int = 1) -> int:
    """The tiny lfm2: short conv, attention, short conv (in_proj to B, C, x; depthwise conv; out_proj), a gated
    MLP after each, whose width LFM2 adjusts (``block_auto_adjust_ff_dim``: 2/3 of ``intermediate_size`` rounded
    up to ``block_multiple_of`` = 256). On one of ``tp`` ranks: the short convs whole, their projections' output
    columns, the attention heads and that width divided by tp."""
    short_conv = (HIDDEN * 3 * HIDDEN + HIDDEN * HIDDEN) // tp + HIDDEN * CONV_KERNEL
    width = 256 * ((2 * INTERMEDIATE // 3 + 255) // 256)
    return 2 * short_conv + (ATTENTION_PROJECTIONS + 3 * (3 * HIDDEN * width)) // tp


def _kimi_linear_macs() -> int:
    """The tiny kimi_linear: Kimi Delta Attention and a gated MLP, then MLA attention and a mixture of experts.
    KDA: q, k, v projections, the depthwise conv over them, the forget gate (f_a, f_b), b, the output gate (g_a,
    g_b), out; its core is the Gated DeltaNet's chunked delta rule (the decay per channel is elementwise) with
    ``dk = dv`` = 8 on 4 heads. MLA (no q LoRA): q to 4 heads of 8 + 8 (no-position and rotary parts), the
    compressed keys/values (16) and the shared rotary key (8), their expansion to 4 heads of 8 + 8 (keys' no-position
    part, values), o. The experts: 2 of 4 visited, each a gated MLP of width 32, and a shared one of width 32."""
    heads, dim, latent, rope, experts_width = 4, 8, 16, 8, 32
    width = heads * dim
    c = GDN_CHUNK
    core = heads * (2 * c * dim + c * (dim + dim) // 2 + 2 * dim * dim + c * dim + dim * dim)
    kda = (3 * HIDDEN * width + 3 * width * CONV_KERNEL + (HIDDEN * dim + dim * width) + HIDDEN * heads
           + (HIDDEN * dim + dim * width) + width * HIDDEN + core)
    mla = (HIDDEN * heads * (dim + rope) + HIDDEN * (latent + rope) + latent * heads * (dim + dim)
           + heads * dim * HIDDEN)
    moe = 2 * (3 * HIDDEN * experts_width) + 3 * HIDDEN * experts_width
    return kda + 3 * HIDDEN * INTERMEDIATE + mla + moe


@pytest.mark.parametrize("family,macs,attention_layers,pair_per_head",
                         [("qwen3_5", _qwen3_5_macs(), 1, 2 * HEAD_DIM),
                          ("nemotron_h", _nemotron_h_macs(), 1, 2 * HEAD_DIM),
                          ("lfm2", _lfm2_macs(), 1, 2 * HEAD_DIM), ("mamba2", None, 0, 2 * HEAD_DIM),
                          # MLA: q.k over the keys' 8 + 8 dims, p.v over the values' 8
                          ("kimi_linear", _kimi_linear_macs(), 1, 16 + 8)])
def test_flops_per_layer_kind_follow_the_definitions(family, macs, attention_layers, pair_per_head) -> None:
    config = make_model(family).config
    shape = ModelShape.from_config(config)
    if macs is not None:
        assert shape.linear_macs_per_token == macs
    assert shape.attention_layers == attention_layers
    assert shape.attention_macs_per_pair == attention_layers * HEADS * pair_per_head


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_matmul_flops_agree_with_the_flop_counter_on_the_real_forward(family) -> None:
    """One 64-token forward (one Gated DeltaNet chunk, no padding), eager attention (the full square of pairs):
    the matrix products torch counts are the model's FLOPs less the convolutions (torch counts the padded conv
    output) and the triangular solves (which torch does not count)."""
    model = make_model(family, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    tokens = 64
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.arange(tokens)[None] % VOCAB, use_cache=False)
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    matmuls = counted.pop("aten.mm") + counted.pop("aten.bmm")
    assert set(counted) == {"aten.convolution"}, counted
    shape = ModelShape.from_config(model.config)
    if family == "qwen3_5":
        convolutions = 2 * (2 * GDN_K_HEADS * GDN_DIM + GDN_V_HEADS * GDN_DIM) * CONV_KERNEL
        solves = _qwen3_5_macs() - _qwen3_5_macs(with_solves=False)
    else:
        convolutions, solves = 2 * HIDDEN * CONV_KERNEL, 0
    expected = shape.forward_flops(tokens, tokens * tokens, tokens) - 2 * tokens * (convolutions + solves)
    assert matmuls == expected


def _zero_rates(layers: int) -> ActivationRates:
    return ActivationRates(0, 0, 0, 0, 0, 0, 0, 0, layers=layers, vocab=VOCAB, packed=False)


class _HeldStates:
    """The bytes of the states and gradients :class:`PathStates` holds, at their most, and each end state's bytes."""

    def __init__(self, monkeypatch) -> None:
        self.most, self.per_end = 0, set()
        write = recurrent_state.PathStates.write

        def recording(path, end, states):
            write(path, end, states)
            self.per_end.add(sum(t.nbytes for layer in states for t in layer))
            held = {t.untyped_storage().data_ptr(): t.nbytes for s in path.states.values() for layer in s
                    for t in layer}
            held |= {t.untyped_storage().data_ptr(): t.nbytes for g in path.state_grads.values() for t in g}
            self.most = max(self.most, sum(held.values()))

        monkeypatch.setattr(recurrent_state.PathStates, "write", recording)


@pytest.mark.parametrize("family,dtype", [("qwen3_5", torch.bfloat16), ("nemotron_h", torch.float32),
                                          ("lfm2", torch.bfloat16), ("kimi_linear", torch.bfloat16),
                                          ("falcon_h1", torch.float32)])
@pytest.mark.parametrize("options", [dict(sibling_batch_tokens=None), dict(activation="recompute", chunk_size=3)],
                         ids=["keep-unbatched", "recompute-chunk3"])
def test_state_bytes_on_the_path_are_what_the_engine_holds(monkeypatch, family, dtype, options) -> None:
    model = make_model(family, dtype=dtype)
    tree = dta.PrefixTree.from_rollouts(random_tree_rollouts(random.Random(3), num_rollouts=8, max_depth=3))
    held = _HeldStates(monkeypatch)
    engine = EngineOptions(**options)
    dta.tree_backward(model, tree, dta.PolicyLoss(), engine=engine)
    per_node = recurrent_state_bytes(meta_model(model.config), dtype)
    assert held.per_end == {per_node}  # each chunk end's conv windows and scan states
    walk = PlannedWalk(tree, engine, StepData(tree, dta.PolicyLoss()), _zero_rates(model.config.num_hidden_layers),
                       0)
    walk.run()
    assert walk.most_held_states >= 2, "the tree must hold several states on a path"
    assert path_state_bytes(walk, per_node) == held.most


def test_the_qwen3_5_preset_is_transformers_default_shape() -> None:
    """3 Gated DeltaNet : 1 full attention over 32 layers, from ``Qwen3_5TextConfig()``; a chunk end's states are
    fixed-size: 24 layers x (conv window [2 x 16 x 128 + 32 x 128, 4] in bf16 + delta state [32, 128, 128] in
    float32)."""
    config = hybrid_preset_config("qwen3.5-like")
    shape = ModelShape.from_config(config)
    assert (shape.layers, shape.attention_layers, shape.hidden) == (32, 8, 4096)
    assert shape.attention_macs_per_pair == 8 * 2 * 16 * 256
    per_layer = (2 * 16 * 128 + 32 * 128) * 4 * 2 + 32 * 128 * 128 * 4
    assert recurrent_state_bytes(meta_model(config), torch.bfloat16) == 24 * per_layer
    assert tensor_parallel_config(config, 1) is config
    rank = tensor_parallel_config(config, 2)  # Qwen3.5's own plan: attention and MLP split, mixers whole
    assert recurrent_state_bytes(meta_model(rank), torch.bfloat16) == 24 * per_layer
    assert ModelShape.from_config(rank, 2).attention_macs_per_pair == shape.attention_macs_per_pair // 2


def test_a_hybrid_with_experts_is_refused_under_tensor_parallelism() -> None:
    """The walk refuses transformers' packed expert styles; the planner names the experts rather than price them
    whole or split."""
    with pytest.raises(ValueError, match=r"layers\.1\.mixer\.experts \(NemotronHExperts\) is a mixture of experts.*"
                                         "Fix: plan it with tensor parallelism 1"):
        tensor_parallel_config(hybrid_preset_config("nemotron-h-like"), 2)


@pytest.mark.parametrize("family,macs", [("qwen3_5", _qwen3_5_macs), ("lfm2", _lfm2_macs)])
def test_per_rank_flops_under_tensor_parallelism_follow_the_definitions(family, macs) -> None:
    """One rank of two, as the walk runs it (distributed/tensor_parallel.py): attention heads, the MLP and the
    head's logits halved; every recurrent mixer whole (its scan, its convolution, its states) with its projections
    split by output columns. LFM2's derived MLP width (256 here: halving intermediate_size would not halve it) is
    divided, not its config field."""
    config = make_model(family).config
    whole, rank = ModelShape.from_config(config), ModelShape.from_config(tensor_parallel_config(config, 2), 2)
    assert rank.linear_macs_per_token == macs(tp=2)
    assert whole.linear_macs_per_token == macs(tp=1)
    assert rank.recurrent_core_macs == whole.recurrent_core_macs
    assert rank.attention_macs_per_pair == whole.attention_macs_per_pair // 2
    assert rank.head_macs_per_position == whole.head_macs_per_position // 2
    assert recurrent_state_bytes(meta_model(tensor_parallel_config(config, 2)), torch.bfloat16) == \
        recurrent_state_bytes(meta_model(config), torch.bfloat16)


def test_a_hybrid_is_planned(tmp_path, capsys) -> None:
    """Once refused ("has recurrent layers ... Fix: plan with an attention-only model"), now priced."""
    model = make_model("qwen3_5")
    model.config.max_position_embeddings = 4096
    model.config.vocab_size = 512  # the bench workloads draw tokens from a vocabulary of at least 512
    model.config.save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--workload", "grpo", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    shape = ModelShape.from_config(model.config)
    per_node = recurrent_state_bytes(meta_model(model.config), torch.bfloat16)
    assert record["hybrid"] == {"attention_layers": 1, "layer_macs_per_token": shape.layer_macs,
                                "recurrent_core_macs_per_token": shape.recurrent_core_macs,
                                "state_bytes_per_node": per_node}
    assert record["modes"]["dfs"]["tflops"] < record["modes"]["vanilla"]["tflops"]
    assert main(["--model", str(tmp_path), "--workload", "grpo"]) == 0
    out = capsys.readouterr().out
    assert "hybrid: 1 of 3 layers attend" in out and "of recurrent states" in out, out



def test_a_hybrid_is_planned_under_tensor_parallelism(tmp_path, capsys) -> None:
    """Once refused ("the planner does not split a hybrid's recurrent layers"): one rank of two computes half the
    attention and the MLP and every recurrent mixer whole (``_qwen3_5_macs(tp=2)``: only its projections' columns
    split), holds the whole recurrent states on its path but half the keys/values, and the output says so. The
    step at TP 2 on 2 ranks is the one tree walked at TP 1 on 1 rank (one data-parallel rank either way)."""
    model = make_model("qwen3_5")
    model.config.max_position_embeddings = 4096
    model.config.vocab_size = 512  # the bench workloads draw tokens from a vocabulary of at least 512
    model.config.save_pretrained(tmp_path)
    step = ["--model", str(tmp_path), "--workload", "grpo", "--strategy", "dta_fsdp"]
    assert main([*step, "--devices", "1", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*step, "--devices", "2", "--tensor-parallel", "2", "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)
    per_node = recurrent_state_bytes(meta_model(model.config), torch.bfloat16)
    assert whole["hybrid"]["layer_macs_per_token"] == _qwen3_5_macs()
    assert rank["hybrid"] == {"attention_layers": 1, "layer_macs_per_token": _qwen3_5_macs(tp=2),
                              "recurrent_core_macs_per_token": whole["hybrid"]["recurrent_core_macs_per_token"],
                              "state_bytes_per_node": per_node, "recurrent_mixers_per_rank": MIXERS_PER_RANK}
    tree = dta.PrefixTree.from_rollouts(WORKLOADS["grpo"].generate(512, 0))
    kv = path_kv_bytes(model.config, tree.stats.max_depth_tokens, torch.bfloat16)  # and as much for its gradient
    for mode in ("dfs", "dfs-recompute"):
        states = whole["modes"][mode]["path_buffer_bytes"] - 2 * kv
        assert states >= 2 * per_node  # a state and its gradient at one chunk end at least
        assert rank["modes"][mode]["path_buffer_bytes"] == kv + states
    assert main([*step, "--devices", "2", "--tensor-parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert "hybrid under tensor parallelism 2: each rank runs every recurrent mixer whole" in out, out
