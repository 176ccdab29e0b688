"""TRL 1.16's ``GRPOConfig`` as our loss (``trl/trainer/grpo_trainer.py::_compute_loss``; docs/losses.md).

One of our steps is one TRL optimizer step: ``gradient_accumulation_steps`` micro-batches. One TRL generation batch
is ``steps_per_generation`` micro-batches (by default one optimizer step) and feeds ``num_iterations`` passes: our
``generation`` (``steps_per_generation / gradient_accumulation_steps`` steps, ``num_iterations`` epochs), with the
advantages estimated once over the whole generation batch as TRL's ``_generate_and_score_completions`` does. TRL
shuffles the generation batch before cutting it (``shuffle_sequence_dict``, the global torch RNG): our ``split:
shuffled`` does the same with its own seeded permutation. TRL's per-token inputs map to ours as:
without vLLM's importance sampling, ``old_per_token_logps`` -> ``old_logprobs``; with it,
``sampling_per_token_logps`` (the inference engine's) -> ``old_logprobs`` and ``old_per_token_logps`` (the
trainer's recompute) -> ``prox_logprobs``; ``ref_per_token_logps`` -> ``ref_logprobs``; ``completion_mask`` (x
``tool_mask``) -> ``loss_mask`` on the completion's tokens.
"""

from __future__ import annotations

from typing import Any

from lightning_dta.core.conversions import Converted, Settings, generation
from lightning_dta.core.losses import PolicyLoss

SOURCE = "TRL GRPOConfig"

# GRPOConfig's defaults (trl 1.16.0, grpo_config.py), for a mapping that leaves a setting out.
DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "delta": None,
    "importance_sampling_level": "token", "scale_rewards": "group", "multi_objective_aggregation":
    "sum_then_normalize", "mask_truncated_completions": False, "top_entropy_quantile": 1.0, "entropy_coef": 0.0,
    "use_adaptive_entropy": False, "use_bias_correction_kl": True, "use_vllm": False,
    "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_cap": None, "max_completion_length": 512, "temperature": 1.0, "num_iterations": 1,
    "steps_per_generation": None, "generation_batch_size": None, "gradient_accumulation_steps": 1,
    "off_policy_mask_threshold": None, "num_generations": 8,
}

