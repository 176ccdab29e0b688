"""The recurrent mixers' device self-check (``lightning_dta.engine.recurrent_check``), on the CPU in float64.

On CUDA transformers' mixers call fla / causal-conv1d / mamba_ssm kernels where installed; here "kernels" are fakes
put where transformers puts them (the modeling module's function, keeping the pure-PyTorch one as ``__wrapped__``):
one that drops the gradient of the chunk's initial state, one that cuts the final state's gradient, one that
raises, and a correct one. The wrong ones must be caught with a figure, fall back to the pure-PyTorch path with a
warning, and the walk must then be exact; the correct one must stay. The reference is per-rollout training
(tests/helpers/reference.py), which starts every rollout from zeros: a dropped initial-state gradient does not
change it, so the wrong kernel shows in the tree walk only.
"""

from __future__ import annotations

import functools
import importlib
import random
import warnings

import pytest
import torch

import lightning_dta as dta
from lightning_dta.engine import recurrent_check
from lightning_dta.engine.layer_kinds import model_layer_kinds
from lightning_dta.engine.recurrent_check import RecurrentKernelWarning, check_recurrent_kernels
from tests.engine.test_hybrid import float64_recurrent_cores  # noqa: F401 - the recurrent cores in float64
from tests.helpers.models import make_model, make_rollout
from tests.helpers.reference import assert_grads_close, engine_grads, reference_grads

CPU = torch.device("cpu")
# (family, the modeling function to fake, the argument that carries the chunk's initial state)
SCANS = {"qwen3_5": ("torch_chunk_gated_delta_rule", "initial_state"),
         "mamba2": ("mamba2_chunk_scan", "initial_states"),
         "kimi_linear": ("chunk_kimi_delta_attention", "initial_state")}
# the scans a chunk of one token runs instead (fla's fused_recurrent_* kernels on CUDA)
ONE_TOKEN_SCANS = {"qwen3_5": ("torch_recurrent_gated_delta_rule", "initial_state"),
                   "kimi_linear": ("recurrent_kimi_delta_attention", "initial_state")}


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """No verdict from another test, and every kernel function a fallback replaces restored afterwards."""
    monkeypatch.setattr(recurrent_check, "_CHECKED", {})
    for family in (*SCANS, "lfm2"):
        module = modeling(family)
        for name, function in recurrent_check.kernel_functions(module).items():
            monkeypatch.setattr(module, name, function)


def modeling(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def fake_kernel(monkeypatch, family: str, wrong: str | None, scans: dict = SCANS):
    """Put a "kernel" in place of the family's scan (in ``scans``): the pure-PyTorch function with the initial state
    detached (``"initial"``), the final state detached (``"final"``), raising (``"raises"``) or untouched
    (``None``)."""
    module = modeling(family)
    name, argument = scans[family]
    pure = getattr(module, name).__wrapped__

    @functools.wraps(pure)
    def kernel(*args, **kwargs):
        if wrong == "raises":
            raise RuntimeError("an illegal memory access was encountered")
        if wrong == "initial" and kwargs.get(argument) is not None:
            kwargs[argument] = kwargs[argument].detach()
        out = pure(*args, **kwargs)
        if wrong == "final" and isinstance(out, tuple) and out[-1] is not None:
            out = (*out[:-1], out[-1].detach())
        return out

    monkeypatch.setattr(module, name, kernel)
    return module, name, kernel


def tree() -> list[dta.Rollout]:
    """Leaves under a shared prefix of 9 tokens that is never trained: its recurrent parameters get their whole
    gradient through the state the children send back."""
    rng = random.Random(3)
    prefix = [rng.randrange(48) for _ in range(9)]
    rollouts = []
    for n in (3, 5, 4):
        r = make_rollout(rng, prefix + [rng.randrange(48) for _ in range(n)])
        rollouts.append(dta.Rollout(r.input_ids, [0] * 9 + r.loss_mask[9:], r.advantages, r.old_logprobs,
                                    r.ref_logprobs))
    return rollouts


@pytest.mark.parametrize("family", sorted(SCANS))
@pytest.mark.parametrize("wrong,figure", [("initial", "initial recurrent state gradient"),
                                          ("final", "gradient")], ids=["initial-state", "final-state"])
def test_a_kernel_that_loses_a_state_gradient_is_caught_and_fallen_back_from(monkeypatch, family, wrong, figure):
    model = make_model(family)
    rollouts = tree()
    loss_fn = dta.PolicyLoss(kl_coef=0.1)
    _, ref = reference_grads(model, rollouts, loss_fn)
    module, name, kernel = fake_kernel(monkeypatch, family, wrong)
    _, broken = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, mode="dfs")
    with pytest.raises(AssertionError):  # the control: this kernel trains the shared prefix wrongly
        assert_grads_close(broken, ref, 1e-5, what=f"{family} with a kernel that drops the {wrong} state gradient")

    with pytest.warns(RecurrentKernelWarning, match=rf"differ from its pure-PyTorch path on cpu torch.float64 by "
                                                    rf"\S+ relative \([^;]*{figure}.*now runs its pure-PyTorch"):
        verdicts = check_recurrent_kernels(model, model_layer_kinds(model.config), CPU, torch.float64)
    assert list(verdicts) == [type(m).__name__ for m in model.modules() if getattr(m, "layer_type", None)
                              == "linear_attention"][:1]
    assert getattr(module, name) is kernel.__wrapped__  # fallen back to the pure-PyTorch function

    _, fixed = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, mode="dfs")
    assert_grads_close(fixed, ref, 1e-5, what=f"{family} after the fallback")


