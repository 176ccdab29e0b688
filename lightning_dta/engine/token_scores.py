"""Log-probs and entropies of many targets per position, without full-vocabulary float32 copies.

A plain ``log_softmax(logits.float())`` keeps a ``[positions, vocab]`` float32 tensor alive for backward (and
another for the entropy): with a 150K vocabulary that is 600 KB per position, more than the rest of a
layer's activations. This autograd function saves only the logits the model produced (bf16 stays bf16) and
the per-position log-normaliser, and works through the vocabulary dimension a block of positions at a time
in both directions, so the float32 working set is one block.

Every position may be scored against several targets (one per rollout through it): ``targets`` is
``[R, C]``, column ``c`` holding the targets that position ``c`` predicts for each row. A ``temperature`` T scores
softmax(logits / T) without a scaled copy of the logits: each block is divided as it is converted, and the
gradient is divided by T on the way back.
"""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 24  # float32 elements per block (64 MiB)


def _blocks(positions: int, vocab: int):
    step = max(1, BLOCK_ELEMENTS // max(vocab, 1))
    for start in range(0, positions, step):
        yield start, min(start + step, positions)


class TokenScores(torch.autograd.Function):
    """``(logp [R, C], entropy [C]) = f(logits [C, V] / temperature, targets [R, C])`` computed in ``dtype``
    (the entropy is left at zero, with no gradient, when ``with_entropy`` is false)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, with_entropy: bool = True,
                temperature: float = 1.0):
        positions, vocab = logits.shape
        lse = torch.empty(positions, dtype=dtype, device=logits.device)
        entropy = torch.zeros(positions, dtype=dtype, device=logits.device)
        for a, b in _blocks(positions, vocab):
            block = _scaled(logits[a:b], dtype, temperature)
            lse[a:b] = torch.logsumexp(block, dim=-1)
            if with_entropy:
                log_p = block - lse[a:b, None]
                entropy[a:b] = -(log_p.exp() * _finite(log_p)).sum(-1)
        picked = _scaled(logits.gather(1, targets.t()).t(), dtype, temperature)  # [R, C]
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.dtype, ctx.temperature = dtype, temperature
        ctx.set_materialize_grads(False)  # an unused output (entropy without a bonus) costs nothing
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return picked - lse[None, :], entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, targets, lse, entropy = ctx.saved_tensors
        dtype, temperature = ctx.dtype, ctx.temperature
        positions, vocab = logits.shape
        grad_logits = torch.empty_like(logits)
        for a, b in _blocks(positions, vocab):
            log_p = _scaled(logits[a:b], dtype, temperature) - lse[a:b, None]
            p = log_p.exp()
            grad = torch.zeros_like(log_p)
            if grad_logp is not None:
                # d logp[r, c] / d logits[c, v] = [v == target[r, c]] - p[c, v]
                g = grad_logp[:, a:b].to(dtype)
                grad -= p * g.sum(0)[:, None]
                grad.scatter_add_(1, targets[:, a:b].t(), g.t())
            if grad_entropy is not None:
                # H = -sum p log p  =>  dH / d logits[v] = -p[v] * (log p[v] + H)
                grad -= grad_entropy[a:b, None].to(dtype) * p * (_finite(log_p) + entropy[a:b, None])
            if temperature != 1.0:  # d (logits / T) / d logits = 1 / T
                grad = grad / temperature
            grad_logits[a:b] = grad.to(logits.dtype)
        return grad_logits, None, None, None, None


def _finite(log_p: torch.Tensor) -> torch.Tensor:
    """``log_p`` with ``-inf`` (a logit of ``-inf``: a masked token, probability exactly 0) read as 0, so that the
    entropy's ``p log p`` and its gradient ``p (log p + H)`` are 0 there, their limit as p -> 0, not 0 * -inf = NaN."""
    return log_p.masked_fill(log_p == float("-inf"), 0.0)


def _scaled(logits: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in ``dtype`` (the division after the conversion, in the working precision)."""
    converted = logits.to(dtype)
    return converted if temperature == 1.0 else converted / temperature


def token_scores(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, with_entropy: bool = True,
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[R, C]`` of ``targets`` under ``softmax(logits [C, V] / temperature)`` and each position's
    entropy ``[C]``."""
    return TokenScores.apply(logits, targets, dtype, with_entropy, temperature)
