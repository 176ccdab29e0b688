"""DTAModule: lazy model construction, one exact DFS step per optimizer step, logging, checkpoint resume."""

from __future__ import annotations

import copy
import csv
import dataclasses
import functools
import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from transformers import LlamaForCausalLM

import lightning_dta as dta
from lightning_dta.core.errors import ConfigError
from lightning_dta.lightning.data import RolloutDataModule
from lightning_dta.lightning.module import build_causal_lm
from tests import helpers
from tests.helpers.lightning import TINY_LLAMA, StepBatchData, grpo_rollouts, rank_batch, reference_step, tiny_llama
from tests.helpers.reference import reference_value_loss

LOSS = dict(clip_eps=0.2, kl_coef=0.1, agg="token-mean")
DATA = helpers.REPO / "data" / "tiny_rollouts.jsonl"


def trainer(tmp_path: Path, max_steps: int, **kwargs) -> L.Trainer:
    defaults = dict(strategy="dta", accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=tmp_path)
    return L.Trainer(**{**defaults, **kwargs})


def test_build_causal_lm_from_config_dict_and_module() -> None:
    model = build_causal_lm(TINY_LLAMA)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == TINY_LLAMA["vocab_size"] and model.config.num_hidden_layers == 2
    assert build_causal_lm(model) is model
    assert build_causal_lm(TINY_LLAMA, {"dtype": "float64"}).dtype == torch.float64  # YAML gives dtype strings
    with pytest.raises(ValueError, match="model_type"):
        build_causal_lm({"vocab_size": 8})
    with pytest.raises(TypeError, match="path or hub name"):
        build_causal_lm(3)


def test_hub_name_is_only_loaded_in_configure_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda name, **kw: calls.append((name, kw)) or tiny_llama())
    module = dta.DTAModule("Qwen/Qwen3-1.7B", model_kwargs={"dtype": "bfloat16"})
    assert module.model is None and calls == []  # parsing a config must not download anything
    assert module.hparams["model"] == "Qwen/Qwen3-1.7B"
    module.configure_model()
    module.configure_model()  # Lightning may call the hook again: build once
    assert calls == [("Qwen/Qwen3-1.7B", {"dtype": torch.bfloat16})]
    assert isinstance(module.model, LlamaForCausalLM)


