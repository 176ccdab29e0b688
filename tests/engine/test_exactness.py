"""The core promise: tree training gives exactly the gradients of training each rollout on its own.

Every engine mode and option is compared, per parameter, with an independent per-rollout reference
(tests/helpers/reference.py). float64 models, with no float32 step inside (tests/helpers/float64.py: Hugging Face
norms, rotary embeddings and eager softmax compute in float32, which left ~1e-7): relative error <= 1e-12 per
parameter and loss, i.e. rounding only (measured <= 5e-15); float32: <= 1e-3, loss <= 1e-6.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.version import Version

import lightning_dta as dta
from lightning_dta.engine.model_info import DOGE_CAUSAL_SDPA, inspect_model
from tests.helpers.models import VOCAB, make_model, make_rollout, random_tree_rollouts
from tests.helpers.reference import RTOL64, assert_grads_close, engine_grads, reference_grads

RTOL32 = 1e-3

ENGINE_CONFIGS = {
    "vanilla": dict(mode="vanilla"),
    "vanilla-batched": dict(mode="vanilla", vanilla_batch_tokens=64),
    "dfs-keep": dict(mode="dfs"),
    "dfs-keep-prefix-attention": dict(mode="dfs", prefix_attention=True),
    "dfs-keep-model-attention": dict(mode="dfs", prefix_attention=False),
    "dfs-keep-nobatch-treeorder": dict(mode="dfs", sibling_batch_tokens=None, order="tree"),
    "dfs-keep-chunk": dict(mode="dfs", chunk_size=3),
    "dfs-recompute": dict(mode="dfs", activation="recompute"),
    "dfs-recompute-chunk": dict(mode="dfs", activation="recompute", chunk_size=4),
    "dfs-recompute-chunk-model-attention": dict(mode="dfs", activation="recompute", chunk_size=4,
                                                prefix_attention=False),
    "dfs-recompute-chunk1": dict(mode="dfs", activation="recompute", chunk_size=1, sibling_batch_tokens=16),
    "dfs-auto": dict(mode="dfs", activation="auto", activation_memory_budget=400_000),  # keeps some, recomputes some
    "dfs-auto-chunk": dict(mode="dfs", activation="auto", activation_memory_budget=400_000, chunk_size=4),
    "mask": dict(mode="mask"),
    "mask-capped": dict(mode="mask", mask_max_tokens=30),
}

LOSSES = {
    "token-mean": dta.PolicyLoss(agg="token-mean"),
    "seq-mean-token-mean": dta.PolicyLoss(agg="seq-mean-token-mean", clip_eps=0.1, clip_eps_high=0.3),
    "seq-mean-token-sum": dta.PolicyLoss(agg="seq-mean-token-sum", kl_coef=0.05),
    "sum": dta.PolicyLoss(agg="sum", clip_eps=0.2, kl_coef=0.1, entropy_coef=0.01),
}


def check(model, rollouts, loss_fn, config, rtol=RTOL64):
    ref_loss, ref = reference_grads(model, rollouts, loss_fn)
    assert ref, "the reference produced no gradient: the test data trains nothing"
    out, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **config)
    assert out.loss == pytest.approx(ref_loss, rel=min(rtol, 1e-6), abs=1e-12), \
        f"{config}: loss {out.loss} vs {ref_loss}"
    return assert_grads_close(got, ref, rtol, what=str(config)), out


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("config_name", list(ENGINE_CONFIGS))
def test_every_mode_matches_per_rollout_reference(family, config_name):
    model = make_model(family)
    rollouts = random_tree_rollouts(random.Random(1), num_rollouts=10)
    loss_fn = dta.PolicyLoss(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    _, out = check(model, rollouts, loss_fn, ENGINE_CONFIGS[config_name])
    assert out.metrics["clip_fraction"] > 0.1, "the test data must exercise clipping"
    assert out.metrics["trained_tokens"] == sum(sum(r.loss_mask[1:]) for r in rollouts)


PREFIX_ATTENTION_CONFIGS = [name for name, c in ENGINE_CONFIGS.items()
                            if c["mode"] == "dfs" and c.get("prefix_attention") is not False]
REFERENCE_KERNELS = dict(prefix_attention=True, prefix_attention_backend="reference")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "qwen3"])
@pytest.mark.parametrize("config_name", PREFIX_ATTENTION_CONFIGS)
def test_reference_kernels_through_every_dfs_mode(family, config_name):
    """The varlen glue the CUDA backends plug into (one causal call for all packed spans, one call over the
    prefix, merged backward), with the pure-PyTorch reference kernels: exact in every mode."""
    model = make_model(family)
    rollouts = random_tree_rollouts(random.Random(1), num_rollouts=10)
    loss_fn = dta.PolicyLoss(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    check(model, rollouts, loss_fn, {**ENGINE_CONFIGS[config_name], **REFERENCE_KERNELS})
    info = inspect_model(model, True, True, "reference")
    assert info.attention_backend.name == "reference" and info.packs_siblings


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma", "doge", "doge-eager", "diffllama"])
@pytest.mark.parametrize("config_name", ["dfs-keep", "dfs-recompute-chunk", "mask"])
def test_more_model_families(family, config_name):
    """Mistral (sliding window), Doge (its own attention bias) and DiffLlama (two attention calls per layer)
    cannot use prefix attention; the engine falls back to their own attention and stays exact. Doge under sdpa
    before transformers 5.18 is not causal in its own forward and is refused."""
    model = make_model(family)
    rollouts = random_tree_rollouts(random.Random(8), num_rollouts=8)
    loss_fn = dta.PolicyLoss(kl_coef=0.1, entropy_coef=0.01)
    if family == "doge" and Version(transformers.__version__) < DOGE_CAUSAL_SDPA:
        with pytest.raises(dta.ModelNotSupportedError, match="dynamic mask.*attn_implementation='eager'"):
            engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **ENGINE_CONFIGS[config_name])
        return
    check(model, rollouts, loss_fn, ENGINE_CONFIGS[config_name])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma", "doge", "doge-eager",
                                    "diffllama", "gpt2"])
def test_the_float64_test_models_are_the_library_models_without_float32_rounding(family):
    """tests/helpers/float64.py rewrites norms, RoPE and attention reductions from their definitions: the logits
    are Hugging Face's up to the float32 rounding it removes (~1e-7), and differ from them (the rewrite is in
    effect) wherever the model has such a step; GPT-2 has none and is unchanged."""
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = make_model(family).eval()(ids).logits
        library = make_model(family, torch.float32).double().eval()(ids).logits  # the same weights, unpatched
    error = float((exact - library).norm() / library.norm())
    assert (error == 0.0) if family == "gpt2" else (1e-9 < error < 1e-6), error


@pytest.mark.parametrize("config_name", ["dfs-keep", "dfs-recompute-chunk", "mask"])
def test_frozen_embeddings_and_first_layer(config_name, llama64):
    """As with LoRA or a frozen trunk: the first layers' keys/values carry no graph."""
    frozen = list(llama64.model.embed_tokens.parameters()) + list(llama64.model.layers[0].parameters())
    for p in frozen:
        p.requires_grad_(False)
    try:
        rollouts = random_tree_rollouts(random.Random(10), num_rollouts=8)
        check(llama64, rollouts, dta.PolicyLoss(), ENGINE_CONFIGS[config_name])
    finally:
        for p in frozen:
            p.requires_grad_(True)


