"""Hybrid models (recurrent layers next to attention) walk the tree exactly: each node continues from its parent's
end state (the convolution window and the scan's state), and the gradients its children send to that state reach
the parent's backward.

References are per-rollout training (tests/helpers/reference.py). transformers runs the recurrent cores in float32
even in float64 models (the Gated DeltaNet kernels cast to ``torch.float32``, Mamba2's scan calls ``.float()``, and
Mamba2's head returns float32 logits), and splitting one scan at other points moves the tiny ``A_log`` /
``dt_bias`` gradients by ~1e-5 of their own norm (measured: 7e-6 to 1.8e-5 for Gated DeltaNet, 2e-6 for Mamba2,
1.7e-5 to 1.9e-5 for Kimi Delta Attention, whose cache also keeps the handed state in float32);
:func:`float64_recurrent_cores` runs them in float64 for both sides, so the comparison keeps the float64 tolerance
of the other exactness tests (1e-5; measured 2e-15 to 2e-13 for the scan families, 6e-14 to 9e-14 for Kimi Linear,
8e-8 for Qwen3-Next, whose MoE router casts to ``torch.float``, 2e-7 for LFM2, whose norms cast to float32 in a
module left as it is).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import random
import types

import pytest
import torch

import lightning_dta as dta
import lightning_dta.engine.logprobs as logprobs
from lightning_dta.engine.layer_kinds import LAYER_KINDS
from lightning_dta.engine.model_info import inspect_model
from lightning_dta.engine.recurrent_state import PathStates, StateLayer
from tests.helpers.models import CONV_KERNEL, SCAN_CHUNK, make_model, make_rollout, random_tree_rollouts
from tests.helpers.reference import assert_grads_close, engine_grads, reference_grads, reference_value_loss

RTOL64 = 1e-5
RECURRENT_KINDS = {name for name, kind in LAYER_KINDS.items() if kind.states}
WALKED = ["qwen3_5", "qwen3_next", "olmo_hybrid", "lfm2", "lfm2_moe", "mamba2", "nemotron_h", "bamba",
          "granitemoehybrid", "kimi_linear", "falcon_h1", "zamba2"]
# the modeling modules whose recurrent cores cast to float32 (the short convolutions of LFM2 do not)
SCAN_MODULES = ["qwen3_5", "qwen3_next", "olmo_hybrid", "mamba2", "nemotron_h", "bamba", "granitemoehybrid",
                "kimi_linear", "falcon_h1", "zamba2"]

CONFIGS = {
    "keep-unbatched": dict(mode="dfs", sibling_batch_tokens=None),
    "keep-batched": dict(mode="dfs"),
    # chunks shorter than the convolution kernel (4) and than the scan's chunk: every boundary is a hand-over
    "keep-chunk1": dict(mode="dfs", chunk_size=1),
    "recompute-chunk2": dict(mode="dfs", activation="recompute", chunk_size=2),
    "recompute-chunk3-batched": dict(mode="dfs", activation="recompute", chunk_size=3, sibling_batch_tokens=16),
    "auto": dict(mode="dfs", activation="auto", activation_memory_budget=400_000),
}


class _Float64Torch(types.ModuleType):
    """``torch`` as a modeling module sees it, with ``torch.float32`` meaning float64."""

    def __getattr__(self, name: str):
        return torch.float64 if name == "float32" else getattr(torch, name)


def assert_walks_as_each_rollout(model, rollouts, loss_fn, configs, what: str | None = None) -> None:
    """The engine's loss and per-parameter gradients under each config equal training each rollout alone."""
    ref_loss, ref = reference_grads(model, rollouts, loss_fn)
    for config in configs:
        out, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **config)
        assert out.loss == pytest.approx(ref_loss, rel=1e-6)
        assert_grads_close(got, ref, RTOL64, what=what or str(config))


