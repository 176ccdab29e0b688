"""Generation batches on the online source: one generation feeds several steps of whole prompts (multi-turn episodes
whole), advantages over the whole generation batch, a mid-batch resume with the same steps, PPO's ratio and clip
at work from the second step of a batch on, and async: staleness in generation batches, decoupled PPO's proximal
log-probs once per batch."""

from __future__ import annotations

import copy
import functools
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_dta as dta
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.generation import GenerationBatches
from lightning_dta.lightning.data import RolloutDataModule
from lightning_dta.rl import HFGenerator, OnlineRLCallback, OnlineRolloutSource, ReverseDigits
from tests.helpers.rl import ScriptedGenerator, tiny_policy
from tests.rl.test_source import TwoTurnEnv, drive

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice on workers and logging

EPS = 1e-6  # grpo's default


def two_turn_source(**kwargs) -> OnlineRolloutSource:
    """Two prompts x two samples per step; sample ``s`` of a prompt makes one or two calls (``TwoTurnEnv``)."""
    return OnlineRolloutSource(TwoTurnEnv(), ScriptedGenerator([[5, 2], [6, 7, 2]]), prompts_per_step=2,
                               samples_per_prompt=2, advantage_options={"std_over": "step"},
                               generation=GenerationBatches(steps_per_generation=2), **kwargs)


def test_one_generation_feeds_steps_of_whole_prompts_with_advantages_over_the_batch() -> None:
    src = two_turn_source()
    src.attach(tiny_policy())
    steps = [src.next_step(), src.next_step()]
    assert len(src.history) == 1  # generated once, for both steps
    info = src.last_step
    assert len(info.rewards) == 8  # 4 prompts x 2 episodes: the generation batch
    assert [sorted({r.group_id for r in step}) for step in steps] == [[0, 1], [2, 3]]  # whole prompts, in order
    # the definition, over the batch's 8 episodes (TwoTurnEnv: prompt p's episodes end with reward p + turns):
    # each episode's reward minus its prompt's mean, over the population std of all 8 rewards plus eps
    rewards, groups = info.rewards, [p for p in range(4) for _ in range(2)]
    mean = math.fsum(rewards) / 8
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / 8)
    expected = {p: sorted({(r - math.fsum(rewards[2 * p:2 * p + 2]) / 2) / (std + EPS)
                           for r, g in zip(rewards, groups) if g == p}) for p in range(4)}
    got = {p: sorted({r.advantages for step in steps for r in step if r.group_id == p}) for p in range(4)}
    assert got.keys() == expected.keys()
    for p in range(4):
        assert got[p] == pytest.approx(expected[p], rel=1e-12, abs=1e-12)
    assert any(r.advantages != 0 for step in steps for r in step)
    src.next_step()
    assert len(src.history) == 2 and src.last_step.index == 1  # the third step opens the next generation batch


def test_a_source_resumed_in_the_middle_of_a_generation_batch_hands_out_its_next_step(tmp_path) -> None:
    src = two_turn_source()
    src.attach(tiny_policy())
    src.next_step()
    path = tmp_path / "state.pt"
    torch.save(src.state_dict(), path)  # the way Lightning checkpoints it, read back as Lightning does
    second = src.next_step()
    resumed = two_turn_source()
    resumed.load_state_dict(torch.load(path, weights_only=True))
    resumed.attach(tiny_policy())
    assert [r.to_dict() for r in resumed.next_step()] == [r.to_dict() for r in second]
    assert resumed.generator.calls == [] and resumed.history == []  # the step came from the checkpoint
    assert resumed.last_step.rewards == src.last_step.rewards  # and the batch's statistics, for the metrics
    with pytest.raises(ConfigError, match="generation .*Fix: "):
        OnlineRolloutSource(TwoTurnEnv(), ScriptedGenerator([[5, 2]]), prompts_per_step=2,
                            samples_per_prompt=2).load_state_dict(src.state_dict())


def test_settings_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ConfigError, match="data.generation.*Fix: "):
        RolloutDataModule(source=two_turn_source(), generation=GenerationBatches(steps_per_generation=2))


