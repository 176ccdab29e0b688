"""Generation batches on the file and iterable sources: advantages over the whole batch (against the definition),
splits that keep groups whole (the same on every rank), the shuffled split's cost in compression, refusals, a
resume in the middle of a generation batch (bitwise, strategy "dta"), and a critic's GAE taken once per batch."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import random
import statistics
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_dta as dta
from lightning_dta import Rollout, write_rollouts
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.generation import GenerationBatches
from lightning_dta.lightning.data import RolloutDataModule
from tests import helpers
from tests.helpers.lightning import TINY_LLAMA, tiny_llama
from tests.lightning.test_module import _critic_values, _gae_by_hand, _rewarded_rollouts_and_critic

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice on workers and logging

EPS = 1e-6  # grpo's default


def grouped(groups: int, size: int, seed: int = 0, name: str = "g") -> list[Rollout]:
    """``groups`` groups of ``size`` answers to one prompt each; group g's rewards are on a scale of its own, so a
    std over the whole generation batch differs from a std over one step."""
    rng = random.Random(seed)
    rollouts = []
    for g in range(groups):
        prompt = [rng.randrange(1, 200) for _ in range(6)]
        for _ in range(size):
            answer = [rng.randrange(1, 200) for _ in range(rng.randint(2, 5))]
            rollouts.append(Rollout(input_ids=prompt + answer, loss_mask=[0] * len(prompt) + [1] * len(answer),
                                    reward=round(rng.uniform(0, 1 + 3 * g), 3), group_id=f"{name}{g}"))
    return rollouts


def key(rollout: Rollout) -> tuple:
    return tuple(rollout.input_ids)


def reference_grpo(rollouts: list[Rollout], std_over: str) -> dict[tuple, float]:
    """GRPO from its definition, over ALL of ``rollouts`` (float64): each reward minus its group's mean, over the
    population std of its group (``std_over="group"``) or of the whole batch around the batch's mean (``"step"``,
    TRL's ``scale_rewards="batch"``), plus eps."""
    def pstd(values: list[float]) -> float:
        mean = math.fsum(values) / len(values)
        return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))

    by_group: dict = {}
    for r in rollouts:
        by_group.setdefault(r.group_id, []).append(r.reward)
    batch_std = pstd([r.reward for r in rollouts])
    out = {}
    for r in rollouts:
        rewards = by_group[r.group_id]
        std = pstd(rewards) if std_over == "group" else batch_std
        out[key(r)] = (r.reward - math.fsum(rewards) / len(rewards)) / (std + EPS)
    return out


def step_rollouts(datamodule: RolloutDataModule) -> list[list[Rollout]]:
    return [batch.rollouts for batch in datamodule.train_dataloader()]