@pytest.mark.parametrize("config_name", ["dfs-keep", "dfs-recompute-chunk", "mask"])
def test_lora_adapters_through_peft(config_name):
    """A PEFT-wrapped model (LoRA on q/v, base frozen): only adapter weights get gradients, exactly."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():  # LoRA's B starts at zero; make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    rollouts = random_tree_rollouts(random.Random(11), num_rollouts=8)
    check(model, rollouts, dta.PolicyLoss(kl_coef=0.1), ENGINE_CONFIGS[config_name])


@pytest.mark.parametrize("config_name", ["dfs-keep", "dfs-recompute-chunk", "dfs-keep-nobatch-treeorder"])
def test_sliding_window_shorter_than_the_rollouts(config_name):
    """The cache holds the whole path; the model's own sliding-window mask picks the keys, as in a forward."""
    model = make_model("mistral")
    rollouts = random_tree_rollouts(random.Random(9), num_rollouts=8)
    assert max(len(r) for r in rollouts) > 20
    full_window_loss, _ = reference_grads(model, rollouts, dta.PolicyLoss())
    model.config.sliding_window = 6
    assert reference_grads(model, rollouts, dta.PolicyLoss())[0] != pytest.approx(full_window_loss), \
        "the window must change the model's output for this test to mean anything"
    check(model, rollouts, dta.PolicyLoss(), ENGINE_CONFIGS[config_name])
    with pytest.raises(dta.ModelNotSupportedError, match="sliding window"):
        dta.tree_backward(model, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss(), mode="mask")