@pytest.fixture(autouse=True)
def float64_recurrent_cores(monkeypatch):
    """Run the recurrent cores in float64, for the reference and the tree alike: the modeling modules' casts to
    ``torch.float32`` keep float64, and so does ``Tensor.float()`` on a float64 tensor."""
    for name in SCAN_MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        monkeypatch.setattr(module, "torch", _Float64Torch("torch"))
    to_float32 = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float",
                        lambda self, *args, **kwargs: self if self.dtype == torch.float64 else to_float32(self))


def tree_rollouts(seed: int = 1) -> list[dta.Rollout]:
    """A random multi-level tree, and next to it one whose root has inner children of lengths 3, 3, 8, 7 and 1 (so
    sibling batches must keep those that hand a state on apart by length) and a leaf, each inner child with leaves
    of its own; nodes of one token are shorter than the conv kernel."""
    rng = random.Random(seed)
    rollouts = random_tree_rollouts(rng, num_rollouts=10, max_depth=3)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(48) for _ in range(n)]

    prefix = tokens(7)
    for child in (3, 3, 8, 7, 1):
        middle = tokens(child)
        rollouts += [make_rollout(rng, prefix + middle + tokens(n)) for n in (2, 4)]
    rollouts.append(make_rollout(rng, prefix + tokens(4)))
    tree = dta.PrefixTree.from_rollouts(rollouts)
    inner = [n for n in tree.nodes[1:] if not n.is_leaf]
    assert any(len({c.length for c in n.children if not c.is_leaf}) >= 3 for n in tree.nodes), \
        "inner siblings of different lengths"
    assert any(n.parent is not tree.root for n in inner), "the tree must branch at many levels"
    assert any(n.length < CONV_KERNEL for n in tree.nodes[1:]), "some node must be shorter than the conv kernel"
    return rollouts


# one model per scan kind (Gated DeltaNet, Mamba2, Kimi Delta Attention) for the rest of the matrix
SCANS = ["qwen3_5", "mamba2", "kimi_linear"]
# and the layers that attend and carry states in one cache layer (kind "hybrid"): side by side, a shared block
BOTH = ["falcon_h1", "zamba2"]
MATRIX = [(family, name) for name in CONFIGS for family in
          (WALKED if name in ("keep-batched", "keep-chunk1", "recompute-chunk2") else SCANS + BOTH)]


@pytest.mark.parametrize("family,config_name", MATRIX)
def test_gradients_match_per_rollout_training(family, config_name):
    model = make_model(family)
    rollouts = tree_rollouts()
    loss_fn = dta.PolicyLoss(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    ref_loss, ref = reference_grads(model, rollouts, loss_fn)
    out, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **CONFIGS[config_name])
    assert out.loss == pytest.approx(ref_loss, rel=1e-6)
    recurrent = [f"{name}.{p}" for name, m in model.named_modules()
                 if getattr(m, "layer_type", None) in RECURRENT_KINDS for p, _ in m.named_parameters()]
    assert recurrent and all(float(ref[n].norm()) > 0 for n in recurrent), "the recurrent layers must be trained"
    assert_grads_close(got, ref, RTOL64, what=f"{family} {config_name}")


@pytest.mark.parametrize("config_name", ["keep-unbatched", "recompute-chunk3-batched"])
def test_kimi_delta_attention_across_its_scan_chunks(monkeypatch, config_name):
    """Kimi Delta Attention scans in chunks of 64 tokens (not a config field), longer than every test rollout: here
    in chunks of 8, so that one forward crosses several and its state passes from scan chunk to scan chunk after
    starting from the handed one."""
    from transformers.models.kimi_linear import modeling_kimi_linear

    scan = modeling_kimi_linear.chunk_kimi_delta_attention
    monkeypatch.setattr(modeling_kimi_linear, "chunk_kimi_delta_attention",
                        functools.partial(scan, chunk_size=SCAN_CHUNK))
    model = make_model("kimi_linear")
    rollouts = tree_rollouts()
    assert max(len(r) for r in rollouts) > 2 * SCAN_CHUNK
    loss_fn = dta.PolicyLoss(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.1)
    assert_walks_as_each_rollout(model, rollouts, loss_fn, [CONFIGS[config_name]],
                                 what=f"kimi_linear scan chunk {SCAN_CHUNK} {config_name}")


