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
from lightning_dta.engine.step_data import StepData
from lightning_dta.plan import ModelShape
from lightning_dta.plan.cli import main
from lightning_dta.plan.flops import tensor_parallel_config
from lightning_dta.plan.mixers import meta_model, recurrent_state_bytes
from lightning_dta.plan.predict import PlannedWalk, path_state_bytes
from lightning_dta.plan.rates import ActivationRates
from lightning_dta.shapes.models import hybrid_preset_config
from tests.helpers.models import CONV_KERNEL, SCAN_CHUNK, make_model, random_tree_rollouts

HIDDEN, VOCAB, INTERMEDIATE = 32, 48, 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # the tiny hybrids' attention (tests/helpers/models.py)
ATTENTION_PROJECTIONS = HIDDEN * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS)  # q, k, v, o
GDN_V_HEADS, GDN_K_HEADS, GDN_DIM, GDN_CHUNK = 4, 2, 8, 64


def _gated_deltanet(with_solves: bool = True) -> int:
    """One Gated DeltaNet layer's MACs per token: projections (qkv, z, a, b, out), the depthwise conv over q, k and
    v, and the chunked delta rule per value head (Yang et al. 2025, section 3.3): K_b K^T and Q K^T within the chunk
    (2 C dk), the two triangular solves (C/2 (dv + dk)), the reads of the chunk's start state (2 dk dv), the
    intra-chunk product with the new values (C dv), the state update (dk dv)."""
    key_dim, value_dim = GDN_K_HEADS * GDN_DIM, GDN_V_HEADS * GDN_DIM
    conv_channels = 2 * key_dim + value_dim
    projections = HIDDEN * conv_channels + HIDDEN * value_dim + 2 * HIDDEN * GDN_V_HEADS + value_dim * HIDDEN
    c, d = GDN_CHUNK, GDN_DIM
    solves = c * (d + d) // 2 if with_solves else 0
    core = GDN_V_HEADS * (2 * c * d + solves + 2 * d * d + c * d + d * d)
    return projections + conv_channels * CONV_KERNEL + core


def _qwen3_5_macs(with_solves: bool = True) -> int:
    """The tiny qwen3_5: Gated DeltaNet, full attention (q_proj doubled: Qwen3.5's output gate), Gated DeltaNet;
    a gated MLP after each."""
    gated_attention = ATTENTION_PROJECTIONS + HIDDEN * HEADS * HEAD_DIM
    return 2 * _gated_deltanet(with_solves) + gated_attention + 3 * (3 * HIDDEN * INTERMEDIATE)


def _nemotron_h_macs() -> int:
    """The tiny nemotron_h: a Mamba2 block, an attention block, an MLP block (relu2: up and down only). Mamba2
    (Dao and Gu 2024, section 6): in_proj to z, x, B, C, dt; conv over x, B, C; out_proj; SSD per token: C B^T per
    group (G Q N), the masked product with x (H Q P), the chunk state and the read of the start state (2 H N P)."""
    heads, dim, state, groups, inner = 8, 8, 8, 1, 64
    conv_channels = inner + 2 * groups * state
    mamba = (HIDDEN * (inner + conv_channels + heads) + conv_channels * CONV_KERNEL + inner * HIDDEN
             + groups * SCAN_CHUNK * state + heads * SCAN_CHUNK * dim + 2 * heads * state * dim)
    return mamba + ATTENTION_PROJECTIONS + 2 * HIDDEN * INTERMEDIATE


def _lfm2_macs() -> int:
    """The tiny lfm2: short conv, attention, short conv (in_proj to B, C, x; depthwise conv; out_proj), a gated
    MLP after each, whose width LFM2 adjusts (``block_auto_adjust_ff_dim``: 2/3 of ``intermediate_size`` rounded
    up to ``block_multiple_of`` = 256)."""
    short_conv = HIDDEN * 3 * HIDDEN + HIDDEN * CONV_KERNEL + HIDDEN * HIDDEN
    width = 256 * ((2 * INTERMEDIATE // 3 + 255) // 256)
    return 2 * short_conv + ATTENTION_PROJECTIONS + 3 * (3 * HIDDEN * width)


@pytest.mark.parametrize("family,macs,attention_layers",
                         [("qwen3_5", _qwen3_5_macs(), 1), ("nemotron_h", _nemotron_h_macs(), 1),
                          ("lfm2", _lfm2_macs(), 1), ("mamba2", None, 0)])
def test_flops_per_layer_kind_follow_the_definitions(family, macs, attention_layers) -> None:
    config = make_model(family).config
    shape = ModelShape.from_config(config)
    if macs is not None:
        assert shape.linear_macs_per_token == macs
    assert shape.attention_layers == attention_layers
    assert shape.attention_macs_per_pair == attention_layers * 2 * HEADS * HEAD_DIM


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
                                          ("lfm2", torch.bfloat16), ("falcon_h1", torch.float32)])
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
    with pytest.raises(ValueError, match="does not split a hybrid's recurrent layers"):
        tensor_parallel_config(config, 2)


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
    assert main(["--model", str(tmp_path), "--workload", "grpo", "--strategy", "dta_fsdp", "--devices", "2",
                 "--tensor-parallel", "2"]) == 2
    assert "does not split a hybrid's recurrent layers" in capsys.readouterr().err
