"""An independent, deliberately plain reference: each rollout forwarded on its own with an ordinary forward
and its loss written out token by token from docs/losses.md. It shares no code with the engines."""

from __future__ import annotations

import math

import torch

import lightning_dta as dta


def aggregate(per_rollout: list[tuple[torch.Tensor, int]], loss_fn, agg: str | None = None) -> torch.Tensor:
    """The step loss from each rollout's (sum of its token terms, its counted-token count), as docs/losses.md
    defines every ``agg``; ``seq-mean-*`` runs over the rollouts with a counted token, or over all of them with
    ``agg_rollouts="all"``."""
    agg = agg or loss_fn.agg
    if agg == "token-mean":
        return sum(s for s, _ in per_rollout) / max(sum(c for _, c in per_rollout), 1)
    if agg == "sum":
        return sum(s for s, _ in per_rollout)
    trained = [(s, c) for s, c in per_rollout if c > 0]
    rollouts = len(per_rollout) if getattr(loss_fn, "agg_rollouts", "trained") == "all" else len(trained)
    if agg == "seq-mean-token-mean":
        return sum(s / c for s, c in trained) / max(rollouts, 1)
    if agg == "seq-mean-token-sum-norm":
        return sum(s / loss_fn.agg_norm_length for s, _ in trained) / max(rollouts, 1)
    return sum(s for s, _ in trained) / max(rollouts, 1)


def _kept(rule, d: dict[int, float], trained: list[int]) -> set[int]:
    """The trained tokens a rejection rule keeps, from each token's d = prox - old (clamped to [-20, 20])."""
    d = {t: min(max(v, -20.0), 20.0) for t, v in d.items()}
    if rule.metric == "ratio":
        stat = dict(d)
    elif rule.metric == "k2":
        stat = {t: 0.5 * v * v for t, v in d.items()}
    else:
        stat = {t: math.exp(v) - 1.0 - v for t, v in d.items()}
    if rule.level != "token" and trained:
        values = [stat[t] for t in trained]
        whole = {"sequence-sum": math.fsum(values), "sequence-mean": math.fsum(values) / len(values),
                 "sequence-max": max(values)}[rule.level]
        stat = dict.fromkeys(trained, whole)

    def inside(value: float) -> bool:
        if rule.metric != "ratio":
            return value <= rule.upper
        return (rule.lower is None or value >= math.log(rule.lower)) and \
            (rule.upper is None or value <= math.log(rule.upper))

    return {t for t in trained if inside(stat[t])}


def _kl(loss_fn, logp: torch.Tensor, ref: float) -> torch.Tensor:
    """The KL estimate of one token, as docs/losses.md defines kl_estimator."""
    d = ref - logp
    if loss_fn.kl_estimator == "k3":
        return torch.exp(d) - d - 1
    c = torch.clamp(d, -20, 20)
    low_var = torch.clamp(torch.exp(c) - c - 1, -10, 10)
    if loss_fn.kl_estimator == "low_var_kl":
        return low_var
    k2 = 0.5 * (logp - ref) ** 2
    return k2 - k2.detach() + low_var.detach()


