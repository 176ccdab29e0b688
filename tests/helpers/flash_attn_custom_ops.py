"""A CPU stand-in for flash-attn 2.8.3's varlen entry points, shaped exactly like the real package.

flash-attn >= 2.7.0 (with torch >= 2.4) defines, in ``flash_attn/flash_attn_interface.py``::

    @_torch_custom_op_wrapper("flash_attn::_flash_attn_varlen_forward", mutates_args=(), device_types="cuda")
    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                   alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                                   seqused_k=None, zero_tensors=False) -> (out, softmax_lse, S_dmask, rng_state)

    @_torch_custom_op_wrapper("flash_attn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                              device_types="cuda")
    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                    window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                    rng_state=None, zero_tensors=False) -> softmax_d

where ``_torch_custom_op_wrapper`` is ``torch.library.custom_op``, plus a ``register_fake`` for each. So the
module attributes ``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` are
``torch._library.custom_ops.CustomOpDef`` objects, not functions:

- ``fn._schema`` is a *str* (the inferred schema without the name, ``"(Tensor q, Tensor k, ...) -> (Tensor,
  Tensor, Tensor, Tensor)"``);
- ``fn._opoverload._schema`` is the ``torch._C.FunctionSchema`` (``.arguments[i].name``, ``.default_value``);
- ``fn._init_fn`` is the undecorated Python function (``inspect.signature`` works on it, not on ``fn``, whose
  ``__call__`` is ``(*args, **kwargs)``);
- calling ``fn(...)`` dispatches ``torch.ops.flash_attn.<name>.default`` (keyword arguments by schema name).

This module registers the same two ops (the same op names, under the namespace ``NAMESPACE`` instead of
``flash_attn``; the same signatures, defaults, return values, mutation declarations and fake kernels; annotations
written ``X | None`` / ``tuple`` where the package writes ``Optional`` / ``Tuple``, which infers the same schema) for
``device_types="cpu"``, computed with plain PyTorch attention, and returns
out ``[total_q, H, D]`` in q's dtype, ``softmax_lse`` ``[H, total_q]`` float32 (always float32, as the real
kernel; ``seqlenq_ngroups_swapped`` included), ``S_dmask`` ``[0]`` and ``rng_state`` int64 ``[2]``; the
backward writes ``dq``/``dk``/``dv`` in place and returns ``softmax_d`` float32 ``[H, total_q + 128 * batch]``
(``rowsum(dout * out)`` of sequence ``b`` at columns ``cu_seqlens_q[b] + 128 * b ...``).

What it checks, as the CUDA extension would (``csrc/flash_attn/flash_api.cpp``, ``mha_varlen_fwd/bwd``):
int32 offsets of ``batch + 1`` entries, ``[tokens, heads, dim]`` with kv heads dividing query heads, contiguous
last dimensions of ``dq``/``dk``/``dv``, ``return_softmax`` only with dropout, and the ``max_seqlen_q == 1``
grouped-query fast path (``seqlenq_ngroups_swapped``), which reshapes q to ``[batch, Hkv, groups, D]`` and so
fails when ``total_q != batch`` (an empty query sequence; flash-attention issue #1619). Set ``STRICT_DTYPES``
to also refuse what the real kernel refuses (anything but float16/bfloat16, head dim not a multiple of 8 or
above 256); by default float32/float64 run so the plumbing can be tested exactly on the CPU.

Use :func:`install` to make ``import flash_attn.flash_attn_interface`` find this module (tests: do it under
``monkeypatch.setitem(sys.modules, ...)``, see :func:`modules`).
"""

import sys
import types

import torch

STRICT_DTYPES = False


# The real ops are flash_attn::_flash_attn_varlen_forward/_backward. A namespace of its own, so that importing the
# real package in the same process (a GPU test run) never collides with these registrations.
NAMESPACE = "lightning_dta_fake_flash_attn"


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)  # TORCH_CHECK raises RuntimeError


def _offsets(cu: torch.Tensor, name: str) -> list[int]:
    _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
    _check(cu.dim() == 1 and cu.is_contiguous(), f"{name} must be a contiguous 1-D tensor")
    return cu.tolist()