# loss_type -> our aggregation; the per-row ones count every row of the batch, a masked-out one included
AGGREGATION = {
    "grpo": {"agg": "seq-mean-token-mean", "agg_rollouts": "all"},
    "bnpo": {"agg": "token-mean"},
    "dr_grpo": {"agg": "seq-mean-token-sum-norm", "agg_rollouts": "all"},
    "dapo": {"agg": "token-mean"},
    "cispo": {"agg": "token-mean"},
    "luspo": {"agg": "seq-mean-token-sum", "agg_rollouts": "all"},
}
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def from_trl(config: Any) -> Converted:
    """Convert a ``trl.GRPOConfig`` (or its ``to_dict()``, or a mapping of the settings that differ from TRL's
    defaults) into our loss, advantage settings and temperature; refuse what has no exact equivalent."""
    s = Settings(SOURCE, config, DEFAULTS)
    notes: list[str] = []
    loss_type = s.get("loss_type")
    if loss_type in ("sapo", "vespo"):
        raise s.refuse("loss_type", "SAPO's soft gate and VESPO's sequence-level gamma weights are not implemented",
                       "loss_type='dapo' (or 'cispo')")
    if loss_type not in AGGREGATION:
        raise s.refuse("loss_type", "not a TRL 1.16 loss type", f"one of {sorted(AGGREGATION)}")
    accumulation = s.count("gradient_accumulation_steps", "micro-batches per optimizer step")
    steps_per_generation = s.get("steps_per_generation")
    if steps_per_generation is None and s.get("generation_batch_size") is not None:
        raise s.refuse("generation_batch_size", "it fixes steps_per_generation through the world size, which a "
                       "config alone does not know", "give steps_per_generation (GRPOConfig resolves it)")
    if loss_type in ("dapo", "cispo") and steps_per_generation not in (None, accumulation):
        raise s.refuse("steps_per_generation", f"with loss_type={loss_type!r} TRL divides every optimizer step by "
                       "the tokens of the whole generation batch x gradient_accumulation_steps / "
                       "steps_per_generation, not by the step's own tokens", "leave steps_per_generation unset "
                       "(= gradient_accumulation_steps)")
    batches = _generation(s, accumulation, notes)
    if loss_type == "bnpo" and accumulation > 1:
        raise s.refuse("loss_type", "bnpo averages each micro-batch over its own tokens and then the micro-batches "
                       f"(gradient_accumulation_steps={accumulation}); a step here has one normaliser",
                       "loss_type='dapo' (the token mean over the whole step)")
    fields: dict[str, Any] = dict(AGGREGATION[loss_type])
    if loss_type == "dr_grpo":
        fields["agg_norm_length"] = int(s.get("max_completion_length"))
    level = s.get("importance_sampling_level")
    if level not in ("token", "sequence"):
        raise s.refuse("importance_sampling_level", "not 'token' or 'sequence'", "'token'")
    epsilon = float(s.get("epsilon"))
    epsilon_high = s.get("epsilon_high")
    epsilon_high = epsilon if epsilon_high is None else float(epsilon_high)
    if loss_type == "cispo":
        if level == "sequence":
            raise s.refuse("importance_sampling_level", "TRL's cispo then weights every token by the sequence "
                           "ratio; ours weights each token by its own", "importance_sampling_level='token'")
        if epsilon_high < 1:
            raise s.refuse("epsilon_high", "TRL's cispo bounds the ratio at epsilon_high itself, and a bound below 1 "
                           "has no clip_eps_high >= 0 here", "epsilon_high >= 1 (ScaleRL: 5.0)")
        fields.update(loss_mode="cispo", clip_eps=1.0, clip_eps_high=epsilon_high - 1.0)
        notes.append("cispo: TRL bounds the ratio above at epsilon_high and not below: clip_eps_high = epsilon_high "
                     "- 1, clip_eps = 1 (a lower bound of 0 never binds); TRL's epsilon is unused by cispo")
    else:
        fields.update(clip_eps=epsilon, clip_eps_high=epsilon_high)
        if level == "sequence":
            fields["loss_mode"] = "gspo"
    delta = s.get("delta")
    if delta is not None and loss_type != "cispo":
        if level == "sequence":
            raise s.refuse("delta", "the two-sided clip with importance_sampling_level='sequence' has no dual clip "
                           "here (ours is token-level PPO's)", "delta=None")
        if float(delta) < 1.0 + epsilon_high:
            raise s.refuse("delta", f"below 1 + epsilon_high = {1.0 + epsilon_high} the cap also binds on "
                           "positive advantages, where our dual clip does not act", "delta >= 1 + epsilon_high, "
                           "or None")
        fields["dual_clip"] = float(delta)
    beta = float(s.get("beta"))
    if beta != 0.0:
        fields["kl_coef"] = beta
        if s.get("use_bias_correction_kl"):
            if level == "sequence":
                raise s.refuse("use_bias_correction_kl", "with importance_sampling_level='sequence' TRL multiplies "
                               "each token's KL by the sequence ratio, whose gradient needs the rollout's whole KL "
                               "before the walk", "use_bias_correction_kl=False")
            fields["kl_ratio_weighted"] = True
    _entropy(s, fields, accumulation)
    if float(s.get("top_entropy_quantile")) < 1.0:
        raise s.refuse("top_entropy_quantile", "the quantile of the whole batch's entropies under the current "
                       "weights would need a forward pass before the walk, which is not implemented", "1.0")
    if s.get("off_policy_mask_threshold") is not None:
        raise s.refuse("off_policy_mask_threshold", "TRL's off-policy sequence mask needs each rollout's mean "
                       "log-ratio under the current weights before the walk, which is not implemented", "None")
    rollout_fields = _importance_sampling(s, fields, level, notes)
    if s.get("mask_truncated_completions"):
        notes.append("mask_truncated_completions: a truncated completion trains no token (loss_mask 0) and still "
                     "counts in grpo/dr_grpo/luspo's mean over rows (agg_rollouts='all')")
    estimator, options = _advantages(s, notes)
    notes.append(f"advantages: each group is the num_generations={s.get('num_generations')} completions of a prompt "
                 "(group_id); TRL computes them in float32, here in float64")
    engine = {"policy_temperature": float(s.get("temperature"))} if float(s.get("temperature")) != 1.0 else {}
    return Converted(loss=PolicyLoss(**fields), advantage_estimator=estimator, advantage_options=options,
                     engine=engine, rollout_fields=rollout_fields, generation=batches, notes=tuple(notes))


def _generation(s: Settings, accumulation: int, notes: list[str]) -> dict[str, Any] | None:
    """TRL's generation batch (``steps_per_generation`` micro-batches, ``num_iterations`` passes) as optimizer steps:
    every step must lie inside one generation batch."""
    micro = accumulation if s.get("steps_per_generation") is None else \
        s.count("steps_per_generation", "micro-batches per generation batch")
    epochs = s.count("num_iterations", "passes over each generation batch")
    if micro % accumulation:
        raise s.refuse("steps_per_generation", f"an optimizer step is gradient_accumulation_steps={accumulation} "
                       "micro-batches, so this generation batch is no whole number of steps: a step would mix the "
                       "advantages of two generation batches", f"a multiple of {accumulation}")
    steps = micro // accumulation
    if steps > 1:
        notes.append(f"generation: one generation batch of steps_per_generation={micro} micro-batches is {steps} "
                     "optimizer steps, its advantages estimated over all of it as TRL's; split: shuffled cuts it "
                     "as TRL does after a permutation of our own (data seed, batch index), not TRL's torch.randperm: "
                     "the steps hold other rollouts than TRL's would, with the same advantages (split: groups keeps "
                     "each prompt's completions in one step, and the tree its sharing)")
    if steps > 1 or epochs > 1:
        notes.append("generation: a step is per_device_train_batch_size x processes x gradient_accumulation_steps "
                     "rollouts (rollouts_per_step for a file; the online source's prompts_per_step x "
                     "num_generations); the online source takes generation as data.source.init_args.generation")
    return generation(steps, epochs, "shuffled")