def reference_loss(model: torch.nn.Module, rollouts: list[dta.Rollout], loss_fn: dta.PolicyLoss,
                   temperature: float = 1.0) -> torch.Tensor:
    """The step loss as a differentiable scalar, computed rollout by rollout and token by token, under
    softmax(logits / temperature)."""
    eps_low = loss_fn.clip_eps
    eps_high = loss_fn.clip_eps if loss_fn.clip_eps_high is None else loss_fn.clip_eps_high
    cap, floor = loss_fn.importance_weight_cap, loss_fn.importance_weight_floor
    main, bonus = [], []  # per rollout: (sum of the token terms, counted tokens)
    device = next(model.parameters()).device
    for r in rollouts:
        ids = torch.tensor([r.input_ids], device=device)
        logits = model(input_ids=ids).logits[0]
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        log_probs = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
        n = len(r.input_ids)
        mask = [0] + [1] * (n - 1) if r.loss_mask is None else list(r.loss_mask)
        trained = [t for t in range(1, n) if mask[t]]
        logps = {t: log_probs[t - 1, r.input_ids[t]] for t in trained}
        olds = {t: logps[t].detach() if r.old_logprobs is None else torch.tensor(r.old_logprobs[t], dtype=dtype)
                for t in trained}
        proxs = {t: olds[t] if r.prox_logprobs is None else torch.tensor(r.prox_logprobs[t], dtype=dtype)
                 for t in trained}
        # before the walk, from the given log-probs only: d = prox - old (0 where either is missing)
        d = {t: 0.0 if r.old_logprobs is None or r.prox_logprobs is None else r.prox_logprobs[t] - r.old_logprobs[t]
             for t in trained}
        kept = set(trained)
        for rule in loss_fn.rejection:
            kept &= _kept(rule, d, trained)
        kept_list = [t for t in trained if t in kept]
        counted = len(trained) if loss_fn.rejection_keeps_normalizer else len(kept_list)
        if trained:  # sequence-level weights: over the trained tokens before rejection
            total_d = math.fsum(d.values())
            seq_weight = {"sequence": math.exp(total_d / len(trained)),
                          "sequence-product": math.exp(total_d)}.get(loss_fn.importance_level)
        if kept_list:  # GSPO's ratio and the sequence-mean advantage: over the kept tokens
            seq_ratio = torch.exp(sum(logps[t].detach() - proxs[t] for t in kept_list) / len(kept_list))
            advs = [r.advantages if isinstance(r.advantages, (int, float)) else r.advantages[t] for t in kept_list]
            mean_adv = math.fsum(advs) / len(advs)
        total = torch.zeros((), dtype=dtype, device=device)
        entropy_total = torch.zeros((), dtype=dtype, device=device)
        for t in kept_list:
            logp, old, prox = logps[t], olds[t], proxs[t]
            adv = r.advantages if isinstance(r.advantages, (int, float)) else r.advantages[t]
            if loss_fn.advantage_level == "sequence-mean":
                adv = mean_adv
            token_ratio = torch.exp(logp - prox)
            ratio = seq_ratio * torch.exp(logp - logp.detach()) if loss_fn.loss_mode == "gspo" else token_ratio
            if loss_fn.importance_level == "none":
                weight = torch.ones((), dtype=dtype)
            else:
                weight = torch.exp(prox - old) if loss_fn.importance_level == "token" else \
                    torch.tensor(seq_weight, dtype=dtype)
            out_of_bounds = (cap is not None and weight > cap) or (floor is not None and weight < floor)
            if loss_fn.importance_weight_mode == "truncate":
                weight = torch.clamp(weight, min=floor, max=cap) if cap is not None or floor is not None else weight
            elif out_of_bounds:
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
                kl = _kl(loss_fn, logp, r.ref_logprobs[t])
                term = term + loss_fn.kl_coef * (kl * token_ratio if loss_fn.kl_ratio_weighted else kl)
            total = total + term
            if loss_fn.entropy_coef:
                p = log_probs[t - 1].exp()
                entropy_total = entropy_total + -(p * log_probs[t - 1]).sum()
        main.append((total, counted))
        bonus.append((entropy_total, counted))
    loss = aggregate(main, loss_fn)
    if loss_fn.entropy_coef:
        loss = loss - loss_fn.entropy_coef * aggregate(bonus, loss_fn, loss_fn.entropy_agg or loss_fn.agg)
    return loss


def reference_grads(model: torch.nn.Module, rollouts: list[dta.Rollout], loss_fn: dta.PolicyLoss,
                    temperature: float = 1.0) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = reference_loss(model, rollouts, loss_fn, temperature)
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


# The relative error allowed per parameter in float64, where the test models have no float32 step
# (tests/helpers/float64.py): the engine and the reference then differ only in the order of float64 sums, measured
# at worst 5e-15 over every family and mode of tests/engine/test_exactness.py; a real error of 1e-12 still fails.
RTOL64 = 1e-12
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


def reference_logprob_gap(model: torch.nn.Module, rollouts: list[dta.Rollout]) -> tuple[float, float, float]:
    """The log-prob gap from its definition: each rollout forwarded on its own (float64 log-softmax of a plain
    forward), ``r = log p_model(x_t | x_<t) - old_logprobs[t]`` on every trained token that carries a behaviour
    log-prob; returns ``(max |r|, mean |r|, mean (exp(r) - 1 - r))``, the means over all those (token, rollout)
    pairs of the step."""
    gaps = []
    with torch.no_grad():
        for rollout in rollouts:
            ids = torch.tensor([rollout.input_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            for t in range(1, len(rollout.input_ids)):
                if rollout.loss_mask[t] and rollout.old_logprobs is not None and \
                        not math.isnan(rollout.old_logprobs[t]):
                    gaps.append(float(logp[t - 1, rollout.input_ids[t]]) - rollout.old_logprobs[t])
    return (max(abs(r) for r in gaps), math.fsum(abs(r) for r in gaps) / len(gaps),
            math.fsum(math.exp(r) - 1.0 - r for r in gaps) / len(gaps))
