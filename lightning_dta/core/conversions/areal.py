"""AReaL 1.0.4's ``PPOActorConfig`` as our loss (``areal/utils/functional/functional.py::ppo_actor_loss_fn``,
``areal/trainer/ppo/actor.py``; docs/losses.md).

One of our steps is one AReaL PPO minibatch (``ppo_n_minibatches`` of them per batch): AReaL divides by its trained
tokens over every rank, our ``token-mean`` (AReaL has no other aggregation, no entropy bonus and its KL is a reward
term). Per-token inputs: ``logprobs`` (the inference engine's) -> ``old_logprobs``; with ``use_decoupled_loss``,
``prox_logp`` (the recompute) -> ``prox_logprobs``; ``loss_mask`` -> ``loss_mask``. Advantages: AReaL's GAE without a
critic (``discount = gae_lambda = 1``) gives every trained token the rollout's reward, then ``adv_norm`` normalises
over tokens: our ``grpo_advantages(weighting="token")``, once over the whole batch (``compute_advantages``) before
``ppo_update`` cuts it into ``ppo_n_minibatches`` minibatches: our ``generation`` (``steps_per_generation``, one pass).
AReaL packs its minibatches by token count (``split_padded_tensor_dict_into_mb_list``: rollouts of one group land in
different minibatches); ours hold whole groups (``split: groups``): the same advantages, other rollouts per step.
"""

from __future__ import annotations

from typing import Any

from lightning_dta.core.conversions import Converted, Settings, generation
from lightning_dta.core.losses import PolicyLoss, Rejection

SOURCE = "AReaL PPOActorConfig"

DEFAULTS: dict[str, Any] = {
    "eps_clip": 0.2, "eps_clip_higher": None, "c_clip": None, "m2_threshold": None, "reward_norm": None,
    "reward_scaling": 1.0, "reward_bias": 0.0, "reward_clip": 20.0, "overlong_reward_penalty": False,
    "mask_no_eos_with_zero": False, "discount": 1.0, "gae_lambda": 1.0, "adv_norm": None, "kl_ctl": 0.1,
    "use_sapo_loss": False, "use_decoupled_loss": False, "rejection_sampling": None,
    "importance_sampling_level": "token", "prox_logp_method": "recompute", "temperature": 1.0,
    "behav_imp_weight_cap": None, "behave_imp_weight_cap": None, "ppo_n_minibatches": 4,
}
RS_DEFAULTS: dict[str, Any] = {"level": "token", "action": "mask", "metric": "ratio", "agg": "mean", "upper": 5.0,
                               "lower": None}
NORM_DEFAULTS: dict[str, Any] = {"mean_level": "batch", "std_level": "batch", "std_unbiased": True, "eps": 1e-5,
                                 "group_size": 1, "mean_leave1out": False}
LEVELS = {"group": "group", "batch": "step"}


def from_areal(actor: Any) -> Converted:
    """Convert AReaL's actor config (``actor:`` in its YAML: a ``PPOActorConfig`` or mapping); refuse what has no
    exact equivalent."""
    s = Settings(SOURCE, actor, DEFAULTS, "actor.")
    notes = ["AReaL computes the behaviour weight and the rejection decision in float32 and its advantages in "
             "float32; here in the rollouts' float64"]
    for legacy in ("behav_imp_weight_cap", "behave_imp_weight_cap"):
        if s.get(legacy) is not None:
            raise s.refuse(legacy, "AReaL 1.0.4 removed it (it refuses the key too)", "rejection_sampling: "
                           "{level: token, action: mask, upper: <cap>} with use_decoupled_loss: true")
    if s.get("use_sapo_loss"):
        raise s.refuse("use_sapo_loss", "SAPO's soft gate is not implemented", "use_sapo_loss: false")
    if s.get("m2_threshold") is not None:
        raise s.refuse("m2_threshold", "M2PO's second-moment token masking needs the batch's statistics under the "
                       "current weights", "m2_threshold: null")
    if s.get("prox_logp_method") not in ("recompute", "metrics"):
        raise s.refuse("prox_logp_method", "an approximated proximal policy is not implemented",
                       "prox_logp_method: recompute")
    level = s.get("importance_sampling_level")
    if level not in ("token", "sequence"):
        raise s.refuse("importance_sampling_level", "not 'token' or 'sequence'", "token")
    high = s.get("eps_clip_higher")
    fields: dict[str, Any] = {"clip_eps": float(s.get("eps_clip")),
                              "clip_eps_high": float(s.get("eps_clip")) if high is None else float(high)}
    if level == "sequence":  # GSPO: the sequence ratio and the rollout's mean advantage
        fields.update(loss_mode="gspo", advantage_level="sequence-mean")
    if s.get("c_clip") is not None:
        if level == "sequence":
            raise s.refuse("c_clip", "our dual clip is token-level PPO's", "c_clip: null")
        fields["dual_clip"] = float(s.get("c_clip"))
    rollout_fields = {"loss_mask": "loss_mask", "logprobs": "old_logprobs"}
    if s.get("use_decoupled_loss"):
        rollout_fields["prox_logp"] = "prox_logprobs"
        _rejection_sampling(s, fields, level)
    elif s.get("rejection_sampling") is not None:
        notes.append("rejection_sampling is ignored without use_decoupled_loss (as in AReaL)")
    estimator, options = _advantages(s, notes)
    minibatches = s.count("ppo_n_minibatches", "minibatches (optimizer steps) per batch")
    if minibatches > 1:
        notes.append(f"generation: {minibatches} steps per batch, its advantages normalised over all of it as "
                     "AReaL's; AReaL packs its minibatches by token count (a group's rollouts in several), ours hold "
                     "whole groups (split: groups): the same advantages, other rollouts per step. A step is "
                     "the batch / ppo_n_minibatches rollouts (rollouts_per_step for a file; the online source takes "
                     "generation as data.source.init_args.generation)")
    temperature = float(s.get("temperature"))
    engine = {"policy_temperature": temperature} if temperature != 1.0 else {}
    return Converted(loss=PolicyLoss(**fields), advantage_estimator=estimator, advantage_options=options,
                     engine=engine, rollout_fields=rollout_fields, generation=generation(minibatches, 1, "groups"),
                     notes=tuple(notes))