@pytest.mark.parametrize("std_over", ["step", "group"])
def test_advantages_are_estimated_over_the_whole_generation_batch(tmp_path: Path, std_over: str) -> None:
    """Two generation batches of 4 steps (8 groups of 4 each): every step's advantages are the definition's over
    its generation batch's 32 rollouts, not over the step's 8."""
    rollouts = grouped(16, 4)
    path = tmp_path / "batches.jsonl"
    write_rollouts(path, rollouts)
    generation = GenerationBatches(steps_per_generation=4)
    dm = RolloutDataModule(path=path, rollouts_per_step=8, advantage_estimator="grpo",
                           advantage_options={"std_over": std_over}, generation=generation)
    steps = step_rollouts(dm)
    assert len(steps) == len(dm.source) == 8 and all(len(step) == 8 for step in steps)
    for number, step in enumerate(steps):
        reference = reference_grpo(rollouts[32 * (number // 4):32 * (number // 4 + 1)], std_over)
        for r in step:
            assert r.advantages == pytest.approx(reference[key(r)], rel=1e-12, abs=1e-12)
    if std_over == "step":  # the test has teeth: a std over one step gives other advantages
        per_step = reference_grpo(rollouts[:8], std_over)
        assert max(abs(per_step[key(r)] - reference_grpo(rollouts[:32], std_over)[key(r)])
                   for r in rollouts[:8]) > 0.1


def test_the_split_keeps_groups_whole_and_is_the_same_on_two_ranks(tmp_path: Path) -> None:
    """Groups of unequal sizes: each step holds whole groups, consecutive, as equal in rollouts as they allow; two
    ranks' shares of every step make up the one-rank step exactly (N ranks = 1 rank)."""
    rollouts = grouped(3, 8, 1, "a") + grouped(2, 4, 2, "b") + grouped(3, 8, 3, "c")  # 8 groups, 56 rollouts
    path = tmp_path / "batch.jsonl"
    write_rollouts(path, rollouts)

    def run(rank: int = 0, world_size: int = 1) -> list[list[Rollout]]:
        return step_rollouts(RolloutDataModule(path=path, advantage_estimator="grpo", rank=rank, world_size=world_size,
                                               generation=GenerationBatches(steps_per_generation=4)))

    one = run()
    assert [len(step) for step in one] == [16, 12, 12, 16]  # cuts at the group boundaries nearest 14, 28, 42
    seen = [r.group_id for step in one for r in step]
    for step in one:
        for group in {r.group_id for r in step}:
            assert sum(r.group_id == group for r in step) == seen.count(group)  # the whole group is here
    assert sorted(map(key, (r for step in one for r in step))) == sorted(map(key, rollouts))
    ranks = [run(rank, 2) for rank in (0, 1)]
    for number, step in enumerate(one):
        shares = ranks[0][number] + ranks[1][number]
        assert sorted(map(key, shares)) == sorted(map(key, step))
        by_key = {key(r): r.advantages for r in step}
        assert all(r.advantages == by_key[key(r)] for r in shares)  # bitwise the one-rank advantages


def test_epochs_repeat_the_split_and_the_iterable_source_splits_its_items_alike() -> None:
    items = [grouped(4, 2, seed=s) for s in range(2)]
    generation = GenerationBatches(steps_per_generation=2, epochs=2)
    dm = RolloutDataModule(source=items, advantage_estimator="grpo", generation=generation)
    steps = [sorted(map(key, step)) for step in step_rollouts(dm)]
    assert len(dm.source) == 8 and len(steps) == 8
    for item in range(2):
        first, second, again, again2 = steps[4 * item:4 * item + 4]
        assert (again, again2) == (first, second)  # the second pass trains the same steps in the same order
        assert sorted(first + second) == sorted(map(key, items[item]))


def test_a_shuffled_split_is_seeded_the_same_on_every_rank_and_costs_compression(tmp_path: Path) -> None:
    rollouts = grouped(8, 4, seed=4)
    path = tmp_path / "batch.jsonl"
    write_rollouts(path, rollouts)

    def run(split: str, seed: int = 0, rank: int = 0, world_size: int = 1) -> list:
        dm = RolloutDataModule(path=path, advantage_estimator="grpo", seed=seed, rank=rank, world_size=world_size,
                               generation=GenerationBatches(steps_per_generation=4, split=split))
        return list(dm.train_dataloader())

    shuffled = run("shuffled")
    groups = run("groups")
    assert [b.step_stats.num_rollouts for b in shuffled] == [8] * 4
    assert any(len({r.group_id for r in b.rollouts}) > 2 for b in shuffled)  # groups are broken up
    on_two = [run("shuffled", 0, rank, 2) for rank in (0, 1)]
    for number, batch in enumerate(shuffled):
        assert sorted(map(key, on_two[0][number].rollouts + on_two[1][number].rollouts)) == \
            sorted(map(key, batch.rollouts))
    assert [sorted(map(key, b.rollouts)) for b in run("shuffled", 1)] != [sorted(map(key, b.rollouts))
                                                                         for b in shuffled]
    # the step metrics' compression ratio (train/compression_ratio) shows what the shuffle costs
    assert statistics.fmean(b.step_stats.compression_ratio for b in shuffled) < \
        statistics.fmean(b.step_stats.compression_ratio for b in groups)


def test_generation_batches_that_cannot_be_split_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    write_rollouts(path, grouped(3, 4))
    with pytest.raises(ConfigError, match=r"3 groups .* steps_per_generation=4 .*Fix: "):
        RolloutDataModule(path=path, advantage_estimator="grpo",
                          generation=GenerationBatches(steps_per_generation=4)).setup()
    with pytest.raises(ConfigError, match=r"12 rollouts cannot be cut into steps_per_generation=5 .*Fix: "):
        RolloutDataModule(path=path, advantage_estimator="grpo",
                          generation=GenerationBatches(steps_per_generation=5, split="shuffled")).setup()
    for bad in (dict(steps_per_generation=0), dict(epochs=1.5), dict(split="random"), dict(steps=2)):
        with pytest.raises(ConfigError, match="Fix: "):
            GenerationBatches.resolve(bad)
    as_mapping = RolloutDataModule(path=path, advantage_estimator="grpo", generation={"steps_per_generation": 3})
    assert as_mapping.source.generation == GenerationBatches(steps_per_generation=3) and len(as_mapping.source) == 3


def test_a_group_across_two_generation_batches_is_refused_naming_the_batch(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    write_rollouts(path, grouped(3, 4))  # batches of 2 x 3 = 6 rollouts cut group g1 in two
    with pytest.raises(dta.RolloutError, match="generation batch 0 .* generation batch 1"):
        RolloutDataModule(path=path, rollouts_per_step=3, advantage_estimator="grpo",
                          generation=GenerationBatches(steps_per_generation=2)).setup()


def test_default_generation_batches_are_todays_steps(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    write_rollouts(path, grouped(6, 4))
    common = dict(path=path, rollouts_per_step=8, advantage_estimator="grpo", shuffle=True, seed=2)
    plain = step_rollouts(RolloutDataModule(**common))
    explicit = step_rollouts(RolloutDataModule(**common, generation=GenerationBatches()))
    assert [[r.to_dict() for r in step] for step in explicit] == [[r.to_dict() for r in step] for step in plain]


def _run(tmp_path: Path, path: Path, max_steps: int, ckpt: Path | None = None, save: Path | None = None) -> dict:
    """AdamW + a warm-up schedule on 2 generation batches of 4 steps, strategy "dta"."""
    torch.manual_seed(0)
    config = {**TINY_LLAMA, "vocab_size": 256, "max_position_embeddings": 512}
    module = dta.DTAModule(config, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           lr_scheduler=functools.partial(torch.optim.lr_scheduler.LinearLR, start_factor=0.1,
                                                          total_iters=4), gradient_clip_val=1.0)
    data = RolloutDataModule(path=path, rollouts_per_step=8, advantage_estimator="grpo",
                             advantage_options={"std_over": "step"}, shuffle=True, seed=3,
                             generation=GenerationBatches(steps_per_generation=4, split="shuffled"))
    fit = L.Trainer(strategy="dta", accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=tmp_path)
    fit.fit(module, data, ckpt_path=ckpt)
    if save is not None:
        fit.save_checkpoint(save)
    assert fit.global_step == max_steps
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


def test_a_run_resumed_in_the_middle_of_a_generation_batch_is_bitwise_the_uninterrupted_one(tmp_path: Path) -> None:
    """Stopped after step 2 of a generation batch of 4 (a shuffled split, a batch-wide std): the resumed run trains
    steps 3 and 4 of the same batch, with the same advantages and split, to the same weights bit for bit."""
    path = tmp_path / "batches.jsonl"
    write_rollouts(path, grouped(16, 4, seed=5))
    uninterrupted = _run(tmp_path / "a", path, 4)
    ckpt = tmp_path / "step2.ckpt"
    after_two = _run(tmp_path / "b", path, 2, save=ckpt)
    resumed = _run(tmp_path / "c", path, 4, ckpt=ckpt)
    assert any(not torch.equal(after_two[n], uninterrupted[n]) for n in uninterrupted)  # steps 3-4 did something
    for name, weight in uninterrupted.items():
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=0, msg=name)


def test_a_checkpoint_of_other_generation_batches_is_refused() -> None:
    dm = RolloutDataModule(path=helpers.REPO / "data" / "tiny_rollouts.jsonl", rollouts_per_step=8)
    state = dm.state_dict()
    other = RolloutDataModule(path=helpers.REPO / "data" / "tiny_rollouts.jsonl", rollouts_per_step=8,
                              generation=GenerationBatches(steps_per_generation=2))
    with pytest.raises(ConfigError, match="generation .*Fix: "):
        other.load_state_dict(state)


class _StepTrees(Callback):
    """Each step's rollouts as the critic estimated them, and a copy of the critic after each step."""

    def __init__(self) -> None:
        self.rollouts: list[list[Rollout]] = []
        self.critics: list[torch.nn.Module] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rollouts.append(list(batch.rollouts))
        self.critics.append(copy.deepcopy(pl_module.critic.model))


def _whitened_by_hand(rollouts: list[Rollout]) -> dict[tuple, list[float]]:
    """verl's masked_whiten over every trained (token, rollout) pair of ``rollouts``: (A - mean) / sqrt(var + 1e-8),
    var the unbiased variance; by rollout tokens."""
    pairs = [a for r in rollouts for t, a in enumerate(r.advantages) if r.loss_mask[t] and t > 0]
    mean = math.fsum(pairs) / len(pairs)
    var = math.fsum((a - mean) ** 2 for a in pairs) / (len(pairs) - 1)
    return {key(r): [(a - mean) / math.sqrt(var + 1e-8) if r.loss_mask[t] and t > 0 else a
                     for t, a in enumerate(r.advantages)] for r in rollouts}


def _gae_run(tmp_path: Path, path: Path, max_steps: int, callbacks=(), ckpt=None, save=None,
             iterable: bool = False) -> dta.DTAModule:
    """A critic (whiten) on generation batches of 2 steps of whole groups from ``path`` (or, ``iterable``, its
    rollouts as one item of an iterable source), SGD for both models."""
    _, critic = _rewarded_rollouts_and_critic()
    module = dta.DTAModule(tiny_llama(), optimizer=functools.partial(torch.optim.SGD, lr=0.5),
                           critic=dta.PPOCritic(critic, optimizer=functools.partial(torch.optim.SGD, lr=0.5),
                                                gamma=0.9, lam=0.8, whiten=True))
    generation = GenerationBatches(steps_per_generation=2)
    data = RolloutDataModule(source=[dta.read_rollouts(path)], advantage_estimator="gae", generation=generation) \
        if iterable else RolloutDataModule(path=path, advantage_estimator="gae", rollouts_per_step=6,  # x 2: all 12
                                           generation=generation)
    fit = L.Trainer(strategy="dta", accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=tmp_path, callbacks=list(callbacks))
    fit.fit(module, data, ckpt_path=ckpt)
    if save is not None:
        fit.save_checkpoint(save)
    return module


@pytest.mark.parametrize("iterable", [False, True], ids=["file", "iterable"])
def test_a_critic_estimates_gae_once_over_the_whole_generation_batch(tmp_path: Path, iterable: bool) -> None:
    """verl's order: the critic's values of the whole generation batch before its first update, GAE per rollout and
    its whitening over the whole batch, then the split. Step 2 trains on those, although the critic was updated by
    step 1: its values, and a whitening over step 2 alone, would give other advantages."""
    rollouts, critic = _rewarded_rollouts_and_critic()  # 3 groups of 4: one generation batch, 2 steps
    path = tmp_path / "gae.jsonl"
    write_rollouts(path, rollouts)
    gae = [_gae_by_hand(dataclasses.replace(r, old_values=_critic_values(critic, r)), 0.9, 0.8) for r in rollouts]
    expected = _whitened_by_hand(gae)
    values = {key(r): r.old_values for r in gae}
    steps = _StepTrees()
    _gae_run(tmp_path, path, 2, callbacks=[steps], iterable=iterable)
    assert [len(step) for step in steps.rollouts] == [4, 8]  # whole groups of 4: 1 and 2 of the batch's 3
    for step in steps.rollouts:
        for r in step:
            assert r.advantages == pytest.approx(expected[key(r)], rel=1e-5, abs=1e-6)
            assert r.old_values == pytest.approx(values[key(r)], rel=1e-5, abs=1e-6)
    # the estimate is not the step's: the critic after step 1 values step 2's rollouts otherwise, and step 2's
    # rollouts whitened alone have other advantages
    second = steps.rollouts[1]
    moved = [_critic_values(steps.critics[0], r) for r in second]
    assert max(abs(a - b) for r, v in zip(second, moved) for a, b in zip(r.old_values, v)) > 1e-3
    alone = _whitened_by_hand([next(g for g in gae if key(g) == key(r)) for r in second])
    assert max(abs(a - b) for r in second for a, b in zip(alone[key(r)], expected[key(r)])) > 1e-2


def test_a_critic_run_resumed_in_the_middle_of_a_generation_batch_is_bitwise_the_uninterrupted_one(tmp_path: Path
                                                                                                    ) -> None:
    """The batch's estimates (made with the critic's weights before step 1) travel in the checkpoint: the resumed
    run's step 2 trains on them, as the uninterrupted run's does, to the same policy and critic bit for bit."""
    rollouts, _ = _rewarded_rollouts_and_critic()
    path = tmp_path / "gae.jsonl"
    write_rollouts(path, rollouts)
    ckpt = tmp_path / "step1.ckpt"
    uninterrupted = _gae_run(tmp_path / "a", path, 2)
    _gae_run(tmp_path / "b", path, 1, save=ckpt)
    resumed = _gae_run(tmp_path / "c", path, 2, ckpt=ckpt)
    for model in ("model", "critic"):
        for (name, weight), again in zip(getattr(uninterrupted, model).named_parameters(),
                                         getattr(resumed, model).parameters()):
            torch.testing.assert_close(again, weight, rtol=0, atol=0, msg=f"{model}.{name}")
