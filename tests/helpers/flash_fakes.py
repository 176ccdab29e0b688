"""Stand-ins for the CUDA flash functions with their exact signatures and conventions, computed on the CPU.

They let the CUDA backends' argument plumbing (names, varlen offsets as int32 tensors, log-sum-exp layout,
flash-attn's in-place gradients) run in float64 here. The math is the reference backend's, itself tested
against masked attention; each fake also asserts the contract a real kernel would enforce.
"""

from __future__ import annotations

import torch

from lightning_dta.engine.attention_backends import ReferenceBackend, Varlen

_REFERENCE = ReferenceBackend()


def _varlen(cu: torch.Tensor, max_len: int) -> Varlen:
    assert cu.dtype == torch.int32 and cu.dim() == 1, "flash kernels take int32 cumulative offsets"
    offsets = tuple(cu.tolist())
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    assert max(lengths) == max_len, f"max length {max_len} does not match the offsets {offsets}"
    return Varlen(offsets, cu, max_len)


def _check_layout(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dim() == 3 and t.stride(-1) == 1, "varlen layout [tokens, heads, dim], contiguous last dim"


def aten_flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                       return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                       seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """``aten::_flash_attention_forward`` (torch 2.13 schema): (out, logsumexp [H, T], rng_state, unused, debug)."""
    _check_layout(query, key, value)
    assert dropout_p == 0.0 and not return_debug_mask
    out, lse = _REFERENCE.forward(query, key, value, _varlen(cum_seq_q, max_q), _varlen(cum_seq_k, max_k),
                                  is_causal, scale)
    empty = torch.empty(0)
    return out, lse.float() if query.dtype != torch.float64 else lse, torch.zeros(2, dtype=torch.int64), empty, empty


def aten_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    """``aten::_flash_attention_backward`` (torch 2.13 schema): (grad_query, grad_key, grad_value)."""
    _check_layout(grad_out, query, key, value, out)
    assert logsumexp.shape == (query.shape[1], query.shape[0]), "varlen log-sum-exp is [heads, tokens]"
    return _REFERENCE.backward(grad_out, query, key, value, out, logsumexp, _varlen(cum_seq_q, max_q),
                               _varlen(cum_seq_k, max_k), is_causal, scale)


def flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                              softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                              alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                              seqused_k=None):
    """flash-attn 2.8's ``_flash_attn_varlen_forward``: (out, softmax_lse [H, T], S_dmask, rng_state)."""
    _check_layout(q, k, v)
    assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0) and not return_softmax
    out, lse = _REFERENCE.forward(q, k, v, _varlen(cu_seqlens_q, max_seqlen_q), _varlen(cu_seqlens_k, max_seqlen_k),
                                  causal, softmax_scale)
    return out, lse, torch.empty(0), torch.zeros(2, dtype=torch.int64)


def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                               softcap, alibi_slopes, deterministic, rng_state=None):
    """flash-attn 2.8's ``_flash_attn_varlen_backward``: writes dq, dk, dv in place, returns softmax_d."""
    _check_layout(dout, q, k, v, out)
    grads = _REFERENCE.backward(dout, q, k, v, out, softmax_lse, _varlen(cu_seqlens_q, max_seqlen_q),
                                _varlen(cu_seqlens_k, max_seqlen_k), causal, softmax_scale)
    for target, value in zip((dq, dk, dv), grads):
        target.copy_(value)
    return torch.empty(q.shape[1], q.shape[0])
