"""The device self-check: a backend that disagrees with the model's attention is never trained on.

Deliberately wrong backends stand in for a kernel whose layout or arguments changed in a new release: each is
installed as the CPU default, and the engine must warn with the measured difference, fall back to the model's
own attention and stay exact (or refuse when prefix attention is required).
"""

from __future__ import annotations

import random
import warnings
from contextlib import contextmanager

import pytest
import torch

import lightning_dta as dta
from lightning_dta.engine import attention_backends, attention_check
from lightning_dta.engine.attention_backends import CPUFlashBackend, ReferenceBackend
from lightning_dta.engine.attention_check import KernelCheckWarning, check_kernels
from lightning_dta.engine.model_info import inspect_model
from lightning_dta.engine.prefix_attention import AttentionShape
from tests.helpers.models import make_model, random_tree_rollouts
from tests.helpers.reference import RTOL64, assert_grads_close, engine_grads, reference_grads


class WrongScale(CPUFlashBackend):
    """Forward and backward consistent with each other, but with a softmax scale 10% off."""

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        return super().forward(q, k, v, q_lens, k_lens, causal, scale * 1.1)

    def backward(self, grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        return super().backward(grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale * 1.1)


class WrongBackward(CPUFlashBackend):
    """A right forward with a key gradient 3% off."""

    def backward(self, grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        dq, dk, dv = super().backward(grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale)
        return dq, dk * 1.03, dv


class Raises(CPUFlashBackend):
    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        raise RuntimeError("invalid argument: unknown log-sum-exp layout")


@pytest.fixture
def installed(monkeypatch):
    """Install a backend as the CPU default, with the self-check's caches emptied for this test."""
    def install(backend_class):
        monkeypatch.setitem(attention_backends.BACKENDS, "cpu-flash", backend_class)
        monkeypatch.setattr(attention_check, "_CHECKED", {})
        monkeypatch.setattr(attention_check, "_WARNED", set())

    return install


@pytest.mark.parametrize("backend_class,message", [
    (WrongScale, r"differ from the model's attention on cpu torch.float64 by \d\.\d\de[-+]\d\d relative"),
    (WrongBackward, r"by \d\.\d\de-0[12] relative \((prefix )?key gradient"),
    (Raises, "kernels failed.*unknown log-sum-exp layout"),
])
def test_a_wrong_backend_warns_with_the_difference_and_falls_back(installed, backend_class, message):
    installed(backend_class)
    model = make_model("llama")
    rollouts = random_tree_rollouts(random.Random(3), num_rollouts=8)
    with pytest.warns(KernelCheckWarning, match=message):
        info = inspect_model(model, True, None, None)
    assert not info.packs_siblings and info.attention_backend is None  # the model's attention with a KV cache
    ref_loss, ref = reference_grads(model, rollouts, dta.PolicyLoss())
    out, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss(), mode="dfs")
    assert out.loss == pytest.approx(ref_loss, rel=RTOL64)
    assert_grads_close(got, ref, RTOL64, what=backend_class.__name__)


def test_a_wrong_backend_is_refused_when_prefix_attention_is_required(installed):
    installed(WrongScale)
    with pytest.warns(KernelCheckWarning), \
            pytest.raises(dta.ModelNotSupportedError, match="prefix_attention=True, but .*differ from the model"):
        dta.tree_backward(make_model("qwen2"), dta.PrefixTree.from_rollouts(
            random_tree_rollouts(random.Random(4), num_rollouts=4)), dta.PolicyLoss(), prefix_attention=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_3_percent_gradient_error_is_caught_in_every_dtype(dtype):
    with pytest.warns(KernelCheckWarning, match="key gradient"):
        assert check_kernels(WrongBackward(), torch.device("cpu"), AttentionShape(8, 2, 64, dtype, 0.125))


def test_the_right_backend_passes_in_every_dtype():
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for heads, kv_heads in ((4, 2), (2, 2), (8, 1)):
            shape = AttentionShape(heads, kv_heads, 16, dtype, 0.25)
            for backend in (CPUFlashBackend(), attention_backends.ReferenceBackend()):
                assert check_kernels(backend, torch.device("cpu"), shape) is None, (backend.name, dtype, heads)


def test_the_check_runs_under_inference_mode_and_keeps_prefix_attention(installed):
    """RL code scores reference log-probs under torch.inference_mode(); the first call's self-check must still
    run with autograd (it backpropagates through the kernels) and must not turn prefix attention off."""
    installed(CPUFlashBackend)
    model = make_model("llama")
    tree = dta.PrefixTree.from_rollouts(random_tree_rollouts(random.Random(5), num_rollouts=6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCheckWarning)
        with torch.inference_mode():
            dta.tree_logprobs(model, tree)
        assert inspect_model(model, True, None, None).packs_siblings


def test_an_error_of_the_check_itself_is_not_cached(installed, monkeypatch):
    """Only a kernel's own verdict is cached: an error of the check's reference (here: out of host memory)
    falls back for that call and the next call checks again."""
    installed(CPUFlashBackend)
    shape = AttentionShape(4, 2, 16, torch.float32, 0.25)
    real, failures = attention_check.model_attention, ["DefaultCPUAllocator: not enough memory"]

    def fails_once(*args, **kwargs):
        if failures:
            raise RuntimeError(failures.pop())
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_check, "model_attention", fails_once)
    with pytest.warns(KernelCheckWarning, match="not enough memory"):
        assert check_kernels(CPUFlashBackend(), torch.device("cpu"), shape) is not None
    assert check_kernels(CPUFlashBackend(), torch.device("cpu"), shape) is None


def test_the_check_is_one_deliberate_host_read(installed, monkeypatch):
    """Under torch.cuda.set_sync_debug_mode("error") the first step's check must not trip the mode: its inputs,
    kernels and reference run inside the deliberate-sync scope. (CUDA's mode has no CPU counterpart: the scope is
    recorded instead, and the GPU test runs a first step under the mode.)"""
    installed(CPUFlashBackend)
    inside = []

    @contextmanager
    def recorded(device):
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    class AssertsTheScope(CPUFlashBackend):
        def forward(self, *args):
            assert inside, "a kernel of the check ran outside the deliberate-sync scope"
            return super().forward(*args)

    monkeypatch.setattr(attention_check, "expected_sync", recorded)
    assert check_kernels(AssertsTheScope(), torch.device("cpu"), AttentionShape(4, 2, 16, torch.float32, 0.25)) is None


class WrongForOneQuery(CPUFlashBackend):
    """Right except where every query sequence is one token long with grouped-query heads (flash-attn's
    max_seqlen_q == 1 path, which reshapes the queries and the log-sum-exp): the query heads come out swapped
    within each group."""

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        out, lse = super().forward(q, k, v, q_lens, k_lens, causal, scale)
        if q_lens.max_len == 1 and q.shape[1] > k.shape[1]:
            groups = q.shape[1] // k.shape[1]
            order = torch.arange(q.shape[1]).view(k.shape[1], groups).flip(1).flatten()
            out, lse = out[:, order], lse[order]
        return out, lse


class WrongForOneToken(CPUFlashBackend):
    """Right except for a row of a single query token (T = 1): its log-sum-exp comes out 0.1 too small."""

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        out, lse = super().forward(q, k, v, q_lens, k_lens, causal, scale)
        return out, lse - 0.1 if q.shape[0] == 1 else lse


class AssumesHeadsFirst(CPUFlashBackend):
    """Reads keys/values as if they were contiguous ``[heads, tokens, dim]`` (a kernel that takes its head stride
    from the shape instead of the tensor): wrong for the path buffers' prefix views and the projections' layout."""

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        k, v = (torch.as_strided(t, t.shape, (t.shape[2], t.shape[0] * t.shape[2], 1), t.storage_offset())
                for t in (k, v))
        return super().forward(q, k, v, q_lens, k_lens, causal, scale)


@pytest.mark.parametrize("backend_class,case", [
    (WrongForOneQuery, "4 one-token chunks over a 23-token prefix (max_seqlen_q = 1)"),
    (WrongForOneToken, "1 token over a 29-token prefix (T = 1)"),
    (AssumesHeadsFirst, "2 chunks of 7, 4 tokens over a strided 19-token prefix view"),
])
def test_paths_a_real_run_takes_are_checked(backend_class, case):
    """One-token chunks over a prefix, a single query token, and the memory layouts real runs hand over (the
    projections' tokens-major queries and keys, the path buffers' strided prefix views): each wrong backend is
    refused, and the case made for it finds it on its own."""
    shape = AttentionShape(4, 2, 16, torch.float32, 0.25)
    with pytest.warns(KernelCheckWarning, match="differ from the model's attention"):
        assert check_kernels(backend_class(), torch.device("cpu"), shape)
    (case,) = [c for c in attention_check.CASES if c.what == case]
    figures = attention_check.measure(backend_class(), torch.device("cpu"), shape, (case,))
    assert max(f.error for f in figures) > 1e-2, figures


def test_the_long_case_compares_with_float32_and_runs_on_cuda_only():
    """The multi-tile case (8K-token prefix, 2K-token chunk) runs where it is cheap, on CUDA; its comparison with
    a float32 reference is the same code, checked here on a shorter case with the reference kernels."""
    long_case, cases_for = attention_check.LONG_CASE, attention_check.cases_for
    assert long_case in cases_for(torch.device("cuda")) and long_case not in cases_for(torch.device("cpu"))
    assert (long_case.prefix, long_case.lengths, long_case.reference) == (8192, (2048,), torch.float32)
    short = attention_check.Case("a 96-token chunk over a 320-token prefix, against float32", (96,), 320, buffer=64,
                                 reference=torch.float32)
    shape, cpu = AttentionShape(4, 2, 16, torch.bfloat16, 0.25), torch.device("cpu")
    figures = attention_check.measure(ReferenceBackend(), cpu, shape, (short,))
    assert len(figures) == 6 and all(0 < f.error < 1e-2 for f in figures), figures  # bf16 rounding only
    assert attention_check.verdict(ReferenceBackend(), cpu, shape, figures) is None
    wrong = attention_check.measure(WrongBackward(), cpu, shape, (short,))
    assert "key gradient" in attention_check.verdict(WrongBackward(), cpu, shape, wrong)