@pytest.mark.parametrize("family", sorted(ONE_TOKEN_SCANS))
def test_a_one_token_kernel_that_loses_the_state_gradient_is_caught(monkeypatch, family):
    """A node of one token runs the mixers' decode scan, not the chunked one: the check runs a one-token chunk too,
    so a decode kernel that detaches its initial state is caught like a chunked one."""
    model = make_model(family)
    rollouts = tree()
    loss_fn = dta.PolicyLoss(kl_coef=0.1)
    _, ref = reference_grads(model, rollouts, loss_fn)
    module, name, kernel = fake_kernel(monkeypatch, family, "initial", ONE_TOKEN_SCANS)
    _, broken = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, mode="dfs", chunk_size=1)
    with pytest.raises(AssertionError):  # the control: one-token chunks through this kernel train the prefix wrongly
        assert_grads_close(broken, ref, 1e-5, what=f"{family} with a decode kernel that drops the state gradient")

    with pytest.warns(RecurrentKernelWarning, match=r"by \S+ relative \(one-token initial recurrent state gradient"):
        check_recurrent_kernels(model, model_layer_kinds(model.config), CPU, torch.float64)
    assert getattr(module, name) is kernel.__wrapped__
    _, fixed = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, mode="dfs", chunk_size=1)
    assert_grads_close(fixed, ref, 1e-5, what=f"{family} after the fallback")


def test_a_kernel_that_raises_is_a_verdict(monkeypatch):
    model = make_model("qwen3_5")
    module, name, kernel = fake_kernel(monkeypatch, "qwen3_5", "raises")
    with pytest.warns(RecurrentKernelWarning, match="kernels .*failed on cpu torch.float64 .*illegal memory access"):
        verdicts = check_recurrent_kernels(model, model_layer_kinds(model.config), CPU, torch.float64)
    assert list(verdicts) == ["Qwen3_5GatedDeltaNet"]
    assert getattr(module, name) is kernel.__wrapped__


@pytest.mark.parametrize("family", sorted(SCANS) + ["lfm2"])
def test_a_correct_kernel_passes_and_stays(monkeypatch, family):
    """A kernel that computes what the pure-PyTorch path does is kept, checked once per (mixer, device, dtype)."""
    model = make_model(family)
    if family in SCANS:
        module, name, kernel = fake_kernel(monkeypatch, family, None)
    calls = []
    measure = recurrent_check.measure
    monkeypatch.setattr(recurrent_check, "measure", lambda *args: calls.append(1) or measure(*args))
    kinds = model_layer_kinds(model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecurrentKernelWarning)
        assert check_recurrent_kernels(model, kinds, CPU, torch.float64) == {}
        assert check_recurrent_kernels(model, kinds, CPU, torch.float64) == {}
    assert calls == [1]
    if family in SCANS:
        assert getattr(module, name) is kernel


def test_figures_cover_the_states_and_the_parameters():
    """What is compared, for a chunk of several tokens and for one of a single token: output, final states, and the
    gradients of the input, of every initial state and of every parameter of the mixer (0 here: both paths are the
    same PyTorch)."""
    model = make_model("qwen3_5")
    mixer = model.model.layers[0].linear_attn
    kind = recurrent_check.LAYER_KINDS["linear_attention"]
    figures = recurrent_check.measure(mixer, kind, 32, CPU, torch.float64)
    names = [f.tensor for f in figures]
    each = ["output", "final conv state", "final recurrent state", "input gradient", "initial conv state gradient",
            "initial recurrent state gradient", *(f"{n} gradient" for n, _ in mixer.named_parameters())]
    assert names == each + [f"one-token {n}" for n in each]  # a chunk of several tokens, then one of one token
    assert max(f.error for f in figures) == 0.0


def test_a_check_that_cannot_run_is_no_verdict(monkeypatch):
    """The pure-PyTorch side raising is no verdict on the kernel: a warning, the kernel stays, nothing is cached
    (the check runs again at the next walk)."""
    model = make_model("qwen3_5")
    module = modeling("qwen3_5")
    real = module.torch_chunk_gated_delta_rule

    def broken_reference(*args, **kwargs):
        raise RuntimeError("the reference is broken")

    broken_reference.__module__ = module.__name__  # as transformers' pure-PyTorch functions are

    @functools.wraps(broken_reference)
    def kernel(*args, **kwargs):
        return real.__wrapped__(*args, **kwargs)

    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", kernel)
    kinds = model_layer_kinds(model.config)
    for _ in range(2):
        with pytest.warns(RecurrentKernelWarning, match="could not run .*the reference is broken.*no verdict"):
            assert check_recurrent_kernels(model, kinds, CPU, torch.float64) == {}
    assert module.torch_chunk_gated_delta_rule is kernel and recurrent_check._CHECKED == {}