@pytest.mark.parametrize("where", ["config, after building", "config and attention modules", "attention modules"])
def test_a_sliding_window_anywhere_falls_back_to_the_model_attention(where):
    """Qwen3-MoE's forward reads ``config.sliding_window`` whatever ``use_sliding_window`` says (the flag only clears
    the field when the config is built): its mask applies the window, and each attention module passes the value it
    read when built, which a call refuses only once the keys outrun it (never in the 2-token probe).
    ``prefix_attention=None`` decides from every attention module and config before the walk and uses the model's
    own attention (exact); ``True`` refuses, naming the window."""
    model = make_model("qwen3moe")
    rollouts = random_tree_rollouts(random.Random(9), num_rollouts=8)
    full_window_loss, _ = reference_grads(model, rollouts, dta.PolicyLoss())
    if where.startswith("config"):
        model.config.sliding_window = 6
        assert not model.config.use_sliding_window
        assert reference_grads(model, rollouts, dta.PolicyLoss())[0] != pytest.approx(full_window_loss), \
            "the window must change the model's output for this test to mean anything"
    if where.endswith("modules"):  # as building the model from a config with the window sets them
        for layer in model.model.layers:
            layer.self_attn.sliding_window = 6
    check(model, rollouts, dta.PolicyLoss(), ENGINE_CONFIGS["dfs-keep"])
    window = "the model uses a sliding attention window" if where.startswith("config") else \
        "Qwen3MoeAttention of layer 0 has a 6-token sliding window"
    with pytest.raises(dta.ModelNotSupportedError, match=f"prefix_attention=True, but {window}"):
        dta.tree_backward(model, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss(), prefix_attention=True)


@pytest.mark.parametrize("agg", list(LOSSES))
@pytest.mark.parametrize("config_name", ["dfs-keep", "dfs-recompute-chunk", "mask", "vanilla",
                                         "dfs-keep-reference-kernels"])
def test_every_aggregation(agg, config_name, llama64):
    rollouts = random_tree_rollouts(random.Random(2), num_rollouts=9)
    rollouts.append(dta.Rollout(input_ids=[1, 2, 3], loss_mask=[0, 0, 0], advantages=1.0))  # nothing trained
    config = {**ENGINE_CONFIGS["dfs-keep"], **REFERENCE_KERNELS} if config_name == "dfs-keep-reference-kernels" \
        else ENGINE_CONFIGS[config_name]
    check(llama64, rollouts, LOSSES[agg], config)


def test_different_advantages_and_logprobs_on_a_shared_prefix(llama64):
    """Rollouts share a long prefix that is trained in each, with per-token advantages and behaviour
    log-probs that differ between them: the non-linear clip must be evaluated per (token, rollout)."""
    rng = random.Random(3)
    prefix = [rng.randrange(48) for _ in range(15)]
    rollouts = []
    for _ in range(5):
        ids = prefix + [rng.randrange(48) for _ in range(rng.randint(1, 6))]
        r = make_rollout(rng, ids)
        r.loss_mask = [0] + [1] * (len(ids) - 1)
        rollouts.append(r)
    # Behaviour log-probs near the model's own (noise of 0.3 nats): some ratios clip, some do not.
    current = dta.tree_logprobs(llama64, dta.PrefixTree.from_rollouts(rollouts))
    for r, logp in zip(rollouts, current):
        r.old_logprobs = [0.0] + [min(0.0, float(v) + rng.gauss(0, 0.3)) for v in logp]
        r.prox_logprobs = None
    for config in ("dfs-keep", "dfs-recompute-chunk", "mask"):
        _, out = check(llama64, rollouts, dta.PolicyLoss(clip_eps=0.1), ENGINE_CONFIGS[config])
        assert 0.1 < out.metrics["clip_fraction"] < 0.95


def test_sft_is_plain_nll(llama64):
    """advantages=1 without old log-probs is the token-mean negative log-likelihood."""
    rng = random.Random(4)
    rollouts = [dta.Rollout(input_ids=[rng.randrange(48) for _ in range(rng.randint(3, 12))], advantages=1.0)
                for _ in range(4)]
    tree = dta.PrefixTree.from_rollouts(rollouts)
    out, _ = engine_grads(llama64, tree, dta.PolicyLoss(), mode="dfs")
    nll, count = 0.0, 0
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.input_ids])
            logits = llama64(input_ids=ids).logits[0, :-1]
            nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            count += len(r.input_ids) - 1
    # pg = -ratio * A with ratio = 1: the loss value is -1 per token; the gradient is that of the NLL.
    assert out.loss == pytest.approx(-1.0)
    llama64.zero_grad(set_to_none=True)
    loss = sum(torch.nn.functional.cross_entropy(llama64(input_ids=torch.tensor([r.input_ids])).logits[0, :-1],
                                                 torch.tensor(r.input_ids[1:]), reduction="sum")
               for r in rollouts) / count
    loss.backward()
    expected = {n: p.grad.clone() for n, p in llama64.named_parameters()}
    _, got = engine_grads(llama64, tree, dta.PolicyLoss(), mode="dfs")
    assert_grads_close(got, expected, RTOL64, "sft")
    assert float(loss.detach()) == pytest.approx(nll / count)