def test_one_device_step_equals_hand_written_step_and_logs(tmp_path: Path) -> None:
    rollouts = grpo_rollouts()
    model = tiny_llama()
    ref = reference_step(model, rollouts, LOSS, lr=0.5, clip=0.05)
    module = dta.DTAModule(copy.deepcopy(model), optimizer=functools.partial(torch.optim.SGD, lr=0.5),
                           gradient_clip_val=0.05, loss=dta.PolicyLoss(**LOSS))
    data = StepBatchData(lambda t: [rank_batch(rollouts, t.global_rank, t.world_size)])
    fit = trainer(tmp_path, 1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    had_group, env = dist.is_initialized(), dict(os.environ)
    fit.fit(module, data)
    assert fit.global_step == 1
    assert dist.is_initialized() == had_group  # one device: no process group, every collective is a no-op
    assert "LOCAL_RANK" not in os.environ or env.get("LOCAL_RANK") == os.environ["LOCAL_RANK"]  # no launcher
    for name, p in module.model.named_parameters():  # same tree, same operations: bit-identical
        torch.testing.assert_close(p.grad, ref["grads"][name], rtol=0, atol=0)
        torch.testing.assert_close(p.detach(), ref["weights"][name], rtol=0, atol=0)

    rows = list(csv.DictReader(open(Path(fit.logger.log_dir) / "metrics.csv")))
    logged = {k: float(v) for row in rows for k, v in row.items() if v not in ("", None)}
    stats = dta.PrefixTree.from_rollouts(rollouts).stats
    assert logged["train/loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert logged["train/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    assert logged["train/logical_tokens"] == stats.logical_tokens
    assert logged["train/tree_tokens"] == stats.tree_tokens
    assert logged["train/compression_ratio"] == pytest.approx(stats.compression_ratio)
    assert logged["train/num_rollouts"] == len(rollouts)
    assert 0 < logged["train/clip_fraction"] < 1  # behaviour log-probs far from the model's: some clipped
    assert logged["train/lr"] == 0.5
    for key in ("train/approx_kl", "train/entropy", "train/ref_kl", "train/trained_tokens"):
        assert key in logged


def _epoch_batches() -> StepBatchData:
    """A custom loader with one step per epoch and new data each epoch (resume at an epoch boundary)."""
    return StepBatchData(lambda t: [rank_batch(grpo_rollouts(seed=t.current_epoch), 0, 1)])


def _rollout_file() -> RolloutDataModule:
    """The real datamodule, 8 shuffled steps per epoch (resume in the middle of an epoch)."""
    return RolloutDataModule(path=DATA, rollouts_per_step=8, advantage_estimator="grpo", shuffle=True, seed=3)


def _resume_run(tmp_path: Path, data, max_steps: int, ckpt: Path | None = None, save: Path | None = None) -> dict:
    """AdamW + a warm-up schedule, so a resume that lost optimizer or scheduler state gives another step 2."""
    torch.manual_seed(0)
    config = {**TINY_LLAMA, "vocab_size": 256, "max_position_embeddings": 512}  # the rollout file's limits
    module = dta.DTAModule(config, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           lr_scheduler=functools.partial(torch.optim.lr_scheduler.LinearLR, start_factor=0.1,
                                                          total_iters=4), gradient_clip_val=1.0,
                           # the rollout file carries no reference log-probs: a KL term is refused on it
                           loss=dta.PolicyLoss(**LOSS) if data is _epoch_batches else dta.PolicyLoss())
    fit = trainer(tmp_path, max_steps, reload_dataloaders_every_n_epochs=1)
    fit.fit(module, data(), ckpt_path=ckpt)
    if save is not None:
        fit.save_checkpoint(save)
    assert fit.global_step == max_steps
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


@pytest.mark.parametrize("data", [_epoch_batches, _rollout_file], ids=["epoch-boundary", "mid-epoch-datamodule"])
def test_checkpoint_resume_gives_the_uninterrupted_step(tmp_path: Path, data) -> None:
    uninterrupted = _resume_run(tmp_path / "a", data, 2)
    ckpt = tmp_path / "step1.ckpt"
    after_one = _resume_run(tmp_path / "b", data, 1, save=ckpt)
    resumed = _resume_run(tmp_path / "c", data, 2, ckpt=ckpt)
    assert any(not torch.equal(after_one[n], uninterrupted[n]) for n in uninterrupted)  # step 2 did something
    for name, weight in uninterrupted.items():
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=0, msg=name)


class _GAEData(StepBatchData):
    advantage_estimator = "gae"  # what the module checks on the data side before training a critic


def _rewarded_rollouts_and_critic() -> tuple[list[dta.Rollout], torch.nn.Module]:
    """GRPO-like rollouts with random rewards, and a critic whose head is not zero (values differ by position)."""
    rollouts = grpo_rollouts()
    rng = torch.Generator().manual_seed(0)
    for rollout in rollouts:
        rollout.reward = float(torch.rand((), generator=rng))
    critic = dta.value_model(tiny_llama(seed=1))
    with torch.no_grad():
        critic.get_output_embeddings().weight.normal_(0, 0.3, generator=rng)
    return rollouts, critic


def _critic_values(critic: torch.nn.Module, rollout: dta.Rollout) -> list[float]:
    """The rollout's values by its own forward: token t's state is the head's output at position t - 1."""
    with torch.no_grad():
        values = critic(input_ids=torch.tensor([rollout.input_ids])).logits[0, :, 0].tolist()
    return [0.0] + values[:-1]


def _gae_by_hand(rollout: dta.Rollout, gamma: float, lam: float) -> dta.Rollout:
    """A copy with GAE's advantages and returns in their closed form, from the rollout's old_values and reward."""
    r = copy.deepcopy(rollout)
    steps = [t for t, m in enumerate(r.loss_mask) if m]
    v = [r.old_values[t] for t in steps] + [0.0]
    deltas = [(r.reward if k == len(steps) - 1 else 0.0) + gamma * v[k + 1] - v[k] for k in range(len(steps))]
    r.advantages, r.returns = [0.0] * len(r), [0.0] * len(r)
    for k, t in enumerate(steps):
        r.advantages[t] = sum((gamma * lam) ** j * deltas[k + j] for j in range(len(steps) - k))
        r.returns[t] = r.advantages[t] + v[k]
    return r


def _critic_module(model: torch.nn.Module, critic: torch.nn.Module, value_loss: dta.ValueLoss, gamma: float,
                   lam: float) -> dta.DTAModule:
    """The module of the hand-written PPO step below: SGD for both models, both clipped to a norm of 0.05."""
    return dta.DTAModule(copy.deepcopy(model), optimizer=functools.partial(torch.optim.SGD, lr=0.5),
                         gradient_clip_val=0.05, loss=dta.PolicyLoss(**LOSS),
                         critic=dta.PPOCritic(copy.deepcopy(critic), optimizer=functools.partial(torch.optim.SGD,
                                              lr=0.3), value_loss=value_loss, gamma=gamma, lam=lam))


def _assert_hand_written_ppo_step(module: dta.DTAModule, model: torch.nn.Module, critic: torch.nn.Module,
                                  expected: list[dta.Rollout], value_loss: dta.ValueLoss) -> None:
    """The module's weights after one step: the policy step on ``expected``'s advantages and the critic step on
    its returns (clipped value loss around its old_values), SGD, written out by hand."""
    ref_policy = reference_step(model, expected, LOSS, lr=0.5, clip=0.05)
    ref_critic = copy.deepcopy(critic)
    reference_value_loss(ref_critic, expected, value_loss).backward()
    torch.nn.utils.clip_grad_norm_(ref_critic.parameters(), 0.05)
    torch.optim.SGD(ref_critic.parameters(), lr=0.3).step()
    for name, p in module.model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_policy["weights"][name], rtol=1e-5, atol=1e-7)
    for (name, p), q in zip(module.critic.named_parameters(), ref_critic.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7, msg=name)


