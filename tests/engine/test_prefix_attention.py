"""Prefix attention against plain attention over [prefix, own keys] with an explicit mask, per span.

The end-to-end exactness tests run it inside real models; these pin the kernel glue itself, for every
backend: packed spans that must not see each other, grouped-query heads, spans of one token, no prefix, one
span, and half precision. The CUDA backends run here with their flash functions replaced by stand-ins of the
same signatures (tests/helpers/flash_fakes.py), so their argument plumbing is tested on the CPU in float64; flash-attn
also as the package defines it, torch custom ops (tests/helpers/flash_attn_custom_ops.py).
"""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_dta.engine.attention_backends import (
    BACKENDS,
    CPUFlashBackend,
    CudaFlashBackend,
    FlashAttnBackend,
    ReferenceBackend,
    Varlen,
    argument_names,
    choose_backend,
)
from lightning_dta.engine.options import choices
from lightning_dta.engine.prefix_attention import PackedLayout, PrefixCausalAttention
from tests.helpers import flash_attn_custom_ops, flash_fakes

BACKEND_UNDER_TEST = {
    "reference": ReferenceBackend,
    "cpu-flash": CPUFlashBackend,
    "cuda-flash": lambda: CudaFlashBackend(flash_fakes.aten_flash_forward, flash_fakes.aten_flash_backward),
    "flash-attn": lambda: FlashAttnBackend(flash_fakes.flash_attn_varlen_forward,
                                           flash_fakes.flash_attn_varlen_backward),
}


def reference(query, prefix_keys, prefix_values, keys, values, spans, scale):
    """Each span alone, from the definition: softmax(q k^T * scale) v over the prefix and the span's own keys
    (query i of a span sees the whole prefix and the span's keys 0..i); ``[1, H, T, D]`` in, ``[1, T, H, D]`` out."""
    rep = query.shape[1] // keys.shape[1]
    rows = []
    for a, n in spans:
        for i in range(n):
            k, v = keys[0, :, a:a + i + 1], values[0, :, a:a + i + 1]
            if prefix_keys is not None:
                k, v = torch.cat([prefix_keys[0], k], 1), torch.cat([prefix_values[0], v], 1)
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # kv head j serves query heads j*rep..
            scores = torch.einsum("hd,hkd->hk", query[0, :, a + i], k) * scale
            rows.append(torch.einsum("hk,hkd->hd", scores.softmax(-1), v))
    return torch.stack(rows)[None]


def spans_of(lengths):
    return tuple((sum(lengths[:i]), n) for i, n in enumerate(lengths))