@pytest.mark.parametrize("config_name", ["dfs-keep", "dfs-keep-model-attention", "dfs-recompute-chunk", "mask",
                                         "vanilla-batched"])
def test_float32_within_1e3(config_name):
    model = make_model("qwen2", torch.float32)
    rollouts = random_tree_rollouts(random.Random(5), num_rollouts=12)
    check(model, rollouts, dta.PolicyLoss(kl_coef=0.1, entropy_coef=0.01), ENGINE_CONFIGS[config_name], RTOL32)


def test_external_normalizer_scales_the_gradient(llama64):
    """A distributed step passes the global normaliser; gradients then scale by local / global."""
    rollouts = random_tree_rollouts(random.Random(6), num_rollouts=6)
    tree = dta.PrefixTree.from_rollouts(rollouts)
    loss_fn = dta.PolicyLoss()
    local = dta.tree_loss_normalizer(tree, loss_fn)
    base, g1 = engine_grads(llama64, tree, loss_fn, mode="dfs")
    scaled, g2 = engine_grads(llama64, tree, loss_fn, mode="dfs", normalizer=[3 * n for n in local])
    assert base.normalizer == local and scaled.normalizer == tuple(3 * n for n in local)
    assert scaled.loss == pytest.approx(base.loss / 3)
    assert_grads_close({n: 3 * g for n, g in g2.items()}, g1, RTOL64, "normalizer")


def test_gradients_add_to_existing_grad(llama64):
    rollouts = random_tree_rollouts(random.Random(7), num_rollouts=5)
    tree = dta.PrefixTree.from_rollouts(rollouts)
    _, once = engine_grads(llama64, tree, dta.PolicyLoss(), mode="dfs")
    llama64.zero_grad(set_to_none=True)
    dta.tree_backward(llama64, tree, dta.PolicyLoss(), mode="dfs")
    dta.tree_backward(llama64, tree, dta.PolicyLoss(), mode="dfs")
    twice = {n: p.grad.clone() for n, p in llama64.named_parameters() if p.grad is not None}
    llama64.zero_grad(set_to_none=True)
    assert_grads_close(twice, {n: 2 * g for n, g in once.items()}, RTOL64, "accumulate")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num=st.integers(1, 14), depth=st.integers(1, 5),
       per_token=st.booleans(), config_name=st.sampled_from(["dfs-keep", "dfs-recompute-chunk", "dfs-keep-chunk",
                                                            "dfs-recompute", "dfs-keep-model-attention", "mask-capped",
                                                            "mask"]),
       agg=st.sampled_from(list(LOSSES)))
def test_random_trees_property(seed, num, depth, per_token, config_name, agg, llama64):
    rollouts = random_tree_rollouts(random.Random(seed), num_rollouts=num, max_depth=depth, per_token=per_token)
    check(llama64, rollouts, LOSSES[agg], ENGINE_CONFIGS[config_name])


def test_auto_keeps_what_fits_and_recomputes_the_rest(llama64, monkeypatch):
    """With a tight budget the walk both keeps and recomputes inner batches, stays exact, and the measured bytes
    saved for backward stay under the budget; with a large one it keeps everything."""
    from lightning_dta.engine.activation_budget import ActivationBudget
    from lightning_dta.engine.memory import SavedTensorMeter

    decisions = []
    try_keep = ActivationBudget.try_keep
    monkeypatch.setattr(ActivationBudget, "try_keep", lambda self, p, room: decisions.append(try_keep(self, p, room))
                        or decisions[-1])
    rollouts = random_tree_rollouts(random.Random(1), num_rollouts=10)
    loss_fn = dta.PolicyLoss(clip_eps=0.2, kl_coef=0.1)
    for budget, mixed in ((400_000, True), (10**9, False)):
        decisions.clear()
        config = dict(mode="dfs", activation="auto", activation_memory_budget=budget)
        check(llama64, rollouts, loss_fn, config)
        assert any(decisions) and (not all(decisions)) == mixed, (budget, decisions)
        llama64.zero_grad(set_to_none=True)
        with SavedTensorMeter(llama64) as meter:
            dta.tree_backward(llama64, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **config)
        llama64.zero_grad(set_to_none=True)
        assert meter.peak_bytes <= budget, (meter.peak_bytes, budget)
    with pytest.raises(ValueError, match="below the path's key/value buffers"):
        dta.tree_backward(llama64, dta.PrefixTree.from_rollouts(rollouts), loss_fn, activation="auto",
                          activation_memory_budget=100)
    with pytest.raises(ValueError, match="activation_memory_budget is required"):
        dta.EngineOptions(activation="auto")