@pytest.mark.parametrize("family", SCANS)
@pytest.mark.parametrize("loss_fn", [dta.PolicyLoss(loss_mode="gspo", clip_eps=3e-4, clip_eps_high=4e-4),
                                     dta.PolicyLoss(loss_mode="cispo", clip_eps_high=0.3, agg="seq-mean-token-sum")],
                         ids=["gspo", "cispo"])
def test_other_objectives(family, loss_fn):
    """GSPO's sequence ratio comes from a forward-only walk (``tree_logprobs``) before the training walk."""
    model = make_model(family)
    rollouts = tree_rollouts()
    assert_walks_as_each_rollout(model, rollouts, loss_fn, [CONFIGS["recompute-chunk2"]],
                                 what=f"{family} {loss_fn.loss_mode}")


def test_attention_layers_among_layers_without_a_mixer():
    """Nemotron-H with attention and MLP-only layers, no recurrent one: the path's keys/values go to the attention
    layers by their index (layer 2's to layer 2), not by their place in the list."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(
        layers_block_type=["attention", "mlp", "attention"], vocab_size=48, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)).double()
    rollouts = tree_rollouts()
    loss_fn = dta.PolicyLoss(kl_coef=0.1)
    assert_walks_as_each_rollout(model, rollouts, loss_fn, [CONFIGS["keep-batched"], CONFIGS["recompute-chunk2"]])


def test_recurrent_state_gradient_reaches_the_parent():
    """Without the state's gradient the parent's recurrent layer would miss its children's share: a tree whose only
    trained tokens lie in the children gives the recurrent parameters of the shared prefix their whole gradient
    through the state (and the keys/values of the attention layer)."""
    model = make_model("qwen3_5")
    rng = random.Random(5)
    prefix = [rng.randrange(48) for _ in range(9)]
    rollouts = []
    for _ in range(3):
        r = make_rollout(rng, prefix + [rng.randrange(48) for _ in range(rng.randint(2, 5))])
        r.loss_mask = [0] * len(prefix) + [1] * (len(r.input_ids) - len(prefix))
        rollouts.append(r)
    loss_fn = dta.PolicyLoss(kl_coef=0.1)
    _, ref = reference_grads(model, rollouts, loss_fn)
    for config in (CONFIGS["keep-batched"], CONFIGS["recompute-chunk2"]):
        _, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **config)
        assert_grads_close(got, ref, RTOL64, what=str(config))


@pytest.mark.parametrize("family", WALKED)
def test_each_tree_token_is_forwarded_once(family):
    """A shared walk, not a per-rollout fallback (which would be exact too): the input embedding sees each tree
    token once in keep mode with siblings unbatched."""
    model = make_model(family)
    rollouts = tree_rollouts()
    for r in rollouts:  # every token trained: no leaf is skipped for having nothing to train
        r.loss_mask = None
    tree = dta.PrefixTree.from_rollouts(rollouts)
    assert tree.stats.logical_tokens > tree.stats.tree_tokens
    seen = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: seen.append(args[0].numel()))
    try:
        dta.tree_backward(model, tree, dta.PolicyLoss(), mode="dfs", sibling_batch_tokens=None)
    finally:
        hook.remove()
    assert sum(seen) == tree.stats.tree_tokens, (sum(seen), tree.stats.tree_tokens, tree.stats.logical_tokens)


@pytest.mark.parametrize("family", WALKED)
@pytest.mark.parametrize("options", [dict(chunk_size=3), dict(sibling_batch_tokens=None, chunk_size=1)],
                         ids=["batched-chunk3", "unbatched-chunk1"])
def test_tree_logprobs_match_per_rollout(family, options):
    model = make_model(family)
    rollouts = tree_rollouts(seed=2)
    got = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts), **options)
    with torch.no_grad():
        for r, logp in zip(rollouts, got):
            ids = torch.tensor([r.input_ids])
            expected = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(logp, expected, rtol=0, atol=1e-9)


def test_vanilla_as_before():
    model = make_model("qwen3_5")
    rollouts = tree_rollouts()
    ref_loss, ref = reference_grads(model, rollouts, dta.PolicyLoss())
    out, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss(), mode="vanilla")
    assert out.loss == pytest.approx(ref_loss, rel=1e-9)
    assert_grads_close(got, ref, RTOL64, what="vanilla")


@pytest.mark.parametrize("family", WALKED)
def test_mask_mode_is_refused(family):
    model = make_model(family)
    tree = dta.PrefixTree.from_rollouts(tree_rollouts())
    with pytest.raises(dta.ModelNotSupportedError, match="a mask cannot reach a recurrent layer.*Fix: use mode='dfs'"):
        dta.tree_backward(model, tree, dta.PolicyLoss(), mode="mask")


def test_prefix_attention_is_off_and_refused_when_required():
    """Packing siblings into one row would run one scan across them: the engine uses the model's own attention."""
    model = make_model("qwen3_5")
    assert not inspect_model(model, True, None, None).packs_siblings
    with pytest.raises(dta.ModelNotSupportedError, match="recurrent layer would run one scan across them"):
        inspect_model(model, True, True, None)


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "mamba2"])
def test_forward_only_walks_do_not_pack_cousins(family, monkeypatch):
    """Cousins packed in one row would share one recurrent scan, each starting from its own parent's state, which
    transformers' PyTorch mixers cannot keep apart (ModelInfo.packs_cousins). A hybrid's tree_logprobs and
    tree_values batch siblings instead: a 3 x 3 x 2 tree-search step takes the sibling walk's 1 + 1 + 3 + 9 = 14
    forwards (cousin packing: 4), exact in float64; asking for the packing (prefix_attention=True) is refused with
    the reason. Even if prefix attention ever served a hybrid's attention layers, cousins would stay apart."""
    from tests.engine.test_cousins import branching_rollouts

    model = make_model(family)
    info = inspect_model(model, True, None, None)
    assert info.recurrent and not info.packs_cousins
    assert not dataclasses.replace(info, prefix_attention_configs=(model.config,)).packs_cousins
    # segments of one length: siblings that hand a state on batch together only at equal lengths (walk.py)
    rollouts = branching_rollouts(random.Random(3), (3, 3, 2), (6, 6))
    tree = dta.PrefixTree.from_rollouts(rollouts)
    forwards = {"siblings": 0, "cousins": 0}
    for name, key in (("forward_batch", "siblings"), ("forward_cousins", "cousins")):
        original = getattr(logprobs, name)

        def counting(*args, _original=original, _key=key):
            forwards[_key] += 1
            return _original(*args)

        monkeypatch.setattr(logprobs, name, counting)
    got = dta.tree_logprobs(model, tree)  # sibling_batch_tokens=4096: room for every cousin
    assert forwards == {"siblings": 14, "cousins": 0}
    with torch.no_grad():
        for r, logp in zip(rollouts, got):
            ids = torch.tensor([r.input_ids])
            expected = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(logp, expected.to(logp.dtype), rtol=0, atol=1e-9)
    for walk in (dta.tree_logprobs, dta.tree_values):
        with pytest.raises(dta.ModelNotSupportedError, match=r"has recurrent layers: prefix attention packs sibling "
                           r"chunks \(and, in tree_logprobs / tree_values, cousins\) into one row.*Fix: pass "
                           "prefix_attention=None"):
            walk(dta.value_model(model) if walk is dta.tree_values else model, tree, prefix_attention=True)


