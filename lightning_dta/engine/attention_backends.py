"""The attention kernels behind prefix attention: one varlen interface, several backends.

Prefix attention (:mod:`~lightning_dta.engine.prefix_attention`) needs two things from a kernel, in the
varlen layout of flash-attention (queries ``[T, H, D]``, keys/values ``[S, Hkv, D]`` with grouped-query heads
native, sequences given by cumulative offsets):

- ``forward(q, k, v, q_lens, k_lens, causal, scale) -> (out [T, H, D], lse [H, T])``: attention of each
  query sequence over its key sequence and the log-sum-exp of its scores (float32; float64 for float64
  inputs). The glue makes causal calls only where each query sequence has as many tokens as its key sequence, so
  the alignment of the causal mask never matters (and differs: flash-attention's CUDA kernels and the reference
  align it bottom-right, PyTorch's CPU flash kernel top-left);
- ``backward(grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale) -> (dq, dk, dv)`` from a *given*
  output and log-sum-exp: the flash-attention backward. Called with the merged output and log-sum-exp of
  several key blocks, it returns exactly that block's share of the gradient, which is how the blocks of a
  query are merged without any kernel knowing about the others.

Backends (``EngineOptions.prefix_attention_backend``):

- ``"cpu-flash"``: PyTorch's CPU flash attention, one call per sequence;
- ``"cuda-flash"``: PyTorch's CUDA varlen flash kernels (``aten::_flash_attention_forward`` / ``_backward``),
  one call for all sequences; their arguments are read from the op's schema at import and a schema this
  module does not know is refused with the reason;
- ``"flash-attn"``: the ``flash_attn`` package's varlen forward/backward (the ``gpu`` extra);
- ``"reference"``: the definition in plain PyTorch (scores materialised, any device and dtype). It makes the
  glue above every backend testable on the CPU in float64, and each flash backend's argument plumbing is
  tested against it with the flash function replaced by a reference of the same signature.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_dta.engine.device import to_device

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Varlen:
    """Sequences packed one after another: cumulative ``offsets`` (host) and the same as int32 on the device
    (``cu``, what flash kernels read), plus the longest length."""

    offsets: tuple[int, ...]
    cu: torch.Tensor
    max_len: int

    @classmethod
    def of(cls, lengths: tuple[int, ...], device: torch.device) -> Varlen:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        cu = to_device(torch.tensor(offsets, dtype=torch.int32), device)
        return cls(tuple(offsets), cu, max(lengths))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def slices(self) -> list[slice]:
        return [slice(a, b) for a, b in zip(self.offsets, self.offsets[1:])]


class AttentionBackend:
    """A varlen attention kernel with log-sum-exp (see the module docstring for the contract)."""

    name: str = ""

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on ``device`` in ``dtype`` (``None``: it can)."""
        raise NotImplementedError

    def unsupported_shape(self, head_dim: int) -> str | None:
        """Why this backend cannot take heads of ``head_dim`` (``None``: it can)."""
        return None

    def forward(self, q, k, v, q_lens: Varlen, k_lens: Varlen, causal: bool, scale: float):
        raise NotImplementedError

    def backward(self, grad_out, q, k, v, out, lse, q_lens: Varlen, k_lens: Varlen, causal: bool, scale: float):
        raise NotImplementedError


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ReferenceBackend(AttentionBackend):
    """The definition: scores ``[H, n, m]`` per sequence, softmax, and its flash-style backward."""

    name = "reference"

    def unsupported(self, device, dtype):
        return None if dtype.is_floating_point else f"{dtype} is not a floating-point type"

    @staticmethod
    def _probs(q, k, lse, causal, scale):
        """Scores of one sequence ``[H, n, m]`` and, with its log-sum-exp, the probabilities."""
        work = _lse_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        k = k.to(work).repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q.to(work), k) * scale
        if causal:
            n, m = q.shape[0], k.shape[0]
            visible = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)  # bottom-right aligned
            scores = scores.masked_fill(~visible, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, -1)
        return torch.exp(scores - lse[..., None]), lse, k

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=_lse_dtype(q.dtype), device=q.device)
        groups = q.shape[1] // k.shape[1]
        for qs, ks in zip(q_lens.slices(), k_lens.slices()):
            probs, lse[:, qs], _ = self._probs(q[qs], k[ks], None, causal, scale)
            values = v[ks].to(probs.dtype).repeat_interleave(groups, 1)
            out[qs] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        kv_heads, groups = k.shape[1], q.shape[1] // k.shape[1]
        for qs, ks in zip(q_lens.slices(), k_lens.slices()):
            probs, _, keys = self._probs(q[qs], k[ks], lse[:, qs], causal, scale)
            work = probs.dtype
            d_out, o = grad_out[qs].to(work), out[qs].to(work)
            values = v[ks].to(work).repeat_interleave(groups, 1)
            d_probs = torch.einsum("qhd,khd->hqk", d_out, values)
            row = (d_out * o).sum(-1).t()  # [H, n]: rowsum(dO * O) of the (merged) output
            d_scores = probs * (d_probs - row[..., None]) * scale
            dq[qs] = torch.einsum("hqk,khd->qhd", d_scores, keys).to(q.dtype)
            m = ks.stop - ks.start
            dk[ks] += torch.einsum("hqk,qhd->khd", d_scores, q[qs].to(work)).reshape(
                m, kv_heads, groups, -1).sum(2).to(k.dtype)
            dv[ks] += torch.einsum("hqk,qhd->khd", probs, d_out).reshape(m, kv_heads, groups, -1).sum(2).to(v.dtype)
        return dq, dk, dv


