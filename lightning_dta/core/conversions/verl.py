"""verl 0.9.1's actor, algorithm and rollout configs as our loss (``verl/trainer/ppo/core_algos.py``,
``rollout_corr_helper.py``, ``workers/utils/losses.py``; docs/losses.md).

One of our steps is one verl mini-batch (``ppo_mini_batch_size x rollout.n`` rows, one optimizer step): verl's
token-mean divides by the mini-batch's tokens over every data-parallel rank and its seq-mean modes by every row of
it, an empty one included. Per-token inputs: without rollout correction ``old_log_prob`` -> ``old_logprobs``; with
it, ``rollout_log_probs`` (the inference engine's) -> ``old_logprobs`` and ``old_log_prob`` (the trainer's
recompute) -> ``prox_logprobs``; ``ref_log_prob`` -> ``ref_logprobs``; ``response_mask`` -> ``loss_mask``.

verl's trainer estimates the advantages once over the whole batch (``data.train_batch_size x rollout.n`` rows: GRPO's
groups, GAE's whitening over all its trained tokens), then the actor cuts it into ``train_batch_size /
ppo_mini_batch_size`` consecutive mini-batches and runs ``ppo_epochs`` passes over them in the same order: our
``generation`` with ``split: groups`` (the rows of a prompt are consecutive, so a mini-batch holds whole groups),
exactly so where ``trainer.balance_batch`` (on by default) has not first reordered the rows by length.
"""

from __future__ import annotations

from typing import Any

from lightning_dta.core.conversions import Converted, Settings, generation
from lightning_dta.core.losses import PolicyLoss, Rejection

SOURCE = "verl"

ACTOR_DEFAULTS: dict[str, Any] = {
    "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
    "loss_agg_mode": "token-mean", "loss_scale_factor": None, "entropy_coeff": 0.0, "use_kl_loss": False,
    "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "rollout_n": 1, "policy_loss": None,
    "ppo_mini_batch_size": 256, "ppo_epochs": 1, "shuffle": False,
}
DATA_DEFAULTS: dict[str, Any] = {"train_batch_size": 1024}
TRAINER_DEFAULTS: dict[str, Any] = {"balance_batch": True}
POLICY_LOSS_DEFAULTS: dict[str, Any] = {"loss_mode": "vanilla"}
ALGORITHM_DEFAULTS: dict[str, Any] = {
    "adv_estimator": "gae", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False,
    "use_pf_ppo": False, "rollout_correction": None,
}
# the trainer's yaml (_generated_ppo_trainer.yaml); the dataclass's own rollout_is default is "sequence"
CORRECTION_DEFAULTS: dict[str, Any] = {
    "rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False, "rollout_rs": None,
    "rollout_rs_threshold": None, "bypass_mode": False,
}
ROLLOUT_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "n": None}