def test_unknown_layer_kind_is_refused_by_name():
    model = make_model("qwen3_5")
    model.config.layer_types = ["mystery_state", *model.config.layer_types[1:]]
    with pytest.raises(dta.ModelNotSupportedError, match=r"\['mystery_state'\].*does not know.*Fix: mode='vanilla'"):
        dta.tree_backward(model, dta.PrefixTree.from_rollouts(tree_rollouts()), dta.PolicyLoss())


def test_unknown_recurrent_mixer_is_refused_by_name():
    model = make_model("qwen3_5")
    mixer = model.model.layers[0].linear_attn
    mixer.__class__ = type("MysteryMixer", (type(mixer),), {})
    with pytest.raises(dta.ModelNotSupportedError, match="MysteryMixer is of a kind the tree engine does not know"):
        dta.tree_backward(model, dta.PrefixTree.from_rollouts(tree_rollouts()), dta.PolicyLoss())


def test_a_transformers_release_without_the_state_contract_is_refused(monkeypatch):
    """transformers 5.17 (the GPU machine's) has no ``Cache.get_conv_state``: its mixers read
    ``cache_params.layers[i].conv_states[0]``, a contract the engine's cache layer is not tested against."""
    from transformers import cache_utils

    monkeypatch.delattr(cache_utils.Cache, "get_conv_state")
    with pytest.raises(dta.ModelNotSupportedError, match="no cache contract.*Fix: upgrade transformers"):
        dta.tree_backward(make_model("qwen3_5"), dta.PrefixTree.from_rollouts(tree_rollouts()), dta.PolicyLoss())