class CPUFlashBackend(AttentionBackend):
    """PyTorch's CPU flash attention (``[B, H, L, D]`` layout, GQA native), one call per sequence."""

    name = "cpu-flash"
    forward_op = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    backward_op = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    def unsupported(self, device, dtype):
        if device.type != "cpu":
            return f"it runs on the CPU and the model is on {device.type}"
        if dtype not in (torch.float32, torch.float64, *HALF):
            return f"PyTorch's CPU flash attention has no {dtype} kernel"
        return None

    @staticmethod
    def _heads_first(t):
        return t.transpose(0, 1)[None]  # [L, H, D] -> [1, H, L, D], a view

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        if len(q_lens) == 1:
            out, lse = self.forward_op(self._heads_first(q), self._heads_first(k), self._heads_first(v), 0.0,
                                       causal, scale=scale)
            return out[0].transpose(0, 1), lse[0]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=_lse_dtype(q.dtype), device=q.device)
        for qs, ks in zip(q_lens.slices(), k_lens.slices()):
            part, part_lse = self.forward_op(self._heads_first(q[qs]), self._heads_first(k[ks]),
                                             self._heads_first(v[ks]), 0.0, causal, scale=scale)
            out[qs], lse[:, qs] = part[0].transpose(0, 1), part_lse[0]
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        first = self._heads_first
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for qs, ks in zip(q_lens.slices(), k_lens.slices()):
            grads = self.backward_op(first(grad_out[qs]), first(q[qs]), first(k[ks]), first(v[ks]),
                                     first(out[qs]), lse[None, :, qs], 0.0, causal, scale=scale)
            for total, part, s in zip((dq, dk, dv), grads, (qs, ks, ks)):
                total[s] = part[0].transpose(0, 1)
        return dq, dk, dv


