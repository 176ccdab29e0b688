"""The device self-check: a backend that disagrees with the model's attention is never trained on.

Deliberately wrong backends stand in for a kernel whose layout or arguments changed in a new release: each is
installed as the CPU default, and the engine must warn with the measured difference, fall back to the model's
own attention and stay exact (or refuse when prefix attention is required).
"""

from __future__ import annotations

import random

import pytest
import torch

import lightning_dta as dta
from lightning_dta.engine import attention_backends, attention_check
from lightning_dta.engine.attention_backends import CPUFlashBackend
from lightning_dta.engine.attention_check import KernelCheckWarning
from lightning_dta.engine.model_info import inspect_model
from tests.helpers.models import make_model, random_tree_rollouts
from tests.helpers.reference import assert_grads_close, engine_grads, reference_grads


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
    assert out.loss == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_close(got, ref, 1e-5, what=backend_class.__name__)


def test_a_wrong_backend_is_refused_when_prefix_attention_is_required(installed):
    installed(WrongScale)
    with pytest.warns(KernelCheckWarning), \
            pytest.raises(dta.ModelNotSupportedError, match="prefix_attention=True, but .*differ from the model"):
        dta.tree_backward(make_model("qwen2"), dta.PrefixTree.from_rollouts(
            random_tree_rollouts(random.Random(4), num_rollouts=4)), dta.PolicyLoss(), prefix_attention=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_3_percent_gradient_error_is_caught_in_every_dtype(dtype):
    from lightning_dta.engine.attention_check import check_kernels
    from lightning_dta.engine.prefix_attention import AttentionShape

    with pytest.warns(KernelCheckWarning, match="key gradient"):
        assert check_kernels(WrongBackward(), torch.device("cpu"), AttentionShape(8, 2, 64, dtype, 0.125))


def test_the_right_backend_passes_in_every_dtype():
    from lightning_dta.engine.attention_check import check_kernels
    from lightning_dta.engine.prefix_attention import AttentionShape

    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for heads, kv_heads in ((4, 2), (2, 2), (8, 1)):
            shape = AttentionShape(heads, kv_heads, 16, dtype, 0.25)
            for backend in (CPUFlashBackend(), attention_backends.ReferenceBackend()):
                assert check_kernels(backend, torch.device("cpu"), shape) is None, (backend.name, dtype, heads)