def _entropy(s: Settings, fields: dict[str, Any], accumulation: int) -> None:
    """TRL's entropy bonus: a token mean over the micro-batch, whatever the loss type."""
    if s.get("use_adaptive_entropy"):
        raise s.refuse("use_adaptive_entropy", "the coefficient follows the measured entropy from step to step",
                       "a fixed entropy_coef")
    coef = float(s.get("entropy_coef"))
    if coef == 0.0:
        return
    if accumulation > 1:
        raise s.refuse("entropy_coef", "TRL's entropy bonus is each micro-batch's token mean, averaged over "
                       f"gradient_accumulation_steps={accumulation} micro-batches; a step here has one normaliser",
                       "gradient_accumulation_steps=1, or entropy_coef=0")
    fields.update(entropy_coef=coef, entropy_agg="token-mean")


def _importance_sampling(s: Settings, fields: dict[str, Any], level: str, notes: list[str]) -> dict[str, str]:
    """vLLM's importance-sampling correction (computed at generation time from the trainer's and the engine's
    log-probs) as our decoupled weight; returns how TRL's tensors map to our rollout fields."""
    base = {"completion_mask (x tool_mask)": "loss_mask", "ref_per_token_logps": "ref_logprobs"}
    if not (s.get("use_vllm") and s.get("vllm_importance_sampling_correction")):
        return {**base, "old_per_token_logps": "old_logprobs"}
    mode = s.get("vllm_importance_sampling_mode")
    if mode not in IS_MODES:
        raise s.refuse("vllm_importance_sampling_mode", "not a TRL 1.16 mode", f"one of {IS_MODES}")
    clip_max = s.get("vllm_importance_sampling_clip_max")
    if s.get("vllm_importance_sampling_cap") is not None:  # deprecated; TRL copies it into clip_max
        clip_max = s.get("vllm_importance_sampling_cap")
    clip_min = s.get("vllm_importance_sampling_clip_min")
    if mode.startswith("token") and level == "sequence":
        raise s.refuse("vllm_importance_sampling_mode", "with importance_sampling_level='sequence' TRL's ratio "
                       "carries each token's weight into the whole rollout's gradient; ours weights each token's "
                       "own term (the same loss value, another gradient)", "a sequence_* mode")
    if clip_max is not None and float(clip_max) < 1.0:
        raise s.refuse("vllm_importance_sampling_clip_max", "a cap below 1 would shrink on-policy weights", ">= 1")
    if clip_min is not None and float(clip_min) > 1.0:
        raise s.refuse("vllm_importance_sampling_clip_min", "a floor above 1 would raise on-policy weights", "<= 1")
    if clip_min is not None and float(clip_min) <= 0.0:
        clip_min = None  # TRL clamps/masks at a non-positive bound: the weight exp(.) > 0 never meets it
    fields.update(importance_level="token" if mode.startswith("token") else "sequence-product",
                  importance_weight_mode="truncate" if mode.endswith("truncate") else "mask",
                  importance_weight_cap=None if clip_max is None else float(clip_max),
                  importance_weight_floor=None if clip_min is None else float(clip_min))
    notes.append("vLLM importance sampling: the weight exp(old_per_token_logps - sampling_per_token_logps) TRL "
                 "computes at generation time is exp(prox - old) here, from the rollouts' prox and old log-probs")
    return {**base, "sampling_per_token_logps": "old_logprobs", "old_per_token_logps": "prox_logprobs"}


def _advantages(s: Settings, notes: list[str]) -> tuple[str, dict[str, Any]]:
    """TRL's group-relative advantages: the group's mean, its unbiased std (or the batch's), eps 1e-4."""
    if s.get("multi_objective_aggregation") != "sum_then_normalize":
        raise s.refuse("multi_objective_aggregation", "each reward function normalised per group and the weighted "
                       "sum normalised again needs the rewards per function, which a rollout does not carry",
                       "'sum_then_normalize' (give the weighted sum as the rollout's reward)")
    scale = {True: "group", False: "none"}.get(s.get("scale_rewards"), s.get("scale_rewards"))
    if scale == "none":
        return "grpo", {"scale_by_std": False}
    if scale not in ("group", "batch"):
        raise s.refuse("scale_rewards", "not 'group', 'batch' or 'none'", "'group'")
    options: dict[str, Any] = {"eps": 1e-4, "std_unbiased": True}
    if scale == "batch":
        options["std_over"] = "step"
    return "grpo", options