def argument_names(fn: Callable) -> list[str]:
    """The argument names of a PyTorch op (from its schema) or of a Python function (from its signature).

    An op overload has a ``torch._C.FunctionSchema`` as ``_schema``, an op packet on ``.default``. A
    ``torch.library.custom_op`` (flash-attn >= 2.7 wraps its varlen functions in one under torch >= 2.4) holds its
    schema as a *string* in ``_schema`` and the parsed one on its ``_opoverload``; its ``__call__`` takes
    ``(*args, **kwargs)``, so without a parsed schema the undecorated function (``_init_fn``) is read."""
    # optional library features: an op packet has .default, a custom op ._opoverload, a plain function neither
    for op in (fn, getattr(fn, "default", None), getattr(fn, "_opoverload", None)):
        # optional library feature: a torch op has a schema, a plain Python function has none
        schema = getattr(op, "_schema", None)
        if isinstance(schema, torch._C.FunctionSchema):
            return [a.name for a in schema.arguments]
    # optional library feature: torch.library custom ops wrap the function they were made from
    return list(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _unknown_arguments(what: str, fn: Callable, expected: list[str]) -> str | None:
    names = argument_names(fn)
    missing = [n for n in expected if n not in names]
    return f"{what} takes {names}, without {missing}, which lightning_dta does not know" if missing else None


def _cuda_unsupported(device: torch.device, dtype: torch.dtype, what: str) -> str | None:
    if device.type != "cuda":
        return f"{what} runs on CUDA and the model is on {device.type}"
    if dtype not in HALF:
        return f"{what} has no {dtype} kernel (float16 and bfloat16 only)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"{what} needs compute capability 8.0 or newer (Ampere); this GPU has " \
               f"{torch.cuda.get_device_capability(device)}"
    return None


def _flash_head_dim(head_dim: int) -> str | None:
    if head_dim % 8 or head_dim > 256:
        return f"flash kernels take head dimensions that are multiples of 8 up to 256, not {head_dim}"
    return None


class CudaFlashBackend(AttentionBackend):
    """PyTorch's CUDA varlen flash kernels: every sequence in one call. ``forward_op``/``backward_op`` are the
    aten ops (tests substitute references with the same schema on the CPU)."""

    name = "cuda-flash"
    FORWARD_ARGS = ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                    "return_debug_mask", "scale"]
    BACKWARD_ARGS = ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
                     "max_k", "dropout_p", "is_causal", "scale"]
    RNG_ARGS = (("rng_state", "unused"), ("philox_seed", "philox_offset"))  # torch >= 2.5, earlier releases

    def __init__(self, forward_op: Callable | None = None, backward_op: Callable | None = None) -> None:
        self.forward_op = forward_op or torch.ops.aten._flash_attention_forward
        self.backward_op = backward_op or torch.ops.aten._flash_attention_backward
        names = argument_names(self.backward_op)
        self.rng_args = next((pair for pair in self.RNG_ARGS if all(n in names for n in pair)), None)
        self.schema_problem = (_unknown_arguments("aten::_flash_attention_forward", self.forward_op, self.FORWARD_ARGS)
                               or _unknown_arguments("aten::_flash_attention_backward", self.backward_op,
                                                     self.BACKWARD_ARGS))
        if self.schema_problem is None and self.rng_args is None:
            self.schema_problem = f"aten::_flash_attention_backward takes {names}, with no random-state arguments " \
                                  "that lightning_dta knows"

    def unsupported(self, device, dtype):
        if self.schema_problem:
            return f"{self.schema_problem} (torch {torch.__version__})"
        reason = _cuda_unsupported(device, dtype, "PyTorch's varlen flash attention")
        if reason is None and not torch.backends.cuda.is_flash_attention_available():
            reason = "this PyTorch build has no flash attention"
        return reason

    def unsupported_shape(self, head_dim):
        return _flash_head_dim(head_dim)

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        out, lse, *_ = self.forward_op(query=q, key=k, value=v, cum_seq_q=q_lens.cu, cum_seq_k=k_lens.cu,
                                       max_q=q_lens.max_len, max_k=k_lens.max_len, dropout_p=0.0, is_causal=causal,
                                       return_debug_mask=False, scale=scale)
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"aten::_flash_attention_forward returned a log-sum-exp of shape {tuple(lse.shape)}; "
                               f"lightning_dta reads the varlen layout [heads, tokens] = {(q.shape[1], q.shape[0])} "
                               f"(torch {torch.__version__}). Fix: prefix_attention_backend='flash-attn' or "
                               "prefix_attention=False")
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        # no dropout: the random state is never read, but the op takes it
        unused = torch.zeros(2, dtype=torch.int64, device=q.device)
        rng = dict(zip(self.rng_args, (unused, unused)))
        dq, dk, dv = self.backward_op(grad_out=grad_out, query=q, key=k, value=v, out=out, logsumexp=lse,
                                      cum_seq_q=q_lens.cu, cum_seq_k=k_lens.cu, max_q=q_lens.max_len,
                                      max_k=k_lens.max_len, dropout_p=0.0, is_causal=causal, scale=scale, **rng)
        return dq, dk, dv