AGGREGATION = {
    "token-mean": {"agg": "token-mean"},
    "token-sum": {"agg": "sum"},
    "seq-mean-token-mean": {"agg": "seq-mean-token-mean", "agg_rollouts": "all"},
    "seq-mean-token-sum": {"agg": "seq-mean-token-sum", "agg_rollouts": "all"},
    "seq-mean-token-sum-norm": {"agg": "seq-mean-token-sum-norm", "agg_rollouts": "all"},
}
LOSS_MODES = {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo"}
KL_TYPES = {"low_var_kl": "low_var_kl", "k3": "low_var_kl", "k3+": "k3+", "low_var_kl+": "k3+"}
RS_LEVELS = {"token": "token", "seq_sum": "sequence-sum", "seq_mean": "sequence-mean", "seq_max": "sequence-max"}
GUARD_NOTE = ("verl clamps log-ratios at +-20 before exp (vanilla, cispo, rollout correction) and GSPO's "
              "sequence log-ratio at 10; here they are not clamped, which differs only beyond exp(20) (exp(10))")


def from_verl(actor: Any, algorithm: Any = None, rollout: Any = None, data: Any = None, trainer: Any = None
              ) -> Converted:
    """Convert verl's ``actor_rollout_ref.actor`` (an ``ActorConfig`` or mapping), ``algorithm``,
    ``actor_rollout_ref.rollout``, ``data`` (``train_batch_size``) and ``trainer`` (``balance_batch``) configs, the
    trainer's values (batch sizes in prompts); refuse what has no exact equivalent."""
    a = Settings(SOURCE, actor, ACTOR_DEFAULTS, "actor.")
    g = Settings(SOURCE, algorithm, ALGORITHM_DEFAULTS, "algorithm.")
    r = Settings(SOURCE, rollout, ROLLOUT_DEFAULTS, "rollout.")
    notes = [GUARD_NOTE]
    policy = a.section("policy_loss", POLICY_LOSS_DEFAULTS)
    mode = policy.get("loss_mode")
    if mode not in LOSS_MODES:
        raise policy.refuse("loss_mode", "this loss mode is not implemented here", "loss_mode: vanilla (or gspo, "
                            "cispo)")
    fields: dict[str, Any] = {"loss_mode": LOSS_MODES[mode]}
    low, high = a.get("clip_ratio_low"), a.get("clip_ratio_high")
    fields["clip_eps"] = float(a.get("clip_ratio") if low is None else low)
    fields["clip_eps_high"] = float(a.get("clip_ratio") if high is None else high)
    if mode == "vanilla":
        fields["dual_clip"] = float(a.get("clip_ratio_c"))  # verl's vanilla always bounds A < 0 by clip_ratio_c
    agg_mode = a.get("loss_agg_mode")
    if agg_mode not in AGGREGATION:
        raise a.refuse("loss_agg_mode", "not a verl aggregation", f"one of {sorted(AGGREGATION)}")
    fields.update(AGGREGATION[agg_mode])
    if agg_mode == "seq-mean-token-sum-norm":
        if a.get("loss_scale_factor") is None:
            raise a.refuse("loss_scale_factor", "without it verl divides by the padded response width of each "
                           "micro-batch, which depends on how the batch was padded", "a constant "
                           "loss_scale_factor (e.g. the maximum response length)")
        fields["agg_norm_length"] = int(a.get("loss_scale_factor"))
    if float(a.get("entropy_coeff")) != 0.0:
        fields["entropy_coef"] = float(a.get("entropy_coeff"))
    if a.get("use_kl_loss") and float(a.get("kl_loss_coef")) != 0.0:
        kl_type = a.get("kl_loss_type")
        if kl_type not in KL_TYPES:
            raise a.refuse("kl_loss_type", "only verl's k3 / low_var_kl and their '+' form (k2's gradient) are "
                           "implemented", "kl_loss_type: low_var_kl (or k3+)")
        fields.update(kl_coef=float(a.get("kl_loss_coef")), kl_estimator=KL_TYPES[kl_type])
    if g.get("use_kl_in_reward"):
        raise g.refuse("use_kl_in_reward", "a KL penalty in the reward before advantage estimation is not "
                       "implemented", "use_kl_in_reward: false with actor.use_kl_loss: true")
    if g.get("use_pf_ppo"):
        raise g.refuse("use_pf_ppo", "reweighting the batch by reward is data-side resampling, not done here",
                       "use_pf_ppo: false")
    rollout_fields = _rollout_correction(g, fields, notes)
    estimator, options, critic = _advantages(a, g, r, notes)
    batches = _generation(a, Settings(SOURCE, data, DATA_DEFAULTS, "data."),
                          Settings(SOURCE, trainer, TRAINER_DEFAULTS, "trainer."), notes)
    temperature = float(r.get("temperature"))
    engine = {"policy_temperature": temperature} if temperature != 1.0 else {}
    return Converted(loss=PolicyLoss(**fields), advantage_estimator=estimator, advantage_options=options,
                     engine=engine, critic=critic, rollout_fields=rollout_fields, generation=batches,
                     notes=tuple(notes))


def _generation(a: Settings, d: Settings, t: Settings, notes: list[str]) -> dict[str, Any] | None:
    """``train_batch_size / ppo_mini_batch_size`` mini-batches, ``ppo_epochs`` passes over them in one order."""
    prompts = d.count("train_batch_size", "prompts per batch")
    mini = a.count("ppo_mini_batch_size", "prompts per mini-batch")
    epochs = a.count("ppo_epochs", "passes over each batch")
    if prompts % mini:
        raise a.refuse("ppo_mini_batch_size", f"data.train_batch_size={prompts} is no whole number of these "
                       "mini-batches (verl refuses it too)", f"a divisor of data.train_batch_size={prompts} (give "
                       "data.train_batch_size; verl's default is 1024)")
    steps = prompts // mini
    if steps > 1 and a.get("shuffle"):
        raise a.refuse("shuffle", "verl's DataLoader then draws another order of the batch's rows in every epoch "
                       "(mini-batches across groups, seeded by data_loader_seed and the rank); here every pass "
                       "trains the same steps", "shuffle: false")
    if steps > 1:
        order = ("verl's trainer.balance_batch (on by default) first reorders the rows by length, so its "
                 "mini-batches mix groups: the same advantages, other rollouts per step (balance_batch: false for "
                 "verl's own split)") if t.get("balance_batch") else "verl's own mini-batches (balance_batch: false)"
        notes.append(f"generation: {steps} steps (mini-batches of ppo_mini_batch_size x rollout.n rows) per batch of "
                     "train_batch_size x rollout.n rows, its advantages estimated over all of it as verl's trainer "
                     f"does; split: groups cuts it into whole groups in the batch's order: {order}")
    if steps > 1 or epochs > 1:
        notes.append("generation: a step is ppo_mini_batch_size x rollout.n rollouts (rollouts_per_step for a file; "
                     "prompts_per_step for the online source, which takes generation as "
                     "data.source.init_args.generation)")
    return generation(steps, epochs, "groups")


def _rollout_correction(g: Settings, fields: dict[str, Any], notes: list[str]) -> dict[str, str]:
    """``algorithm.rollout_correction``: importance weights (TIS/IcePop, token or sequence product) and rejection
    sampling, both from ``old_log_prob - rollout_log_probs`` before the update."""
    base = {"response_mask": "loss_mask", "ref_log_prob": "ref_logprobs"}
    c = g.section("rollout_correction", CORRECTION_DEFAULTS)
    if not c.given or (c.get("rollout_is") is None and c.get("rollout_rs") is None):
        return {**base, "old_log_prob": "old_logprobs"}
    if c.get("bypass_mode"):
        raise c.refuse("bypass_mode", "bypass mode computes the weights and rejection against the current "
                       "policy's log-probs during the update", "bypass_mode: false (the recomputed old_log_prob)")
    if c.get("rollout_is_batch_normalize"):
        raise c.refuse("rollout_is_batch_normalize", "dividing the weights by their batch mean is not "
                       "implemented", "rollout_is_batch_normalize: false")
    level = c.get("rollout_is")
    if level is None:
        fields["importance_level"] = "none"  # rejection alone applies no weight to the kept tokens
    elif level in ("token", "sequence"):
        upper, lower = _is_threshold(c)
        if upper < 1.0:
            raise c.refuse("rollout_is_threshold", "an upper bound below 1 would shrink on-policy weights",
                           "an upper bound >= 1")
        if lower is not None and lower > 1.0:
            raise c.refuse("rollout_is_threshold", "a lower bound above 1 would raise on-policy weights",
                           "a lower bound <= 1")
        fields.update(importance_level="token" if level == "token" else "sequence-product",
                      importance_weight_cap=upper, importance_weight_floor=lower,
                      importance_weight_mode="truncate" if lower is None else "mask")
    else:
        raise c.refuse("rollout_is", "not 'token', 'sequence' or null", "token")
    if c.get("rollout_rs") is not None:
        fields["rejection"] = _rejection(c)
        notes.append("rollout_rs: rejected tokens leave the loss and its normalisers, as verl's response_mask; "
                     "the decisions are verl's but for a statistic within a float64 ulp of a bound (k1 bounds are "
                     "compared as weights in [1/up, 1/lo]) and seq_mean's count (verl adds 1e-8 to a float mask's)")
    return {**base, "rollout_log_probs": "old_logprobs", "old_log_prob": "prox_logprobs"}


def _is_threshold(c: Settings) -> tuple[float, float | None]:
    """``rollout_is_threshold``: a number (TIS: the upper bound) or ``"lower_upper"`` (IcePop: zero outside)."""
    spec = c.get("rollout_is_threshold")
    if isinstance(spec, str) and "_" in spec:
        lower, upper = spec.split("_", 1)
        return float(upper), float(lower)
    return float(spec), None


def _rejection(c: Settings) -> tuple[Rejection, ...]:
    """verl's ``rollout_rs`` options (comma-separated, every one must pass) with their thresholds. ``k1`` options
    bound ``log(pi_rollout / pi_train) = -d``: ``"lo_up"`` keeps ``lo <= pi_rollout / pi_train <= up``, i.e. the
    weight within ``[1/up, 1/lo]``; a single number ``u`` means ``lo = 1/u``."""
    options = [o.strip() for o in str(c.get("rollout_rs")).split(",") if o.strip()]
    spec = c.get("rollout_rs_threshold")
    if spec is None:
        raise c.refuse("rollout_rs_threshold", "rollout_rs needs a threshold (verl refuses it too)", "a threshold")
    specs = [spec] if isinstance(spec, (int, float)) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise c.refuse("rollout_rs_threshold", f"{len(specs)} thresholds for {len(options)} options", "one "
                       "threshold, or one per option")
    rules = []
    for option, threshold in zip(dict.fromkeys(options), specs):
        head, _, metric = option.rpartition("_")
        if head not in RS_LEVELS or metric not in ("k1", "k2", "k3") or option == "seq_max_k1":
            raise c.refuse("rollout_rs", f"{option!r} is not a verl 0.9.1 option", "token_k1, seq_mean_k3, ...")
        level = RS_LEVELS[head]
        if metric == "k1":
            text = str(threshold)
            lo, up = (float(x) for x in text.split("_", 1)) if "_" in text else (1.0 / float(text), float(text))
            # -d in [log lo, log up]  <=>  the weight exp(d) in [1/up, 1/lo]
            rules.append(Rejection(metric="ratio", level=level, lower=1.0 / up, upper=1.0 / lo))
        else:
            rules.append(Rejection(metric=metric, level=level, upper=float(threshold)))
    return tuple(rules)


def _advantages(a: Settings, g: Settings, r: Settings, notes: list[str]
                ) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """GRPO (unbiased std, epsilon 1e-6) or GAE (a PPOCritic, whitened)."""
    estimator = g.get("adv_estimator")
    if estimator in ("grpo", "grpo_vectorized"):
        n = r.get("n") if r.get("n") is not None else a.get("rollout_n")
        if n is not None and int(n) < 2:
            raise Settings(SOURCE, None, {"rollout.n": n}).refuse(
                "rollout.n", "a GRPO group of one gets r / (1 + epsilon) in verl (mean 0, std 1) and 0 here",
                "rollout.n >= 2")
        if not g.get("norm_adv_by_std_in_grpo"):
            return "grpo", {"scale_by_std": False}, None
        return "grpo", {"std_unbiased": True, "eps": 1e-6}, None
    if estimator == "gae":
        if g.section("rollout_correction", CORRECTION_DEFAULTS).get("rollout_rs") is not None:
            raise g.refuse("adv_estimator", "with rollout_rs verl's GAE skips the rejected tokens as time steps and "
                           "whitens over the kept ones; here GAE runs on the trained tokens before rejection",
                           "adv_estimator: grpo with rollout_rs, or GAE with rollout_is only")
        notes.append("gae: PPOCritic(gamma, lam, whiten=True) with the critic's ValueLoss(clip_eps = "
                     "critic.cliprange_value); verl's trainer whitens once over the whole batch's trained tokens "
                     "(train_batch_size x rollout.n rollouts), before its mini-batches; the critic trains on the "
                     "policy's steps (verl's critic.ppo_mini_batch_size and ppo_epochs default to the actor's)")
        return "gae", {}, {"gamma": float(g.get("gamma")), "lam": float(g.get("lam")), "whiten": True}
    raise g.refuse("adv_estimator", "this estimator is not implemented here", "adv_estimator: grpo (or gae)")