class Metrics(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def test_from_the_second_step_of_a_generation_batch_the_ratio_departs_from_1_and_the_clip_binds(tmp_path) -> None:
    """Sync, 4 steps per generation batch, the rollouts' behaviour log-probs recorded by the generator: step 1
    trains the generating weights (ratio 1 up to the generator's float32 rounding, nothing clipped); steps 2-4 train
    weights the optimizer has moved, against the same behaviour log-probs, and the clip binds."""
    source = OnlineRolloutSource(ReverseDigits(), HFGenerator(max_new_tokens=6), prompts_per_step=2,
                                 samples_per_prompt=4, generation=GenerationBatches(steps_per_generation=4))
    module = dta.DTAModule(tiny_policy(scale=3.0), optimizer=functools.partial(torch.optim.Adam, lr=0.05),
                           loss=dta.PolicyLoss(clip_eps=0.2))
    metrics, online = Metrics(), OnlineRLCallback(print_every_n_steps=0, reward_plot=None)
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=1, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[online, metrics])
    trainer.fit(module, RolloutDataModule(source=source))
    assert len(source.history) == 1  # one generation batch fed the four steps
    assert [h["rl/staleness"] for h in online.history] == [0, 1, 2, 3]
    assert [h["rl/policy_version"] for h in online.history] == [0, 0, 0, 0]
    first, *later = metrics.steps
    assert first["train/clip_fraction"] == 0.0
    assert first["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["train/ratio_std"] < 1e-5
    for step in later:
        assert step["train/clip_fraction"] > 0.0
        assert abs(step["train/ratio_mean"] - 1.0) > 1e-3 and step["train/ratio_std"] > 1e-2


def _online_run(tmp_path, max_steps: int, ckpt=None, save=None) -> dict:
    """Sync, 4 steps per generation batch, AdamW, strategy "dta"."""
    source = OnlineRolloutSource(ReverseDigits(), HFGenerator(max_new_tokens=6), prompts_per_step=2,
                                 samples_per_prompt=4, generation=GenerationBatches(steps_per_generation=4))
    module = dta.DTAModule(tiny_policy(scale=3.0), optimizer=functools.partial(torch.optim.AdamW, lr=0.01),
                           loss=dta.PolicyLoss(clip_eps=0.2))
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path,
                        callbacks=[OnlineRLCallback(print_every_n_steps=0, reward_plot=None)])
    trainer.fit(module, RolloutDataModule(source=source), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


def test_an_online_run_resumed_in_the_middle_of_a_generation_batch_is_bitwise_the_uninterrupted_one(tmp_path):
    """Stopped after step 2 of 4: the resumed run trains steps 3 and 4 of the same generation batch (its rollouts,
    advantages and behaviour log-probs from the checkpoint: the weights that generated them are gone) and ends on
    the uninterrupted run's weights, bit for bit."""
    uninterrupted = _online_run(tmp_path / "a", 4)
    ckpt = tmp_path / "step2.ckpt"
    after_two = _online_run(tmp_path / "b", 2, save=ckpt)
    resumed = _online_run(tmp_path / "c", 4, ckpt=ckpt)
    assert any(not torch.equal(after_two[n], uninterrupted[n]) for n in uninterrupted)
    for name, weight in uninterrupted.items():
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_async_staleness_counts_generation_batches(max_staleness: int) -> None:
    """Async, 2 steps per generation batch: batch i is generated with the weights that start training batch
    i - max_staleness (version 2 (i - max_staleness), 0 before any), the background thread holds at most
    max_staleness batches ahead, and each of a batch's steps is handed out with the batch's version."""
    src = two_turn_source(rollout_mode="async", max_staleness=max_staleness)
    src.attach(tiny_policy())
    try:
        infos = drive(src, steps=6, run_ahead=max_staleness)
        assert src.steps_ahead == max_staleness  # batches waiting: never more than the bound
    finally:
        src.close()
    batches = [step // 2 for step in range(6)]
    assert [i.index for i in infos] == batches and len(src.history) == 3
    assert [i.policy_version for i in infos] == [2 * max(0, b - max_staleness) for b in batches]
    assert [i.trained_version for i in infos] == list(range(6))
    assert [i.staleness for i in infos] == [s - 2 * max(0, b - max_staleness) for s, b in zip(range(6), batches)]
    used = src.generator.versions  # the weights' version at every generate call (batches ahead included)
    assert used == sorted(used) and {i.policy_version for i in infos} <= set(used)
    assert all(version % 2 == 0 for version in used)  # only ever the weights a batch starts training with


def test_decoupled_ppo_takes_the_proximal_logprobs_once_per_generation_batch() -> None:
    """AReaL's recompute before the mini-batches: the proximal log-probs of a generation batch are the weights of its
    first step, for every step of the batch; the next batch gets the weights of its own first step."""
    policy = tiny_policy(scale=2.0)
    src = two_turn_source(rollout_mode="async", max_staleness=1)
    src.attach(policy)
    snapshots, steps = [], []
    try:
        for version in range(4):  # two generation batches of two steps
            snapshots.append(copy.deepcopy(policy))
            steps.append(src.next_step())
            with torch.no_grad():
                for p in policy.parameters():
                    p.mul_(1.1)  # "an optimizer step"
            src.update_policy(policy, version + 1)
    finally:
        src.close()
    for step, weights in zip(steps, (0, 0, 2, 2)):  # each step's batch's first step
        tree = dta.PrefixTree.from_rollouts(step)
        for rollout, logprobs in zip(step, dta.tree_logprobs(snapshots[weights], tree)):
            assert rollout.prox_logprobs == pytest.approx([0.0, *logprobs.tolist()], abs=1e-6)
    # not the step's own weights: step 2 of the batch would have another ratio's anchor
    tree = dta.PrefixTree.from_rollouts(steps[1])
    moved = dta.tree_logprobs(snapshots[1], tree)
    assert max(abs(r.prox_logprobs[t] - float(lp[t - 1])) for r, lp in zip(steps[1], moved)
               for t, m in enumerate(r.loss_mask) if m) > 1e-3


def test_an_async_source_resumed_in_the_middle_of_a_batch_pins_the_next_batch_after_its_remaining_steps() -> None:
    """max_staleness 0, 2 steps per batch, stopped after step 0 (at version 1): the resumed source first hands out
    step 1 of batch 0 from the checkpoint, trained at version 1, and generates batch 1 with the weights after it
    (version 2), fresh as the bound says, not with the weights it was attached with."""
    src = two_turn_source(rollout_mode="async", max_staleness=0)
    src.attach(tiny_policy())
    try:
        src.next_step()
        src.update_policy(src.policy, 1)
        state = src.state_dict()
    finally:
        src.close()
    resumed = two_turn_source(rollout_mode="async", max_staleness=0)
    resumed.load_state_dict(state)
    resumed.attach(tiny_policy(), version=1)
    try:
        infos = drive(resumed, steps=3, start_version=1)
    finally:
        resumed.close()
    assert [(i.index, i.policy_version, i.trained_version) for i in infos] == [(0, 0, 1), (1, 2, 2), (1, 2, 3)]
    assert resumed.generator.versions and set(resumed.generator.versions) <= {2, 4}
