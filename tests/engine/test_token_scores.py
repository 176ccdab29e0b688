"""The blocked log-prob/entropy function against autograd's own log_softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_dta.engine import token_scores as ts


def reference(logits, targets):
    log_probs = torch.log_softmax(logits.double(), -1)
    logp = log_probs[torch.arange(logits.shape[0])[None, :], targets]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("block", [1 << 24, 7 * 11])  # one block, and blocks of 7 positions (vocab 11)
def test_matches_log_softmax_values_and_gradients(monkeypatch, block):
    monkeypatch.setattr(ts, "BLOCK_ELEMENTS", block)
    torch.manual_seed(0)
    logits = (3 * torch.randn(20, 11, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (4, 20))
    w_logp, w_ent = torch.randn(4, 20, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    logp, entropy = ts.token_scores(logits, targets, torch.float64)
    ((logp * w_logp).sum() + (entropy * w_ent).sum()).backward()
    got = logits.grad.clone()
    logits.grad = None
    ref_logp, ref_ent = reference(logits, targets)
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_ent, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, logits.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_masked_tokens_have_no_entropy_and_no_gradient(temperature):
    """A logit of -inf (a masked vocabulary entry) has probability 0: the entropy and every gradient equal those of
    the distribution over the other entries (the reference drops the masked columns), with no NaN."""
    torch.manual_seed(2)
    logits = torch.randn(6, 9, dtype=torch.float64)
    masked = torch.zeros(9, dtype=torch.bool)
    masked[[1, 4, 8]] = True
    logits[:, masked] = float("-inf")
    logits.requires_grad_()
    kept = torch.arange(9)[~masked]
    targets = kept[torch.randint(0, len(kept), (3, 6))]
    w_logp, w_ent = torch.randn(3, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    logp, entropy = ts.token_scores(logits, targets, torch.float64, temperature=temperature)
    ((logp * w_logp).sum() + (entropy * w_ent).sum()).backward()
    finite = logits.detach()[:, kept].requires_grad_()
    ref_logp, ref_ent = reference(finite / temperature, torch.searchsorted(kept, targets))
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_ent, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits.grad[:, kept], finite.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(logits.grad[:, masked], torch.zeros(6, 3, dtype=torch.float64))


def test_gradcheck():
    torch.manual_seed(1)
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (3, 6))
    assert torch.autograd.gradcheck(lambda x: ts.token_scores(x, targets, torch.float64), (logits,))


def test_half_logits_keep_their_dtype_and_score_in_float32():
    logits = torch.randn(5, 7, dtype=torch.bfloat16, requires_grad=True)
    logp, entropy = ts.token_scores(logits, torch.randint(0, 7, (2, 5)), torch.float32)
    assert logp.dtype == entropy.dtype == torch.float32
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
