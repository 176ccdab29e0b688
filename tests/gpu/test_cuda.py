"""On a CUDA device: the prefix-attention kernels, exactness in float32 and bfloat16, memory, no host syncs.

Skipped without CUDA (``pytest -m gpu`` on a GPU machine; ``benchmarks/gpu.sh`` runs these first). The same
glue runs on the CPU in float64 with the reference kernels (tests/engine/test_prefix_attention.py,
test_exactness.py); these check what only a GPU can: the flash kernels themselves, bf16 agreement, the CUDA
allocator's peak and that the walk never waits for the device.
"""

from __future__ import annotations

import importlib.util
import random
import warnings

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import lightning_dta as dta
from lightning_dta.bench.runner import saved_peak_bytes
from lightning_dta.engine import attention_check
from lightning_dta.engine.attention_backends import BACKENDS, choose_backend
from lightning_dta.engine.attention_check import KernelCheckWarning
from lightning_dta.engine.model_info import inspect_model
from lightning_dta.engine.prefix_attention import PackedLayout, PrefixCausalAttention
from lightning_dta.shapes.modes import ModeSpec
from tests.engine.test_prefix_attention import reference, spans_of
from tests.helpers.reference import assert_grads_close, engine_grads, reference_grads

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def cuda_model(dtype: torch.dtype, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    config._attn_implementation = attn
    with torch.device(CUDA):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).train()


def grpo_rollouts(seed: int, prompts: int = 2, group: int = 8, prompt_len: int = 300) -> list[dta.Rollout]:
    rng = random.Random(seed)
    rollouts = []
    for p in range(prompts):
        prompt = [p + 1] + [rng.randrange(512) for _ in range(prompt_len - 1)]
        for _ in range(group):
            response = [rng.randrange(512) for _ in range(rng.randint(20, 60))]
            old = [0.0] + [-rng.uniform(0.5, 6.0) for _ in range(len(prompt) + len(response) - 1)]
            rollouts.append(dta.Rollout(input_ids=prompt + response, loss_mask=[0] * len(prompt) + [1] * len(response),
                                        advantages=rng.gauss(0, 1), old_logprobs=old))
    return rollouts


def agent_rollouts(seed: int) -> list[dta.Rollout]:
    """Calls of an episode: each extends the previous call's context (a multi-level tree)."""
    rng = random.Random(seed)
    context, rollouts = [rng.randrange(512) for _ in range(200)], []
    for _ in range(4):
        answer = [rng.randrange(512) for _ in range(rng.randint(20, 50))]
        ids = context + answer
        rollouts.append(dta.Rollout(input_ids=ids, loss_mask=[0] * len(context) + [1] * len(answer),
                                    advantages=rng.gauss(0, 1)))
        context = ids + [rng.randrange(512) for _ in range(rng.randint(10, 40))]
    return rollouts


def present_backends(dtype: torch.dtype) -> list[str]:
    return [name for name in BACKENDS if choose_backend(name, CUDA, dtype)[0] is not None]


def test_the_default_backend_passes_its_self_check_on_this_gpu():
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCheckWarning)
        info = inspect_model(cuda_model(torch.bfloat16), True, True, None)
    assert info.attention_backend.name in ("cuda-flash", "flash-attn"), info
    print(f"{torch.cuda.get_device_name()}: default prefix-attention backend {info.attention_backend.name}; present "
          f"in bf16: {present_backends(torch.bfloat16)}")


