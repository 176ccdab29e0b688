"""An independent, deliberately plain reference: each rollout forwarded on its own with an ordinary forward
and its loss written out token by token from docs/losses.md. It shares no code with the engines."""

from __future__ import annotations

import math

import torch

import lightning_dta as dta


def aggregate(per_rollout: list[tuple[torch.Tensor, int]], loss_fn) -> torch.Tensor:
    """The step loss from each rollout's (sum of its token terms, its trained-token count), as docs/losses.md
    defines every ``agg``."""
    if loss_fn.agg == "token-mean":
        return sum(s for s, _ in per_rollout) / max(sum(c for _, c in per_rollout), 1)
    if loss_fn.agg == "sum":
        return sum(s for s, _ in per_rollout)
    trained = [(s, c) for s, c in per_rollout if c > 0]
    if loss_fn.agg == "seq-mean-token-mean":
        return sum(s / c for s, c in trained) / max(len(trained), 1)
    if loss_fn.agg == "seq-mean-token-sum-norm":
        return sum(s / loss_fn.agg_norm_length for s, _ in trained) / max(len(trained), 1)
    return sum(s for s, _ in trained) / max(len(trained), 1)


def reference_loss(model: torch.nn.Module, rollouts: list[dta.Rollout], loss_fn: dta.PolicyLoss) -> torch.Tensor:
    """The step loss as a differentiable scalar, computed rollout by rollout and token by token."""
    eps_low = loss_fn.clip_eps
    eps_high = loss_fn.clip_eps if loss_fn.clip_eps_high is None else loss_fn.clip_eps_high
    cap = loss_fn.importance_weight_cap
    per_rollout = []  # (sum of m * l, sum of m)
    device = next(model.parameters()).device
    for r in rollouts:
        ids = torch.tensor([r.input_ids], device=device)
        logits = model(input_ids=ids).logits[0]
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        log_probs = torch.log_softmax(logits.to(dtype), dim=-1)
        n = len(r.input_ids)
        mask = [0] + [1] * (n - 1) if r.loss_mask is None else list(r.loss_mask)
        trained = [t for t in range(1, n) if mask[t]]
        logps = {t: log_probs[t - 1, r.input_ids[t]] for t in trained}
        olds = {t: logps[t].detach() if r.old_logprobs is None else torch.tensor(r.old_logprobs[t], dtype=dtype)
                for t in trained}
        proxs = {t: olds[t] if r.prox_logprobs is None else torch.tensor(r.prox_logprobs[t], dtype=dtype)
                 for t in trained}
        if trained:  # the sequence-level quantities: geometric means over the rollout's trained tokens
            seq_weight = torch.exp(sum(proxs[t] - olds[t] for t in trained) / len(trained))
            seq_ratio = torch.exp(sum(logps[t].detach() - proxs[t] for t in trained) / len(trained))
        total = torch.zeros((), dtype=dtype, device=device)
        for t in trained:
            logp, old, prox = logps[t], olds[t], proxs[t]
            adv = r.advantages if isinstance(r.advantages, (int, float)) else r.advantages[t]
            if loss_fn.loss_mode == "gspo":
                ratio = seq_ratio * torch.exp(logp - logp.detach())
            else:
                ratio = torch.exp(logp - prox)
            weight = seq_weight if loss_fn.importance_level == "sequence" else torch.exp(prox - old)
            if cap is not None and loss_fn.importance_weight_mode == "truncate":
                weight = torch.clamp(weight, max=cap)
            elif cap is not None and weight > cap:
                weight = torch.zeros_like(weight)
            clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
            if loss_fn.loss_mode == "cispo":
                pg = -weight * clipped.detach() * adv * logp
            else:
                surrogate = torch.minimum(ratio * adv, clipped * adv)
                if loss_fn.dual_clip is not None and adv < 0:
                    surrogate = torch.maximum(surrogate, torch.tensor(loss_fn.dual_clip * adv, dtype=dtype))
                pg = -weight * surrogate
            term = pg
            if loss_fn.kl_coef and r.ref_logprobs is not None:
                d = r.ref_logprobs[t] - logp
                term = term + loss_fn.kl_coef * (torch.exp(d) - d - 1)
            if loss_fn.entropy_coef:
                p = log_probs[t - 1].exp()
                term = term - loss_fn.entropy_coef * -(p * log_probs[t - 1]).sum()
            total = total + term
        per_rollout.append((total, len(trained)))
    return aggregate(per_rollout, loss_fn)


def reference_grads(model: torch.nn.Module, rollouts: list[dta.Rollout], loss_fn: dta.PolicyLoss
                    ) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = reference_loss(model, rollouts, loss_fn)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def engine_grads(model: torch.nn.Module, tree: dta.PrefixTree, loss_fn: dta.PolicyLoss, **kwargs
                 ) -> tuple[dta.TreeBackwardOutput, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = dta.tree_backward(model, tree, loss_fn, **kwargs)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


ZERO_FLOOR = 1e-9  # a parameter's gradient below this fraction of the whole gradient's norm is zero up to rounding


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float,
                       what: str = "") -> float:
    """Per-parameter relative error ||a - e|| / ||e|| <= rtol; returns the worst one.

    A parameter whose exact gradient is zero (for example the queries of a layer when only tokens that attend
    to themselves alone are trained) comes out of either computation as rounding noise, ~1e-18 against a total
    of ~1: its relative error is noise over noise. So ||e|| is floored at ``ZERO_FLOOR`` times the norm of the
    whole expected gradient; a real error of any parameter larger than 1e-9 of the total still fails.
    """
    assert set(actual) == set(expected), f"{what}: parameters with gradients differ"
    total = float(torch.sqrt(sum(e.double().norm() ** 2 for e in expected.values())))
    worst = 0.0
    for name, e in expected.items():
        a = actual[name]
        scale = max(float(e.norm()), ZERO_FLOOR * total)
        err = float((a - e).norm())
        if scale == 0.0:
            assert err == 0.0, f"{what}: {name} should have a zero gradient, got norm {err}"
            continue
        rel = err / scale
        worst = max(worst, rel)
        assert rel <= rtol, f"{what}: {name} relative gradient error {rel:.3e} > {rtol:.0e}"
    assert math.isfinite(worst)
    return worst


def reference_value_loss(critic: torch.nn.Module, rollouts: list[dta.Rollout], loss_fn: dta.ValueLoss
                         ) -> torch.Tensor:
    """The critic's step loss, rollout by rollout and token by token: the value of token t's state is the head's
    output at position t - 1."""
    per_rollout = []
    device = next(critic.parameters()).device
    for r in rollouts:
        values = critic(input_ids=torch.tensor([r.input_ids], device=device)).logits[0, :, 0]
        mask = [0] + [1] * (len(r.input_ids) - 1) if r.loss_mask is None else list(r.loss_mask)
        total, count = torch.zeros((), dtype=values.dtype, device=device), 0
        for t in range(1, len(r.input_ids)):
            if not mask[t]:
                continue
            v, ret = values[t - 1], r.returns[t]
            term = 0.5 * (v - ret) ** 2
            if loss_fn.clip_eps is not None and r.old_values is not None:
                old = r.old_values[t]
                clipped = torch.clamp(v, old - loss_fn.clip_eps, old + loss_fn.clip_eps)
                term = torch.maximum(term, 0.5 * (clipped - ret) ** 2)
            total, count = total + term, count + 1
        per_rollout.append((total, count))
    return aggregate(per_rollout, loss_fn)