def inputs(dtype, lengths, prefix_len, heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    prefix = (rand(1, kv_heads, prefix_len, dim), rand(1, kv_heads, prefix_len, dim)) if prefix_len else (None, None)
    return rand(1, heads, total, dim), *prefix, rand(1, kv_heads, total, dim), rand(1, kv_heads, total, dim)


def grads(fn, tensors, grad_out):
    out = fn(*tensors)
    wanted = [t for t in tensors if t is not None]
    return out, torch.autograd.grad(out, wanted, grad_out)


def glue(backend, lengths, prefix_len, scale):
    layout = PackedLayout.of(spans_of(lengths), prefix_len, torch.device("cpu"))
    return lambda *t: PrefixCausalAttention.apply(*t, layout, scale, backend)


CASES = {
    "one span": ((5,), 7),
    "many spans, one of length 1": ((3, 6, 1), 11),
    "spans of length 1": ((1, 1, 1, 1), 5),
    "no prefix": ((4, 4), 0),
    "no prefix, one span": ((6,), 0),
    "one token over a prefix": ((1,), 9),
}
HEADS = {"grouped-query": (4, 2), "multi-head": (3, 3), "multi-query": (4, 1)}


@pytest.mark.parametrize("backend_name", list(BACKEND_UNDER_TEST))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", list(HEADS))
def test_every_backend_matches_masked_attention_in_float64(backend_name, case, heads):
    lengths, prefix_len = CASES[case]
    tensors = inputs(torch.float64, lengths, prefix_len, *HEADS[heads])
    grad_out = torch.randn(1, sum(lengths), HEADS[heads][0], 8, dtype=torch.float64)
    got, got_grads = grads(glue(BACKEND_UNDER_TEST[backend_name](), lengths, prefix_len, 0.3), tensors, grad_out)
    want, want_grads = grads(lambda *t: reference(*t, spans_of(lengths), 0.3), tensors, grad_out)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend_name", ["cpu-flash", "reference"])
def test_bfloat16_close_to_float64(backend_name):
    lengths, prefix_len = (16, 24), 32
    exact = inputs(torch.float64, lengths, prefix_len, seed=1)
    half = [t.detach().to(torch.bfloat16).requires_grad_() for t in exact]
    grad_out = torch.randn(1, sum(lengths), 4, 8, dtype=torch.float64)
    want, want_grads = grads(lambda *t: reference(*t, spans_of(lengths), 0.35), exact, grad_out)
    got, got_grads = grads(glue(BACKENDS[backend_name](), lengths, prefix_len, 0.35), half, grad_out.bfloat16())
    assert got.dtype == torch.bfloat16
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        error = (g.double() - w).norm() / w.norm()
        assert error < 2e-2, float(error)  # bf16 keeps ~3 significant digits; a wrong merge is off by O(1)


def test_backend_names_are_the_engine_option_choices():
    assert set(BACKENDS) == set(choices("prefix_attention_backend"))


def test_default_backend_per_device():
    cpu = torch.device("cpu")
    assert choose_backend(None, cpu, torch.float32)[0].name == "cpu-flash"
    backend, reason = choose_backend("cuda-flash", cpu, torch.bfloat16)
    assert backend is None and "runs on CUDA and the model is on cpu" in reason
    backend, reason = choose_backend(None, torch.device("meta"), torch.float32)
    assert backend is None and "no prefix-attention kernel runs on meta" in reason


def test_cuda_flash_schema_of_this_torch_is_known():
    """The aten flash ops are registered in every build: their schema is checked here, not only on a GPU."""
    backend = CudaFlashBackend()
    assert backend.schema_problem is None, backend.schema_problem
    assert backend.rng_args == ("rng_state", "unused")


def test_unknown_kernel_signatures_are_refused_with_the_arguments():
    def renamed(q, k, v, cu_q, cu_k, max_q, max_k):  # a release that renamed its arguments
        raise AssertionError("never called")

    backend = CudaFlashBackend(renamed, flash_fakes.aten_flash_backward)
    assert "which lightning_dta does not know" in backend.unsupported(torch.device("cpu"), torch.bfloat16)
    flash = FlashAttnBackend(renamed, flash_fakes.flash_attn_varlen_backward)
    assert "cu_seqlens_q" in flash.unsupported(torch.device("cpu"), torch.bfloat16)


def test_flash_attn_missing_is_a_reason_not_an_error():
    backend = FlashAttnBackend()
    reason = backend.unsupported(torch.device("cpu"), torch.bfloat16)
    assert reason is not None  # not installed here, or (if it is) CUDA-only


def test_argument_names_of_every_kind_of_op():
    """Op overloads and packets carry a FunctionSchema; a torch.library.custom_op (flash-attn >= 2.7) a schema
    string in ``_schema``; plain functions a signature."""
    custom = flash_attn_custom_ops._flash_attn_varlen_forward
    assert isinstance(custom._schema, str)
    want = list(FlashAttnBackend.FORWARD_ARGS) + ["block_table", "leftpad_k", "seqused_k", "zero_tensors"]
    packet = flash_attn_custom_ops._wrapped_flash_attn_varlen_forward
    for fn in (custom, packet, packet.default, custom._init_fn):
        assert argument_names(fn) == want
    assert argument_names(flash_fakes.flash_attn_varlen_forward) == want[:-1]  # a plain function
    assert argument_names(CudaFlashBackend().forward_op)[:3] == ["query", "key", "value"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", list(HEADS))
def test_flash_attn_custom_ops_match_masked_attention(case, heads):
    """flash-attn 2.8's functions as the package defines them (custom ops, float32 log-sum-exp, in-place
    gradients), run on the CPU: the ``max_seqlen_q == 1`` grouped-query cases take its reshaping path."""
    backend = FlashAttnBackend(flash_attn_custom_ops._flash_attn_varlen_forward,
                               flash_attn_custom_ops._flash_attn_varlen_backward)
    assert backend.problem is None, backend.problem
    lengths, prefix_len = CASES[case]
    tensors = inputs(torch.float64, lengths, prefix_len, *HEADS[heads])
    grad_out = torch.randn(1, sum(lengths), HEADS[heads][0], 8, dtype=torch.float64)
    got, got_grads = grads(glue(backend, lengths, prefix_len, 0.3), tensors, grad_out)
    want, want_grads = grads(lambda *t: reference(*t, spans_of(lengths), 0.3), tensors, grad_out)
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)  # the log-sum-exp is float32, as on the GPU


def test_the_flash_attn_package_as_installed_is_found_and_refused_with_a_reason(monkeypatch):
    """With the real package's custom ops importable, the backend is built, and on a CPU it is refused with
    the reason: choosing it never raises."""
    for name, module in flash_attn_custom_ops.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    backend = FlashAttnBackend()
    assert backend.forward_fn is flash_attn_custom_ops._flash_attn_varlen_forward
    assert backend.problem is None
    assert "runs on CUDA" in backend.unsupported(torch.device("cpu"), torch.bfloat16)
    chosen, reason = choose_backend("flash-attn", torch.device("cpu"), torch.bfloat16)
    assert chosen is None and "flash-attn runs on CUDA and the model is on cpu" in reason


@pytest.mark.parametrize("backend_name", list(BACKEND_UNDER_TEST))
def test_a_prefix_that_is_a_view_of_the_path_buffers(backend_name):
    """The engine's prefix is ``buffer[:, :, :start]`` of the path's key/value buffers (strided over tokens), its
    queries and own keys are the projections' ``[1, T, H, D]`` seen as ``[1, H, T, D]``."""
    lengths, prefix_len, capacity = (3, 1, 4), 10, 24
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    query, keys, values = (rand(1, sum(lengths), h, 8).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
    prefix = [rand(1, 2, capacity, 8)[:, :, :prefix_len].requires_grad_() for _ in range(2)]
    tensors = (query, *prefix, keys, values)
    assert not prefix[0].is_contiguous() and not query.is_contiguous()
    grad_out = torch.randn(1, sum(lengths), 4, 8, dtype=torch.float64)
    got, got_grads = grads(glue(BACKEND_UNDER_TEST[backend_name](), lengths, prefix_len, 0.3), tensors, grad_out)
    want, want_grads = grads(lambda *t: reference(*t, spans_of(lengths), 0.3), tensors, grad_out)
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_the_glue_makes_causal_calls_only_over_equal_lengths():
    """Where causal alignment would matter (query and key sequences of different lengths) the glue never asks
    for a causal mask, so a kernel's alignment (PyTorch's CPU flash kernel is top-left, flash-attention's CUDA
    kernels bottom-right) never changes what it computes."""
    calls = []

    class Recording(ReferenceBackend):
        def forward(self, q, k, v, q_lens, k_lens, causal, scale):
            calls.append((causal, q_lens.offsets, k_lens.offsets))
            return super().forward(q, k, v, q_lens, k_lens, causal, scale)

        def backward(self, grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale):
            calls.append((causal, q_lens.offsets, k_lens.offsets))
            return super().backward(grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale)

    for lengths, prefix_len in CASES.values():
        tensors = inputs(torch.float64, lengths, prefix_len)
        grads(glue(Recording(), lengths, prefix_len, 0.3), tensors, torch.randn(1, sum(lengths), 4, 8,
                                                                               dtype=torch.float64))
    assert any(not causal and q != k for causal, q, k in calls)  # the prefix calls: non-causal, q != k
    assert all(q == k for causal, q, k in calls if causal)


def test_cpu_flash_is_top_left_aligned_where_lengths_differ():
    """Measured, so that docs/kernels.md says the truth: PyTorch's CPU flash kernel aligns a causal mask top-left
    (query i sees keys 0..i), unlike the reference backend and flash-attention's CUDA kernels (bottom-right)."""
    q, k, v = (torch.randn(n, 2, 8, dtype=torch.float64) for n in (3, 7, 7))
    q_lens, k_lens = (Varlen.of((n,), torch.device("cpu")) for n in (3, 7))
    cpu, _ = CPUFlashBackend().forward(q, k, v, q_lens, k_lens, True, 0.3)
    bottom_right, _ = ReferenceBackend().forward(q, k, v, q_lens, k_lens, True, 0.3)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    top_left = torch.einsum("hqk,khd->qhd", scores.masked_fill(~torch.ones(3, 7, dtype=torch.bool).tril(),
                                                               float("-inf")).softmax(-1), v)
    torch.testing.assert_close(cpu, top_left)
    assert (cpu - bottom_right).abs().max() > 0.1


def test_mixed_precision_keeps_prefix_attention_and_its_gradient():
    """Under bfloat16 autocast (``bf16-mixed``, and ``16-mixed``, which Lightning turns into it on a CPU) a Llama's
    keys leave RoPE in float32 and its values the projection in bfloat16. The kernels used to get both dtypes, the
    self-check failed ("expected scalar type Float but found BFloat16") and prefix attention fell back; the inputs
    are now cast as the model's own attention (SDPA, an autocast op) casts them.

    Both paths are compared with the per-rollout gradient in float64 (not with each other): the model's own
    attention under autocast is torch's CPU flash kernel, whose bfloat16 backward depends on the instruction set
    (measured 0.79% with AVX2, 13% with AVX-512), so it cannot be the reference. Prefix attention is held to
    bfloat16 rounding (measured 0.72-0.77% whatever the instruction set); the model's attention only to being the
    same gradient."""
    import copy
    import warnings

    import lightning_dta as dta
    from lightning_dta.engine.attention_check import KernelCheckWarning
    from lightning_dta.engine.model_info import inspect_model
    from tests.helpers.lightning import grpo_rollouts, tiny_llama
    from tests.helpers.reference import engine_grads, reference_grads

    model, rollouts = tiny_llama(), grpo_rollouts()
    _, exact = reference_grads(copy.deepcopy(model).double(), rollouts, dta.PolicyLoss())
    exact_flat = torch.cat([g.flatten() for g in exact.values()])
    errors = {}
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("error", KernelCheckWarning)
        assert inspect_model(model, True, None, None).attention_backend is not None  # prefix attention is used
        for prefix in (None, False):
            _, grads = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss(),
                                    prefix_attention=prefix)
            flat = torch.cat([grads[name].double().flatten() for name in exact])
            errors[prefix] = float((flat - exact_flat).norm() / exact_flat.norm())
    assert 1e-4 < errors[None] < 2e-2, errors  # bfloat16 rounding (so autocast is on), not a wrong gradient
    assert errors[False] < 0.5, errors  # torch's kernel: its accuracy is not this project's to bound tightly