def test_a_state_written_in_place_is_recorded_not_written():
    """transformers' one-token decode paths write the new state into the one they read (``copy_``): the engine's
    cache layer records it as the new state and leaves the parent's untouched; other in-place writes are refused."""
    parent = torch.randn(1, 2, 3, dtype=torch.float64)
    conv = torch.randn(1, 4, 4, dtype=torch.float64)
    layer = StateLayer(LAYER_KINDS["linear_attention"], (conv, parent))
    handed = layer.recurrent_states[0]
    new = handed * 0.5 + 1.0
    handed.copy_(new)
    torch.testing.assert_close(layer.new["recurrent"], new, rtol=0, atol=0)
    assert torch.equal(parent, handed.as_subclass(torch.Tensor)) and not torch.equal(parent, new)
    with pytest.raises(dta.ModelNotSupportedError, match="mul_ in place on the recurrent state.*Fix: mode='vanilla'"):
        handed.mul_(2.0)


@pytest.mark.parametrize("family", SCANS)
def test_a_hybrid_critic_is_exact(family):
    """A critic on a hybrid (``dta.value_model``): ``tree_values`` equal the per-rollout head outputs, and the value
    loss's gradients equal per-rollout training."""
    critic = dta.value_model(make_model(family))
    with torch.no_grad():  # a head that is not zero: values that differ by position
        critic.get_output_embeddings().weight.normal_(0, 0.5)
    rng = random.Random(3)
    rollouts = tree_rollouts(seed=3)
    tree = dta.PrefixTree.from_rollouts(rollouts)
    values = dta.tree_values(critic, tree, chunk_size=2)
    with torch.no_grad():
        for r, v in zip(rollouts, values):
            expected = critic(input_ids=torch.tensor([r.input_ids])).logits[0, :-1, 0]
            torch.testing.assert_close(v, expected, rtol=0, atol=1e-9)
    for r, v in zip(rollouts, values):
        r.returns = [0.0] + [rng.gauss(0, 1) for _ in range(len(r) - 1)]
        r.old_values = [0.0] + [float(x) + rng.gauss(0, 0.05) for x in v]
    loss_fn = dta.ValueLoss(clip_eps=0.1)
    critic.zero_grad(set_to_none=True)
    ref_loss = reference_value_loss(critic, rollouts, loss_fn)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}
    for config in (CONFIGS["keep-batched"], CONFIGS["recompute-chunk2"]):
        out, got = engine_grads(critic, tree, loss_fn, **config)
        assert out.loss == pytest.approx(float(ref_loss.detach()), rel=1e-6)
        assert_grads_close(got, ref, RTOL64, what=f"critic {family} {config}")