class FlashAttnBackend(AttentionBackend):
    """The ``flash_attn`` package's varlen functions (``flash_attn.flash_attn_interface``); tests substitute
    references with the same signatures on the CPU."""

    name = "flash-attn"
    FORWARD_ARGS = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                    "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes",
                    "return_softmax"]
    BACKWARD_ARGS = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
                     "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left",
                     "window_size_right", "softcap", "alibi_slopes", "deterministic"]

    def __init__(self, forward_fn: Callable | None = None, backward_fn: Callable | None = None) -> None:
        self.forward_fn, self.backward_fn, self.problem = forward_fn, backward_fn, None
        if forward_fn is None or backward_fn is None:
            try:
                interface = importlib.import_module("flash_attn.flash_attn_interface")
                self.forward_fn = interface._flash_attn_varlen_forward
                self.backward_fn = interface._flash_attn_varlen_backward
            except (ImportError, AttributeError) as error:
                self.problem = f"the flash_attn package is not usable ({error}); pip install 'lightning-dta[gpu]'"
                return
        self.problem = (_unknown_arguments("flash_attn's _flash_attn_varlen_forward", self.forward_fn,
                                           self.FORWARD_ARGS)
                        or _unknown_arguments("flash_attn's _flash_attn_varlen_backward", self.backward_fn,
                                              self.BACKWARD_ARGS))

    def unsupported(self, device, dtype):
        return self.problem or _cuda_unsupported(device, dtype, "flash-attn")

    def unsupported_shape(self, head_dim):
        return _flash_head_dim(head_dim)

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        out, lse, *_ = self.forward_fn(q=q, k=k, v=v, cu_seqlens_q=q_lens.cu, cu_seqlens_k=k_lens.cu,
                                       max_seqlen_q=q_lens.max_len, max_seqlen_k=k_lens.max_len, dropout_p=0.0,
                                       softmax_scale=scale, causal=causal, window_size_left=-1,
                                       window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.backward_fn(dout=grad_out, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                         cu_seqlens_q=q_lens.cu, cu_seqlens_k=k_lens.cu, max_seqlen_q=q_lens.max_len,
                         max_seqlen_k=k_lens.max_len, dropout_p=0.0, softmax_scale=scale, causal=causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False)
        return dq, dk, dv


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "cpu-flash": CPUFlashBackend,
    "cuda-flash": CudaFlashBackend,
    "flash-attn": FlashAttnBackend,
    "reference": ReferenceBackend,
}
DEFAULTS = {"cpu": ("cpu-flash",), "cuda": ("cuda-flash", "flash-attn")}  # tried in order when none is named


def choose_backend(name: str | None, device: torch.device, dtype: torch.dtype) -> tuple[AttentionBackend | None, str]:
    """The backend ``name`` (``None``: the first default for the device that can run) and, when there is none,
    why."""
    names = (name,) if name is not None else DEFAULTS.get(device.type, ())
    reasons = []
    for candidate in names:
        backend = BACKENDS[candidate]()
        reason = backend.unsupported(device, dtype)
        if reason is None:
            return backend, ""
        reasons.append(f"prefix_attention_backend={candidate!r}: {reason}")
    if not reasons:
        return None, f"no prefix-attention kernel runs on {device.type}"
    return None, "; ".join(reasons)