def _check_dtype(q: torch.Tensor) -> None:
    if STRICT_DTYPES:
        _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
        _check(q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, "head_size must be a multiple of 8, at most 256")


def _scores(q, k, scale, causal, window_left, window_right, softcap):
    """Scores ``[H, n, m]`` of one sequence (kv heads repeated: query head h uses kv head h // groups)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    n, m = q.shape[0], k.shape[0]
    rows = torch.arange(n)[:, None] + (m - n)  # bottom-right aligned: query i is at key position i + m - n
    cols = torch.arange(m)[None, :]
    if causal:
        window_right = 0
    visible = torch.ones(n, m, dtype=torch.bool)
    if window_left >= 0:
        visible &= cols >= rows - window_left
    if window_right >= 0:
        visible &= cols <= rows + window_right
    return scores.masked_fill(~visible, float("-inf")), k, groups


def _swapped(max_seqlen_q, num_heads, num_heads_k, window_left, window_right, dropout_p, head_dim, alibi) -> bool:
    """``seqlenq_ngroups_swapped`` in ``mha_varlen_fwd`` (2.8.3, flash_api.cpp:592)."""
    return (max_seqlen_q == 1 and num_heads > num_heads_k and window_left < 0 and window_right < 0
            and dropout_p == 0.0 and head_dim % 8 == 0 and alibi is None)


@torch.library.custom_op(f"{NAMESPACE}::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_dtype(q)
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype")
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "varlen layout is [total, heads, head_size]")
    for name, value in (("dropout", dropout_p), ("alibi_slopes", alibi_slopes), ("block_table", block_table),
                        ("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        _check(not value, f"the CPU fake does not implement {name}")
    _check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    q, k, v = [x.contiguous() if x.stride(-1) != 1 else x for x in (q, k, v)]  # maybe_contiguous
    cu_q, cu_k = _offsets(cu_seqlens_q, "cu_seqlens_q"), _offsets(cu_seqlens_k, "cu_seqlens_k")
    batch = len(cu_q) - 1
    _check(batch > 0 and len(cu_k) == batch + 1, "cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries")
    total_q, num_heads, head_dim = q.shape
    num_heads_k = k.shape[1]
    _check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    if _swapped(max_seqlen_q, num_heads, num_heads_k, window_size_left, window_size_right, dropout_p, head_dim,
                alibi_slopes):
        # the real kernel reshapes q to (batch, Hkv, groups, D): shape '[batch, ...]' is invalid unless total_q == batch
        _check(total_q == batch, f"shape '[{batch}, {num_heads_k}, {num_heads // num_heads_k}, {head_dim}]' is "
                                 f"invalid for input of size {q.numel()}")
    if max_seqlen_q == 1 and alibi_slopes is None:
        causal = False  # "causal=true is the same as causal=false in this case"
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros_like(q)
    lse = torch.full((num_heads, total_q), float("inf"), dtype=torch.float32)  # seqlen_k == 0: +inf, out 0
    for b in range(batch):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start or ks.stop == ks.start:
            continue
        scores, _, groups = _scores(q[qs].to(work), k[ks].to(work), softmax_scale, causal, window_size_left,
                                    window_size_right, softcap)
        part_lse = torch.logsumexp(scores, -1)  # [H, n]
        probs = torch.exp(scores - part_lse[..., None]).nan_to_num(0.0)
        part_lse = part_lse.masked_fill(part_lse == float("-inf"), float("inf"))  # a row that sees no key: +inf
        values = v[ks].to(work).repeat_interleave(groups, 1)
        out[qs] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        lse[:, qs] = part_lse.to(torch.float32)
    s_dmask = torch.empty((0,), dtype=q.dtype)
    rng_state = torch.zeros((2,), dtype=torch.int64)
    return out, lse, s_dmask, rng_state


@_flash_attn_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
      window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
      block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    total_q, num_heads, _ = q.shape
    return (torch.empty_like(q), q.new_empty((num_heads, total_q), dtype=torch.float32),
            q.new_empty((0,)), q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op(f"{NAMESPACE}::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    _check_dtype(q)
    for t in (dout, q, k, v, out):
        _check(t.dtype == q.dtype, "query and key/value/out/dout must have the same dtype")
    _check(not dropout_p and alibi_slopes is None and softcap == 0.0,
           "the CPU fake does not implement dropout, alibi or softcap in the backward")
    dout, q, k, v, out = [x.contiguous() if x.stride(-1) != 1 else x for x in (dout, q, k, v, out)]
    cu_q, cu_k = _offsets(cu_seqlens_q, "cu_seqlens_q"), _offsets(cu_seqlens_k, "cu_seqlens_k")
    batch = len(cu_q) - 1
    total_q, num_heads, head_dim = q.shape
    num_heads_k = k.shape[1]
    _check(tuple(softmax_lse.shape) == (num_heads, total_q) and softmax_lse.dtype == torch.float32,
           f"softmax_lse must be float32 [num_heads, total_q] = {(num_heads, total_q)}, not "
           f"{softmax_lse.dtype} {tuple(softmax_lse.shape)}")
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if grad is not None:
            _check(grad.dtype == q.dtype, f"{name} must have the same dtype as q")
            _check(grad.stride(-1) == 1, f"{name} must have contiguous last dimension")
            _check(grad.shape == like.shape, f"{name} must have shape {tuple(like.shape)}")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    grad_q, grad_k, grad_v = (torch.zeros(t.shape, dtype=work) for t in (q, k, v))
    softmax_d = torch.zeros((num_heads, total_q + 128 * batch), dtype=torch.float32)
    for b in range(batch):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        row = (dout[qs].to(work) * out[qs].to(work)).sum(-1).t()  # [H, n]: rowsum(dO * O) of the given output
        softmax_d[:, cu_q[b] + 128 * b: cu_q[b + 1] + 128 * b] = row.to(torch.float32)
        if qs.stop == qs.start or ks.stop == ks.start:
            continue
        scores, keys, groups = _scores(q[qs].to(work), k[ks].to(work), softmax_scale, causal, window_size_left,
                                       window_size_right, 0.0)
        probs = torch.exp(scores - softmax_lse[:, qs].to(work)[..., None])  # from the *given* log-sum-exp
        d_out = dout[qs].to(work)
        values = v[ks].to(work).repeat_interleave(groups, 1)
        d_probs = torch.einsum("qhd,khd->hqk", d_out, values)
        d_scores = probs * (d_probs - row[..., None]) * softmax_scale
        grad_q[qs] = torch.einsum("hqk,khd->qhd", d_scores, keys)
        m = ks.stop - ks.start
        grad_k[ks] += torch.einsum("hqk,qhd->khd", d_scores, q[qs].to(work)).reshape(m, num_heads_k, groups,
                                                                                    head_dim).sum(2)
        grad_v[ks] += torch.einsum("hqk,qhd->khd", probs, d_out).reshape(m, num_heads_k, groups, head_dim).sum(2)
    for target, value in ((dq, grad_q), (dk, grad_k), (dv, grad_v)):
        if target is not None:
            target.copy_(value)
    return softmax_d


@_flash_attn_varlen_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
      rng_state=None, zero_tensors=False):
    batch = cu_seqlens_q.numel() - 1
    total_q, num_heads, _ = q.shape
    return q.new_empty((num_heads, total_q + 128 * batch), dtype=torch.float32)


# what the real module binds too (torch >= 2.4): the op packets
_wrapped_flash_attn_varlen_forward = getattr(torch.ops, NAMESPACE)._flash_attn_varlen_forward
_wrapped_flash_attn_varlen_backward = getattr(torch.ops, NAMESPACE)._flash_attn_varlen_backward


def modules() -> dict[str, types.ModuleType]:
    """``sys.modules`` entries under which ``import flash_attn.flash_attn_interface`` finds this module."""
    package = types.ModuleType("flash_attn")
    package.__path__ = []  # a package
    package.__version__ = "2.8.3"
    interface = sys.modules[__name__]
    package.flash_attn_interface = interface
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


def install() -> None:
    """Put :func:`modules` into ``sys.modules`` (process-wide; prefer ``monkeypatch.setitem`` in tests)."""
    sys.modules.update(modules())