@pytest.mark.parametrize("backend_name", ["cuda-flash", "flash-attn", "reference"])
def test_glue_at_realistic_sizes_in_bfloat16(backend_name):
    backend, reason = choose_backend(backend_name, CUDA, torch.bfloat16)
    if backend is None:
        pytest.skip(reason)
    lengths, prefix_len, heads, kv_heads, dim = (300, 1, 700, 64), 1000, 16, 8, 128
    gen = torch.Generator(device=CUDA).manual_seed(0)
    exact = [torch.randn(*shape, generator=gen, device=CUDA, dtype=torch.float64).requires_grad_() for shape in (
        (1, heads, sum(lengths), dim), (1, kv_heads, prefix_len, dim), (1, kv_heads, prefix_len, dim),
        (1, kv_heads, sum(lengths), dim), (1, kv_heads, sum(lengths), dim))]
    half = [t.detach().bfloat16().requires_grad_() for t in exact]
    grad_out = torch.randn(1, sum(lengths), heads, dim, generator=gen, device=CUDA, dtype=torch.float64)
    layout = PackedLayout.of(spans_of(lengths), prefix_len, CUDA)
    got = PrefixCausalAttention.apply(*half, layout, dim ** -0.5, backend)
    got_grads = torch.autograd.grad(got, half, grad_out.bfloat16())
    with torch.device(CUDA):
        want = reference(*exact, spans_of(lengths), dim ** -0.5)
    want_grads = torch.autograd.grad(want, exact, grad_out)
    for name, g, w in zip(("out", "dq", "dpk", "dpv", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        error = float((g.detach().double() - w.detach()).norm() / w.detach().norm())
        assert error < 2e-2, f"{backend_name} {name}: {error:.2e}"


@pytest.mark.parametrize("rollouts", [grpo_rollouts(1), agent_rollouts(2)], ids=["grpo", "agent"])
def test_float32_exact_with_reference_kernels_and_model_attention(rollouts):
    model = cuda_model(torch.float32)
    loss_fn = dta.PolicyLoss(kl_coef=0.0, entropy_coef=0.01)
    ref_loss, ref = reference_grads(model, rollouts, loss_fn)
    tree = dta.PrefixTree.from_rollouts(rollouts)
    for options in (dict(prefix_attention=True, prefix_attention_backend="reference"), dict(prefix_attention=False),
                    dict(prefix_attention=False, activation="recompute", chunk_size=64)):
        out, got = engine_grads(model, tree, loss_fn, **options)
        assert out.loss == pytest.approx(ref_loss, rel=1e-4), options
        assert_grads_close(got, ref, 1e-3, what=str(options))


def _cosine(a: dict, b: dict) -> float:
    x = torch.cat([a[n].double().flatten() for n in sorted(b)])
    y = torch.cat([b[n].double().flatten() for n in sorted(b)])
    return float(x @ y / (x.norm() * y.norm()))


BF16_PATHS = [("prefix", name) for name in BACKENDS] + [("model", "sdpa"), ("model", "flash_attention_2")]


@pytest.mark.parametrize("path,name", BF16_PATHS, ids=[f"{p}-{n}" for p, n in BF16_PATHS])
@pytest.mark.parametrize("rollouts", [grpo_rollouts(3), agent_rollouts(4)], ids=["grpo", "agent"])
def test_bfloat16_agrees_with_per_rollout_training(path, name, rollouts):
    loss_fn = dta.PolicyLoss(entropy_coef=0.01)
    if path == "prefix":
        backend, reason = choose_backend(name, CUDA, torch.bfloat16)
        if backend is None:
            pytest.skip(reason)
        model, options = cuda_model(torch.bfloat16), dict(prefix_attention=True, prefix_attention_backend=name)
    else:
        if name == "flash_attention_2" and not HAS_FLASH_ATTN:
            pytest.skip("flash_attention_2 needs flash-attn")
        model, options = cuda_model(torch.bfloat16, attn=name), dict(prefix_attention=False)
    ref_loss, ref = reference_grads(cuda_model(torch.bfloat16), rollouts, loss_fn)
    out, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **options)
    assert out.loss == pytest.approx(ref_loss, rel=1e-2)
    cosine = _cosine(got, ref)
    print(f"{torch.cuda.get_device_name()} bf16 {path}-{name}: loss {out.loss:.5f} vs {ref_loss:.5f}, "
          f"gradient cosine {cosine:.6f}")
    assert cosine >= 0.999


def test_dfs_peak_memory_is_flat_in_leaves():
    model = cuda_model(torch.bfloat16)
    peaks = {}
    for leaves in (4, 8, 16):
        tree = dta.PrefixTree.from_rollouts(grpo_rollouts(5, prompts=1, group=leaves, prompt_len=1500))
        # warm-up: allocator, probe, self-check
        dta.tree_backward(model, tree, dta.PolicyLoss(), sibling_batch_tokens=None)
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        dta.tree_backward(model, tree, dta.PolicyLoss(), sibling_batch_tokens=None)
        torch.cuda.synchronize()
        peaks[leaves] = torch.cuda.max_memory_allocated() - before
    print(f"{torch.cuda.get_device_name()}: dfs peak above weights+grads by leaves {peaks}")
    assert peaks[16] <= 1.1 * peaks[4], peaks


def test_the_walk_never_waits_for_the_device(monkeypatch):
    """Every host-to-device copy is non-blocking from pinned memory and nothing reads the device inside the walk,
    from the first step of a fresh model on: its probe forward, the kernels' self-check (a deliberate read) and
    ``activation="auto"``'s rate probe run under the mode too. The step's result is its one deliberate read, and
    GSPO's sequence log-ratios (a forward-only walk before the step) a second. (Prefix attention only: the fallback
    through the model's own attention runs transformers' mask builder, which reads the mask.)"""
    tree = dta.PrefixTree.from_rollouts(grpo_rollouts(6) + agent_rollouts(7))
    keep = saved_peak_bytes(cuda_model(torch.bfloat16), tree, ModeSpec(dta.EngineOptions()))
    monkeypatch.setattr(attention_check, "_CHECKED", {})  # the self-check runs again, under the mode
    model = cuda_model(torch.bfloat16)
    options = [dict(), dict(activation="recompute", chunk_size=32), dict(sibling_batch_tokens=None),
               dict(activation="auto", activation_memory_budget=int(0.6 * keep)),
               dict(activation="auto", activation_memory_budget=int(0.6 * keep), chunk_size=48)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for engine in options:
            dta.tree_backward(model, tree, dta.PolicyLoss(), **engine)
        dta.tree_backward(model, tree, dta.PolicyLoss(loss_mode="gspo"))
        dta.tree_logprobs(model, tree)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("backend", ["cuda-flash", "flash-attn"])
def test_forward_only_cousin_batches_agree_with_the_reference_kernels(backend):
    """The forward-only walk packs cousins (each chunk over its own ancestor levels); on the device's flash kernels
    in bf16 its log-probs agree with the same walk on the reference kernels in float32 (same weights)."""
    if choose_backend(backend, CUDA, torch.bfloat16)[0] is None:
        pytest.skip(f"{backend} is not available here")
    rng = random.Random(8)
    paths = [[rng.randrange(512) for _ in range(120)]]
    for width in (3, 3, 2):
        paths = [p + [j + 1] + [rng.randrange(512) for _ in range(rng.randint(10, 40))] for p in paths
                 for j in range(width)]
    tree = dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=p) for p in paths] + grpo_rollouts(9))
    got = torch.cat(dta.tree_logprobs(cuda_model(torch.bfloat16).eval(), tree, prefix_attention=True,
                                      prefix_attention_backend=backend)).double()
    want = torch.cat(dta.tree_logprobs(cuda_model(torch.float32).eval(), tree, prefix_attention=True,
                                       prefix_attention_backend="reference")).double()
    error = float((got - want).norm() / want.norm())
    print(f"{torch.cuda.get_device_name()} bf16 {backend} cousin walk: log-prob relative error {error:.2e}")
    assert error < 2e-2, error
