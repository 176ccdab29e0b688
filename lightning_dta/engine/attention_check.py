"""The device self-check: no one trains on a prefix-attention kernel that has not been checked on this device.

Flash kernels change between PyTorch and flash-attn releases (argument order, log-sum-exp layout, a fast path
taken for some lengths), and a kernel that is wrong in one of these ways still returns tensors of the right
shape. So once per (backend, device, attention shape, dtype), before the first step, packed chunks over a
prefix (:data:`CASES`, plus :data:`LONG_CASE` on CUDA) go forward and backward through the chosen backend and
the same inputs through the model's own attention path (scaled-dot-product attention over the concatenated keys
with an explicit causal mask, as the KV-cache path computes it, on the same device). A difference beyond the
dtype's tolerance, or a kernel that raises, is a *verdict*: reported with the measured figure, cached for the
process, and prefix attention falls back to the model's attention (exact, only slower and heavier).

The check runs whatever the caller's context: with autograd on and outside inference mode (RL code computes
reference log-probs under ``torch.inference_mode()``, whose tensors cannot be saved for backward), and as a
deliberate host read (allowed under ``torch.cuda.set_sync_debug_mode("error")``). An error that is not the
kernel's own (anything raised outside the backend's calls, or running out of memory) is no verdict: it falls
back for this call only and the check runs again on the next.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_dta.engine.attention_backends import AttentionBackend
from lightning_dta.engine.device import expected_sync, to_device
from lightning_dta.engine.prefix_attention import AttentionShape, PackedLayout, PrefixCausalAttention, Spans

# Largest relative difference (Frobenius norm) from the model's attention, per tensor. Two correct kernels
# differ by rounding (measured on the CPU with these cases: 4.7e-3 in bfloat16, 6.2e-4 in float16, 6.3e-7 in
# float32; the long case against float32: 5.3e-3 and 6.6e-4); a wrong scale, merge or layout by 1e-2 to O(1).
# float32 matmuls in TF32 round like bfloat16.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
TENSORS = ("query gradient", "prefix key gradient", "prefix value gradient", "key gradient",
           "value gradient")


@dataclass(frozen=True)
class Case:
    """Chunks of ``lengths`` packed into one row over a ``prefix``-token prefix. ``buffer`` > 0: the prefix is the
    view ``[:prefix]`` of a ``prefix + buffer``-position buffer, as the path's keys/values are (strided over
    tokens). ``reference``: compare with the model's attention computed in this dtype from the same inputs
    (``None``: in the checked dtype)."""

    what: str
    lengths: tuple[int, ...]
    prefix: int
    buffer: int = 0
    reference: torch.dtype | None = None


CASES = (
    Case("3 chunks of 5, 1, 11 tokens over a 37-token prefix", (5, 1, 11), 37),
    Case("1 chunk of 9 tokens, no prefix", (9,), 0),
    Case("4 one-token chunks over a 23-token prefix (max_seqlen_q = 1)", (1, 1, 1, 1), 23, buffer=9),
    Case("1 token over a 29-token prefix (T = 1)", (1,), 29, buffer=3),
    Case("2 chunks of 7, 4 tokens over a strided 19-token prefix view", (7, 4), 19, buffer=45),
)
LONG_CASE = Case("2,048 tokens over an 8,192-token prefix, against float32", (2048,), 8192, buffer=2048,
                 reference=torch.float32)
"""Multi-tile sequences (every flash tile loop runs many times): CUDA only, where it takes milliseconds."""


@dataclass(frozen=True)
class Figure:
    """One measured difference: a tensor of a case, relative to the model's attention."""

    case: Case
    tensor: str
    error: float


class KernelCheckWarning(RuntimeWarning):
    """Prefix attention's kernels disagreed with the model's attention on this device (or the check could not
    run); the model's attention is used instead."""


class KernelRaised(RuntimeError):
    """The backend's own call raised on a case: a verdict on the kernels."""

    def __init__(self, case: Case, error: Exception) -> None:
        self.case, self.error = case, error
        super().__init__(f"{case.what}: {type(error).__name__}: {error}")


_CHECKED: dict[tuple, str | None] = {}
_WARNED: set[str] = set()


def fall_back(reason: str) -> str:
    """Warn (once per reason) that prefix attention falls back to the model's attention; returns ``reason``."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"{reason}. Prefix attention falls back to the model's own attention (exact, but every "
                      "sibling row gets a copy of the prefix). Fix: prefix_attention_backend= another backend, or "
                      "report the figures above", KernelCheckWarning, stacklevel=3)
    return reason


def cases_for(device: torch.device) -> tuple[Case, ...]:
    """The cases the check runs on ``device``."""
    return (*CASES, LONG_CASE) if device.type == "cuda" else CASES


def tolerance(dtype: torch.dtype) -> float:
    """The largest relative difference accepted in ``dtype`` (bfloat16's for float32 under TF32 matmuls)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return TOLERANCE[torch.bfloat16]
    return TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])


def check_kernels(backend: AttentionBackend, device: torch.device, shape: AttentionShape) -> str | None:
    """Why ``backend`` must not be used for attention calls of ``shape`` on ``device`` (``None``: it agrees
    with the model's attention). A verdict is cached and warns once; an error of the check itself warns, falls
    back for this call only and is not cached (module docstring)."""
    key = (type(backend), backend.name, str(device), shape)
    if key in _CHECKED:
        return _CHECKED[key]
    try:
        reason = verdict(backend, device, shape, measure(backend, device, shape))
    except KernelRaised as error:
        reason = f"prefix attention's {backend.name!r} kernels failed on {device} {shape.dtype} ({error})"
    except Exception as error:  # the check's own inputs or reference, not the kernel: no verdict
        return fall_back(f"prefix attention's self-check of {backend.name!r} could not run on {device} "
                         f"{shape.dtype} ({type(error).__name__}: {error}); this is no verdict on the kernels, "
                         "the check runs again on the next call")
    _CHECKED[key] = fall_back(reason) if reason else None
    return _CHECKED[key]