def _rejection_sampling(s: Settings, fields: dict[str, Any], level: str) -> None:
    """The behaviour weight ``exp(prox - old)``: none without ``rejection_sampling`` (AReaL 1.0.4 applies none),
    clamped (``action: clamp``) or with rejected tokens dropped from the loss but kept in the normaliser
    (``action: mask``)."""
    rs = s.section("rejection_sampling", RS_DEFAULTS)
    if not rs.given:
        fields["importance_level"] = "none"
        return
    if rs.get("metric") != "ratio":
        raise rs.refuse("metric", "AReaL's KL metrics keep rejected tokens in the normaliser with weights of their "
                        "own; only the ratio metric converts", "metric: ratio")
    lower = rs.get("lower")
    lower = None if lower is None or float(lower) <= 0.0 else float(lower)  # clamp's default lower bound is 0
    upper = float(rs.get("upper"))
    rs_level, action, agg = rs.get("level"), rs.get("action"), rs.get("agg")
    if rs_level == "token" and level == "sequence":
        raise rs.refuse("level", "with GSPO AReaL's sequence ratio carries each token's behaviour weight into the "
                        "whole rollout's gradient; ours weights each token's own term (the same loss value, "
                        "another gradient)", "level: sequence")
    if rs_level == "token" and action == "clamp":
        fields.update(importance_level="token", importance_weight_cap=upper, importance_weight_floor=lower)
    elif rs_level == "sequence" and action == "clamp":
        if agg != "mean":
            raise rs.refuse("agg", "AReaL then clamps the geometric-mean weight only where the sum or max is out of "
                            "bounds", "agg: mean")
        fields.update(importance_level="sequence", importance_weight_cap=upper, importance_weight_floor=lower)
    elif action == "mask":
        reject_level = "token" if rs_level == "token" else {"sum": "sequence-sum", "mean": "sequence-mean",
                                                            "max": "sequence-max"}[agg]
        fields.update(importance_level="token" if rs_level == "token" else "sequence",
                      rejection=(Rejection(metric="ratio", level=reject_level, lower=lower, upper=upper),),
                      rejection_keeps_normalizer=True)
    else:
        raise rs.refuse("action", "not 'mask' or 'clamp'", "mask")


def _advantages(s: Settings, notes: list[str]) -> tuple[str, dict[str, Any]]:
    """AReaL's advantages without a critic: the reward on every trained token, normalised over tokens."""
    if float(s.get("kl_ctl")) != 0.0:
        raise s.refuse("kl_ctl", "AReaL adds -kl_ctl x KL(old, ref) to every token's reward before GAE (with a "
                       "zero reference when there is no ref model); a reward-side KL is not implemented",
                       "kl_ctl: 0 (and PolicyLoss.kl_coef for a KL in the loss)")
    for name, neutral in (("discount", 1.0), ("gae_lambda", 1.0), ("reward_scaling", 1.0), ("reward_bias", 0.0)):
        if float(s.get(name)) != neutral:
            raise s.refuse(name, "AReaL's per-token reward shaping before GAE is not implemented (without a critic "
                           "only discount = gae_lambda = 1 give every token the rollout's reward)", f"{neutral}")
    for name in ("reward_norm", "overlong_reward_penalty", "mask_no_eos_with_zero"):
        if s.get(name):
            raise s.refuse(name, "reward shaping before the advantages is the caller's here", "null / false, with "
                           "the shaped reward given as the rollout's reward")
    notes.append(f"reward_clip: AReaL clips rewards to +-{s.get('reward_clip')}; give clipped rewards")
    norm = s.section("adv_norm", NORM_DEFAULTS)
    if not norm.given:
        return "grpo", {"mean_over": None, "scale_by_std": False}
    if norm.get("mean_leave1out"):
        raise norm.refuse("mean_leave1out", "a leave-one-out baseline is not implemented", "mean_leave1out: false")
    mean, std = norm.get("mean_level"), norm.get("std_level")
    if mean is None and std is not None:
        raise norm.refuse("std_level", "AReaL then scales by the root mean square around 0", "mean_level equal to "
                          "std_level")
    if mean is not None and std is not None and mean != std:
        raise norm.refuse("std_level", "AReaL's std over the batch is taken around each group's mean", "std_level "
                          "equal to mean_level")
    options: dict[str, Any] = {"weighting": "token", "mean_over": None if mean is None else LEVELS[mean]}
    if std is None:
        options["scale_by_std"] = False
    else:
        options.update(std_over=LEVELS[std], std_unbiased=bool(norm.get("std_unbiased")), eps=float(norm.get("eps")))
    if "group" in (mean, std):
        notes.append(f"adv_norm group_size={norm.get('group_size')}: AReaL's groups are consecutive rollouts; give "
                     "each its group_id")
    return "grpo", options