def _logged(fit: L.Trainer) -> dict[str, float]:
    rows = list(csv.DictReader(open(Path(fit.logger.log_dir) / "metrics.csv")))
    return {k: float(v) for row in rows for k, v in row.items() if v not in ("", None)}


def test_a_step_with_a_critic_equals_the_hand_written_ppo_step(tmp_path: Path) -> None:
    """DTAModule(critic=...): values from the critic, GAE (its closed form here), the policy step on those
    advantages and the critic step on those returns (clipped value loss, SGD), as written out by hand."""
    rollouts, critic = _rewarded_rollouts_and_critic()
    model, gamma, lam, value_loss = tiny_llama(), 0.9, 0.8, dta.ValueLoss(clip_eps=0.01)
    expected = [_gae_by_hand(dataclasses.replace(r, old_values=_critic_values(critic, r)), gamma, lam)
                for r in rollouts]
    module = _critic_module(model, critic, value_loss, gamma, lam)
    data = _GAEData(lambda t: [rank_batch(rollouts, t.global_rank, t.world_size)])
    fit = trainer(tmp_path, 1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    fit.fit(module, data)
    assert fit.global_step == 1  # the critic's optimizer step is not counted
    _assert_hand_written_ppo_step(module, model, critic, expected, value_loss)
    logged = _logged(fit)
    # old_values are this step's own values: with one optimizer step per batch the value clip never binds
    assert logged["critic/value_clip_fraction"] == 0 and logged["critic/loss"] > 0


def test_old_values_in_a_rollout_file_are_gaes_baseline_and_the_value_clips_anchor(tmp_path: Path) -> None:
    """Values recorded at generation time win: rollouts 0-5 of the file carry old_values 0.5 above the critic's
    (clip_eps 0.05, so the clip binds), and they are GAE's V and ValueLoss's anchor; the critic fills only
    rollouts 6-11. The step equals the hand-written one on those values, and its critic loss is the definition's,
    not the one on the critic's own values (what PPOCritic.estimate used to train on: it overwrote every rollout's
    old_values). The source's rollouts are left as read (a file's are read again each epoch)."""
    rollouts, critic = _rewarded_rollouts_and_critic()
    model, gamma, lam, value_loss = tiny_llama(), 0.9, 0.8, dta.ValueLoss(clip_eps=0.05)
    own = [_critic_values(critic, r) for r in rollouts]
    for rollout, values in zip(rollouts[:6], own):
        rollout.old_values = [v + 0.5 for v in values]
    path = tmp_path / "rollouts.jsonl"
    dta.write_rollouts(path, rollouts)
    expected = [_gae_by_hand(r if r.old_values else dataclasses.replace(r, old_values=values), gamma, lam)
                for r, values in zip(rollouts, own)]
    overwritten = [_gae_by_hand(dataclasses.replace(r, old_values=values), gamma, lam)
                   for r, values in zip(rollouts, own)]

    module = _critic_module(model, critic, value_loss, gamma, lam)
    data = RolloutDataModule(path=path, advantage_estimator="gae")
    fit = trainer(tmp_path, 1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    fit.fit(module, data)
    _assert_hand_written_ppo_step(module, model, critic, expected, value_loss)
    logged = _logged(fit)
    with torch.no_grad():
        want, before = (float(reference_value_loss(critic, r, value_loss)) for r in (expected, overwritten))
    assert logged["critic/loss"] == pytest.approx(want, rel=1e-5)
    assert abs(want - before) > 0.1 * want
    assert logged["critic/value_clip_fraction"] > 0
    (_, read), = data.source.steps(0, 0, data.limits)
    assert [r.old_values for r in read] == [r.old_values for r in rollouts] and read[6].old_values is None
    assert [r.advantages for r in read] == [r.advantages for r in rollouts]


def test_a_critic_and_gae_come_together(tmp_path: Path) -> None:
    data = StepBatchData(lambda t: [rank_batch(grpo_rollouts(), t.global_rank, t.world_size)])
    module = dta.DTAModule(tiny_llama(), critic=dta.PPOCritic(TINY_LLAMA))
    with pytest.raises(ValueError, match="advantage_estimator: gae"):
        trainer(tmp_path, 1).fit(module, data)
    with pytest.raises(ValueError, match=r"needs a critic.*DTAModule\(critic=...\)"):
        trainer(tmp_path, 1).fit(dta.DTAModule(tiny_llama()), _GAEData(data.make))


def test_a_skipped_step_does_not_step_the_schedule(tmp_path: Path) -> None:
    """A non-finite step is no optimizer step: the learning-rate schedule waits for the next real one."""
    good = grpo_rollouts()
    bad = copy.deepcopy(good)
    bad[0].advantages, bad[0].old_logprobs = -1.0, [-1e4] * len(bad[0])  # ratio exp(logp + 1e4): PPO term +inf
    module = dta.DTAModule(tiny_llama(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           lr_scheduler=functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: 1.0))
    data = StepBatchData(lambda t: [rank_batch(r, t.global_rank, t.world_size) for r in (good, bad, good)])
    fit = trainer(tmp_path, 2)
    with pytest.warns(RuntimeWarning, match="batch 1 skipped on every rank"):
        fit.fit(module, data)
    assert fit.global_step == 2 and module.lr_schedulers().last_epoch == 2


# Every PolicyLoss option that adds a term to the policy-gradient one (the KL in each estimator, the ratio-weighted
# KL, the entropy bonus with verl's and TRL's aggregations), and the bonus under each loss mode.
TERM_OPTIONS = {
    "kl-k3": dict(kl_coef=0.1),
    "kl-low_var_kl": dict(kl_coef=0.1, kl_estimator="low_var_kl"),
    "kl-k3+": dict(kl_coef=0.1, kl_estimator="k3+"),
    "kl-ratio-weighted": dict(kl_coef=0.1, kl_ratio_weighted=True),
    "entropy-verl": dict(entropy_coef=0.01),
    "entropy-trl": dict(entropy_coef=0.01, entropy_agg="token-mean"),
    "entropy-gspo": dict(entropy_coef=0.01, loss_mode="gspo"),
    "entropy-cispo": dict(entropy_coef=0.01, loss_mode="cispo"),
    "kl-and-entropy": dict(kl_coef=0.1, entropy_coef=0.01),
}


@pytest.mark.parametrize("options", TERM_OPTIONS.values(), ids=TERM_OPTIONS.keys())
def test_a_non_finite_step_is_skipped_and_named_whatever_terms_the_loss_adds(tmp_path: Path, options: dict) -> None:
    """Rollout 2 of a group has behaviour log-probs of -1e4 and a negative advantage: its ratio exp(logp + 1e4) is
    inf and so is its policy term (CISPO's: its decoupled weight). The step is skipped (weights unchanged, no
    optimizer step) and the warning names that rollout alone. The diagnosis used to hand the loss entropy=None, and
    the bonus crashed on it (AttributeError)."""
    rollouts = grpo_rollouts(groups=1)
    rollouts[2].advantages, rollouts[2].old_logprobs = -1.0, [-1e4] * len(rollouts[2])
    if options.get("loss_mode") == "cispo":  # its ratio is clipped before it weighs: the decoupled weight overflows
        rollouts[2].prox_logprobs = [-1.0] * len(rollouts[2])  # w = exp(prox - old) = exp(9999)
    model = tiny_llama()
    module = dta.DTAModule(copy.deepcopy(model), loss=dta.PolicyLoss(**options),
                           optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    fit = trainer(tmp_path, 1, max_epochs=1)  # one epoch of one batch: a skipped step is not retried
    with pytest.warns(RuntimeWarning, match=r"batch 0 skipped on every rank .*non-finite loss terms in rollouts "
                                            rf"\['2 \({len(rollouts[2])} tokens, group 0\)'\]"):
        fit.fit(module, StepBatchData(lambda t: [rank_batch(rollouts, 0, 1)]))
    assert fit.global_step == 0
    for name, weight in module.model.named_parameters():
        torch.testing.assert_close(weight.detach(), model.get_parameter(name), rtol=0, atol=0)


def test_clipping_optimizer_and_model_settings_are_refused_when_the_module_is_built() -> None:
    """A negative gradient_clip_val used to be skipped by Lightning's clipping and to flip the critic's gradient in
    torch's clip_grad_norm_; a negative learning rate surfaced only at setup, as a traceback."""
    for value in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="model.gradient_clip_val=.*Fix: "):
            dta.DTAModule(TINY_LLAMA, gradient_clip_val=value)
    with pytest.raises(ConfigError, match="gradient_clip_algorithm='max'"):
        dta.DTAModule(TINY_LLAMA, gradient_clip_algorithm="max")
    with pytest.raises(ConfigError, match="model.optimizer refuses its settings: Invalid learning rate: -1.0"):
        dta.DTAModule(TINY_LLAMA, optimizer=functools.partial(torch.optim.AdamW, lr=-1.0))
    with pytest.raises(ConfigError, match="SGD has a learning rate of nan"):  # SGD itself lets NaN through
        dta.DTAModule(TINY_LLAMA, optimizer=functools.partial(torch.optim.SGD, lr=float("nan")))
    with pytest.raises(ConfigError, match="model.critic.optimizer refuses its settings"):
        dta.PPOCritic(TINY_LLAMA, optimizer=functools.partial(torch.optim.AdamW, betas=(1.5, 0.9)))
    with pytest.raises(ConfigError, match="model.model.model_type='nosuch'"):
        dta.DTAModule({**TINY_LLAMA, "model_type": "nosuch"})

    def by_name(parameters):  # a factory of the user's that needs the model's own parameters
        named = list(parameters)
        return torch.optim.SGD([{"params": named[:1], "lr": 0.1}, {"params": named[1:], "lr": 0.01}])

    module = dta.DTAModule(TINY_LLAMA, optimizer=by_name, gradient_clip_val=0.0)  # 0: no clipping
    module.configure_model()
    assert len(module.configure_optimizers().param_groups) == 2


def test_64_true_trains_in_float64_with_the_hand_written_step(tmp_path: Path) -> None:
    """--trainer.precision=64-true used to fail at the first step (the gradient norm asked float32 of float64)."""
    rollouts = grpo_rollouts()
    module = dta.DTAModule(tiny_llama(), loss=dta.PolicyLoss(**LOSS), gradient_clip_val=0.5,
                           optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    want = reference_step(tiny_llama().double(), rollouts, LOSS, lr=0.1, clip=0.5)
    trainer(tmp_path, 1, precision="64-true").fit(module, StepBatchData(lambda t: [rank_batch(rollouts, 0, 1)]))
    for name, weight in module.model.named_parameters():
        assert weight.dtype == torch.float64, name
        torch.testing.assert_close(weight.detach(), want["weights"][name], rtol=1e-9, atol=1e-12, msg=name)


def test_bf16_true_clips_by_the_logged_float32_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One gradient norm, in float32 or better, both clips and is logged. bfloat16 gradients used to be clipped by
    torch's ``clip_grad_norm_``, which computes its own norm (and factor) in bfloat16: 551 of the 26,784 clipped
    entries differed from the gradient scaled by the logged norm's factor."""
    import lightning_dta.lightning.step as step_module

    seen = {}
    clip_by_norm = step_module.clip_by_norm

    def observed(parameters, max_norm: float, norm: float) -> None:
        parameters = list(parameters)
        seen.update(before=[p.grad.clone() for p in parameters], norm=norm)
        clip_by_norm(parameters, max_norm, norm)
        seen["after"] = [p.grad.clone() for p in parameters]

    monkeypatch.setattr(step_module, "clip_by_norm", observed)
    clip = 0.05
    module = dta.DTAModule(tiny_llama(), gradient_clip_val=clip, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    fit = trainer(tmp_path, 1, precision="bf16-true")
    fit.fit(module, StepBatchData(lambda t: [rank_batch(grpo_rollouts(), 0, 1)]))
    before, after, norm = seen["before"], seen["after"], seen["norm"]
    assert {g.dtype for g in before} == {torch.bfloat16}
    assert float(fit.callback_metrics["train/grad_norm"]) == pytest.approx(norm, rel=1e-7)  # logged as float32
    assert norm == pytest.approx(sum(float(g.double().square().sum()) for g in before) ** 0.5, rel=1e-6)
    assert norm > clip  # clipping acts
    factor = torch.tensor(clip / (norm + 1e-6), dtype=torch.float32)  # torch's factor, from the logged norm
    expected = [(grad.float() * factor).bfloat16() for grad in before]  # scaled in float32, rounded once
    assert sum(int((clipped != want).sum()) for clipped, want in zip(after, expected)) == 0


def test_16_mixed_on_the_cpu_trains_with_prefix_attention(tmp_path: Path) -> None:
    """Lightning turns 16-mixed into bf16-mixed on a CPU; the kernels' self-check used to fail on the mixed dtypes
    of autocast and fall back to the model's attention (a KernelCheckWarning)."""
    import warnings

    from lightning_dta.engine.attention_check import KernelCheckWarning

    module = dta.DTAModule(tiny_llama(), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCheckWarning)
        fit = trainer(tmp_path, 1, precision="16-mixed")
        assert fit.precision == "bf16-mixed"
        fit.fit(module, StepBatchData(lambda t: [rank_batch(grpo_rollouts(), 0, 1)]))
    assert fit.global_step == 1