def test_a_write_through_a_view_of_a_handed_state_never_reaches_the_path():
    """A forward without grad (recompute's push, tree_logprobs) gets a copy of the path's state; with grad, the
    leaves refuse a write through a view (autograd's own check)."""
    states = PathStates(with_grads=True, required=True)
    states.write(5, [(torch.zeros(1, 2, 3, dtype=torch.float64),)])
    copy, _ = states.past(5, requires_grad=False)
    copy[0][0][:, 0].fill_(1.0)
    assert float(states.states[5][0][0].abs().sum()) == 0.0
    leaves, _ = states.past(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf"):
        leaves[0][0][:, 0].fill_(1.0)
    assert float(states.states[5][0][0].abs().sum()) == 0.0


TINY = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1)


@pytest.mark.parametrize("family,layout,named", [
    ("jamba", {}, "found 0 mixer modules"),  # its Mamba (1) mixer carries no layer_type
], ids=["jamba"])
def test_families_the_engine_does_not_walk_are_refused(family, layout, named):
    """transformers' other hybrids, each refused by what the engine does not know, before anything is trained."""
    import inspect

    from transformers import AutoConfig, AutoModelForCausalLM

    config_class = type(AutoConfig.for_model(family))
    accepted = inspect.signature(config_class.__init__).parameters
    config = config_class(**{k: v for k, v in TINY.items() if k in accepted}, **layout)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(dta.ModelNotSupportedError, match=f"{named}.*Fix: mode='vanilla'"):
        dta.tree_backward(model, dta.PrefixTree.from_rollouts(tree_rollouts()), dta.PolicyLoss())


@pytest.mark.parametrize("limit,differs", [((0.001, float("inf")), True), ((0.0, float("inf")), False)],
                         ids=["clamped", "lifted"])
def test_transformers_one_token_update_skips_the_time_step_limit(limit, differs):
    """Why the engine applies Mamba2's time-step limit to chunks of one token (engine/time_step_limit.py):
    transformers' one-token update skips the clamp its chunk scan applies, so decoding token by token through
    transformers' own cache differs from one forward of the whole sequence for the tiny Zamba2 of the matrix (its
    limit ``(time_step_min, inf)`` binds there); with the limit lifted they agree to rounding. If transformers ever
    clamps in the one-token update too, the first case fails and the wrapper can go. The engine's walks leave the
    modeling module's function as they found it."""
    from transformers import DynamicCache
    from transformers.models.zamba2 import modeling_zamba2

    update = modeling_zamba2.mamba2_selective_state_update
    model = make_model("zamba2")
    dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(tree_rollouts()), chunk_size=1)
    assert modeling_zamba2.mamba2_selective_state_update is update
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = limit
    ids = torch.tensor([random.Random(4).choices(range(48), k=12)])
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        cache = DynamicCache(config=model.config)
        steps = [model(input_ids=ids[:, :4], cache=cache, use_cache=True).logits]
        steps += [model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(4, 12)]
    error = float((torch.cat(steps, 1) - whole).abs().max())
    assert (error > 1e-8) if differs else (error < 1e-12), error


def test_a_binding_time_step_limit_walks_exactly():
    """Nemotron-H clamps its time steps to ``(time_step_min, inf)`` as Zamba2 does; with time-step biases from -9 to
    -5 the clamp binds for many tokens (it does not in the tiny model's own), and one-token chunks, the tree's own
    or the chunking's, still train as each rollout alone (without the engine's limit: 2.2e-4 and 1.9e-1 relative)."""
    model = make_model("nemotron_h")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "dt_bias"):
                module.dt_bias.copy_(torch.linspace(-9.0, -5.0, module.dt_bias.numel()))
    rollouts = tree_rollouts()
    loss_fn = dta.PolicyLoss(kl_coef=0.1)
    assert_walks_as_each_rollout(model, rollouts, loss_fn, [CONFIGS["keep-batched"], CONFIGS["keep-chunk1"]])


def test_mixers_of_one_module_with_different_time_step_limits_are_refused():
    model = make_model("zamba2")
    model.model.layers[1].mamba.time_step_limit = (0.002, float("inf"))
    with pytest.raises(dta.ModelNotSupportedError, match="clamp their time steps to different limits.*Fix: mode="):
        dta.tree_backward(model, dta.PrefixTree.from_rollouts(tree_rollouts()), dta.PolicyLoss())