def verdict(backend: AttentionBackend, device: torch.device, shape: AttentionShape, figures: list[Figure]
            ) -> str | None:
    """The reason to refuse ``backend`` given its measured ``figures`` (``None``: all within tolerance)."""
    limit = tolerance(shape.dtype)
    worst = max(figures, key=lambda f: f.error)
    if worst.error <= limit:
        return None
    return (f"prefix attention's {backend.name!r} kernels differ from the model's attention on {device} "
            f"{shape.dtype} by {worst.error:.2e} relative ({worst.tensor}, {worst.case.what}; tolerance "
            f"{limit:.0e})")


class _Watched(AttentionBackend):
    """The backend under check, noting whether one of its own calls raised (a kernel verdict) rather than the
    code around it."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend, self.name, self.raised = backend, backend.name, False

    def _call(self, method, *args):
        try:
            return method(*args)
        except Exception:
            self.raised = True
            raise

    def forward(self, *args):
        return self._call(self.backend.forward, *args)

    def backward(self, *args):
        return self._call(self.backend.backward, *args)


def measure(backend: AttentionBackend, device: torch.device, shape: AttentionShape,
            cases: tuple[Case, ...] | None = None) -> list[Figure]:
    """Every output and gradient's relative difference from the model's attention, for each of ``cases``
    (default :func:`cases_for` the device). Raises :class:`KernelRaised` when a call of the backend raised,
    anything else as it came."""
    watched = _Watched(backend)
    figures = []
    with expected_sync(device), torch.inference_mode(False), torch.enable_grad(), \
            torch.autocast(device.type, enabled=False):
        for case in cases or cases_for(device):
            try:
                figures += _case(watched, device, shape, case)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:
                if watched.raised:
                    raise KernelRaised(case, error) from error
                raise
    return figures


def model_attention(query, prefix_keys, prefix_values, keys, values, spans: Spans, scale: float) -> torch.Tensor:
    """What the KV-cache path computes: each chunk's queries over [prefix, own keys] with an explicit causal
    mask (``[1, H, T, D]`` inputs, ``[1, T, H, D]`` output)."""
    groups = query.shape[1] // keys.shape[1]
    outs = []
    for a, n in spans:
        k, v = keys[:, :, a:a + n], values[:, :, a:a + n]
        prefix = 0
        if prefix_keys is not None:
            k, v = torch.cat([prefix_keys, k], 2), torch.cat([prefix_values, v], 2)
            prefix = prefix_keys.shape[2]
        mask = torch.ones(n, prefix + n, dtype=torch.bool, device=query.device).tril(prefix)
        outs.append(F.scaled_dot_product_attention(query[:, :, a:a + n], k.repeat_interleave(groups, 1),
                                                   v.repeat_interleave(groups, 1), attn_mask=mask, scale=scale))
    return torch.cat(outs, 2).transpose(1, 2)


def _relative(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    got, want = got.detach().double(), want.detach().double()
    return (got - want).norm() / want.norm().clamp_min(1e-30)


def _case(backend: AttentionBackend, device: torch.device, shape: AttentionShape, case: Case) -> list[Figure]:
    """Relative difference from the model's attention of each output and gradient for one case. Queries and own
    keys/values are laid out as a model's projections give them (``[1, T, H, D]`` seen as ``[1, H, T, D]``)."""
    gen = torch.Generator().manual_seed(len(case.lengths) + case.prefix)
    total, heads, kv_heads, dim = sum(case.lengths), shape.heads, shape.kv_heads, shape.head_dim

    def rand(*size):  # drawn on the host (the same figures on every device), copied without a blocking sync
        return to_device(torch.randn(*size, generator=gen).to(shape.dtype), device)

    query, keys, values = (rand(1, total, h, dim).transpose(1, 2).detach().requires_grad_()
                           for h in (heads, kv_heads, kv_heads))
    prefix = (None, None)
    if case.prefix:
        prefix = tuple(rand(1, kv_heads, case.prefix + case.buffer, dim)[:, :, :case.prefix].detach().requires_grad_()
                       for _ in range(2))
    grad_out = rand(1, total, heads, dim)
    spans = tuple((sum(case.lengths[:i]), n) for i, n in enumerate(case.lengths))
    names, inputs = zip(*[(n, t) for n, t in zip(TENSORS, (query, *prefix, keys, values)) if t is not None])

    def attention_inputs(tensors):  # (query, prefix keys, prefix values, keys, values) from ``inputs``' order
        return (tensors[0], *(tensors[1:3] if case.prefix else (None, None)), *tensors[-2:])

    got = PrefixCausalAttention.apply(*attention_inputs(inputs), PackedLayout.of(spans, case.prefix, device),
                                      shape.scale, backend)
    got_grads = torch.autograd.grad(got, inputs, grad_out)
    exact = inputs if case.reference is None else [t.detach().to(case.reference).requires_grad_() for t in inputs]
    want = model_attention(*attention_inputs(exact), spans, shape.scale)
    want_grads = torch.autograd.grad(want, exact, grad_out.to(want.dtype))
    errors = [float(_relative(g, w)) for g, w in zip((got, *got_grads), (want, *want_grads))]
    return [Figure(case, name, math.inf if math.isnan(e) else e) for name, e in zip(("output", *names), errors)]
