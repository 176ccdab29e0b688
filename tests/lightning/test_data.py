"""RolloutDataModule: sources, chunking, per-rank partition, advantages over whole steps, resume."""

import importlib.util
import random

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_dta import PrefixTree, Rollout, RolloutError, read_rollouts, write_rollouts
from lightning_dta.core.advantages import grpo_advantages
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.errors import ConfigError
from lightning_dta.lightning.data import RolloutDataModule, make_step_batch
from tests import helpers

REPO = helpers.REPO
TINY = REPO / "data" / "tiny_rollouts.jsonl"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice on workers and logging


def random_rollouts(n, seed=0, prompt=None, group_id=None):
    rng = random.Random(seed)
    prompt = prompt if prompt is not None else []
    return [Rollout(input_ids=prompt + [rng.randrange(256) for _ in range(rng.randint(3, 12))],
                    reward=round(rng.random(), 2), group_id=group_id) for _ in range(n)]


def ids(rollouts):
    return sorted(tuple(r.input_ids) for r in rollouts)


def signature(batch):
    """What identifies a step, the same on every rank."""
    return (batch.step_stats.logical_tokens, batch.step_stats.tree_tokens, batch.step_stats.num_rollouts)


def batches(datamodule):
    return list(datamodule.train_dataloader())


def test_file_source_one_step_per_chunk_and_union_is_the_file():
    dm = RolloutDataModule(path=TINY, rollouts_per_step=16)
    loader = dm.train_dataloader()
    assert len(loader) == 4
    got = list(loader)
    assert all(isinstance(b, StepBatch) and b.rank == 0 and b.world_size == 1 for b in got)
    file = read_rollouts(TINY)
    for k, batch in enumerate(got):
        assert batch.rollouts == file[16 * k:16 * (k + 1)]  # one rank: the whole step, in file order
        assert batch.step_stats == PrefixTree.from_rollouts(file[16 * k:16 * (k + 1)]).stats


def test_last_partial_chunk_is_a_smaller_step(tmp_path):
    path = tmp_path / "ten.jsonl"
    write_rollouts(path, random_rollouts(10))
    dm = RolloutDataModule(path=path, rollouts_per_step=4)
    assert [b.step_stats.num_rollouts for b in batches(dm)] == [4, 4, 2]
    assert len(dm.train_dataloader()) == 3
    assert [b.step_stats.num_rollouts for b in batches(RolloutDataModule(path=path))] == [10]
    capped = RolloutDataModule(path=path, rollouts_per_step=4, max_steps_per_epoch=2)
    assert len(capped.train_dataloader()) == 2 and len(batches(capped)) == 2


def test_generator_source_yields_one_batch_per_step():
    steps = [random_rollouts(5, seed=s) for s in range(3)]
    dm = RolloutDataModule(source=lambda: (list(step) for step in steps))  # a fresh generator each epoch
    for _ in range(2):  # two epochs
        got = batches(dm)
        assert [b.rollouts for b in got] == steps
    with pytest.raises(TypeError):
        len(dm.train_dataloader())  # unknown in advance


def test_one_shot_generator_serves_one_epoch_then_says_why():
    dm = RolloutDataModule(source=(random_rollouts(3, seed=s) for s in range(2)))
    assert len(batches(dm)) == 2
    with pytest.raises(RuntimeError, match="read only once"):
        batches(dm)


def test_source_steps_are_validated_with_the_step_and_rollout_named():
    bad = random_rollouts(3, seed=1)
    bad[2] = Rollout(input_ids=[4, 300, 5])
    dm = RolloutDataModule(source=[random_rollouts(3), bad], vocab_size=256)
    with pytest.raises(RolloutError, match=r"step 1 of the source .*rollout index 2, field 'input_ids'.*300") as info:
        batches(dm)
    assert info.value.index == 2 and info.value.field == "input_ids"
    with pytest.raises(TypeError, match="one sequence of rollouts per step"):
        batches(RolloutDataModule(source=random_rollouts(3)))  # a flat stream is not a stream of steps
    with pytest.raises(RolloutError, match=rf"^\d+ faulty rollouts in {TINY}:\n  {TINY}:1: rollout index 0, field "
                                           "'input_ids': token \\d+ is \\d+, outside the vocabulary \\[0, 100\\)"):
        RolloutDataModule(path=TINY, vocab_size=100).setup()


def test_model_limits_check_the_whole_file_with_its_lines(tmp_path):
    rollouts = random_rollouts(6)
    for rollout in rollouts:
        rollout.input_ids = [token % 100 for token in rollout.input_ids]
    rollouts[1].input_ids[2] = rollouts[4].input_ids[0] = 200
    path = tmp_path / "vocab.jsonl"
    write_rollouts(path, rollouts)
    dm = RolloutDataModule(path=path, rollouts_per_step=3)
    dm.setup()  # the vocabulary is known once the model is
    with pytest.raises(RolloutError, match=rf"^2 faulty rollouts in {path}:\n  {path}:2: rollout index 1, field "
                                           rf"'input_ids': token 2 is 200, outside the vocabulary \[0, 128\).*\n  "
                                           rf"{path}:5: rollout index 4"):
        dm.connect_model(LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=8, intermediate_size=8,
                                                      num_hidden_layers=1, num_attention_heads=2)))


def test_a_file_that_trains_on_less_than_it_seems_is_warned_about(tmp_path):
    rollouts = random_rollouts(7)
    for rollout in rollouts:
        rollout.advantages = 0.0
    rollouts[3].loss_mask = [0] * len(rollouts[3].input_ids)
    path = tmp_path / "flat.jsonl"
    write_rollouts(path, rollouts)
    with pytest.warns(UserWarning) as record:
        RolloutDataModule(path=path, rollouts_per_step=3).setup()
    messages = [str(w.message) for w in record]
    assert any("1 of 7 rollouts" in m and "train no token" in m for m in messages), messages
    assert any("last step" in m and "has 1 rollouts, not rollouts_per_step=3" in m for m in messages), messages
    assert any("3 of 3 steps" in m and "every advantage 0 (no advantage_estimator is set)" in m
               and "Fix: set advantage_estimator" in m for m in messages), messages
    # attributed to the rollout file and the first line concerned, not to the code that read it
    assert {(w.filename, w.lineno) for w in record} == {(str(path), 4), (str(path), 7), (str(path), 1)}


def test_a_group_of_one_is_warned_about_as_such(tmp_path):
    rollouts = [*random_rollouts(3, seed=1, group_id="a"), *random_rollouts(1, seed=2, group_id="alone")]
    path = tmp_path / "alone.jsonl"
    write_rollouts(path, rollouts)
    with pytest.warns(UserWarning) as record:
        RolloutDataModule(path=path, advantage_estimator="grpo").setup()
    (alone,) = [w for w in record if "single rollout" in str(w.message)]
    assert "1 group(s)" in str(alone.message) and "'alone'" in str(alone.message)
    assert "Fix: several rollouts per group_id" in str(alone.message)
    assert (alone.filename, alone.lineno) == (str(path), 4)
    assert not any("set advantage_estimator" in str(w.message) for w in record)  # it is set


def test_a_step_with_only_groups_of_one_says_the_estimator_gave_zeros(tmp_path):
    path = tmp_path / "singles.jsonl"
    write_rollouts(path, [r for g in range(3) for r in random_rollouts(1, seed=g, group_id=g)])
    with pytest.warns(UserWarning) as record:
        RolloutDataModule(path=path, advantage_estimator="grpo").setup()
    (flat,) = [str(w.message) for w in record if "every advantage 0" in str(w.message)]
    assert "after advantage_estimator='grpo'" in flat and "Fix: groups of several rollouts" in flat, flat


def test_a_missing_or_directory_path_is_refused_when_the_module_is_built(tmp_path):
    with pytest.raises(ConfigError, match="data.path='.*missing.jsonl' does not exist. Fix: "):
        RolloutDataModule(path=tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="is a directory"):
        RolloutDataModule(path=tmp_path)


def test_the_cost_model_is_not_calibrated_unless_asked():
    """Calibrated, the split follows measured times, so runs agree to about 1e-7, not bitwise (docs/lightning.md)."""
    assert RolloutDataModule(path=TINY).calibrator is None
    assert RolloutDataModule(path=TINY, calibrate_cost_model=True).calibrator is not None


def test_missing_rewards_are_reported_with_their_step(tmp_path):
    rollouts = random_rollouts(8)
    rollouts[5].reward = None
    path = tmp_path / "rewards.jsonl"
    write_rollouts(path, rollouts)
    with pytest.raises(RolloutError, match=rf"^{path}:6: rollout index 5, field 'reward': is missing.*\(step 1\)"):
        RolloutDataModule(path=path, rollouts_per_step=4, advantage_estimator="reinforce-baseline").setup()
    dm = RolloutDataModule(source=[rollouts[:4], rollouts[4:]], advantage_estimator="reinforce-baseline")
    with pytest.raises(RolloutError, match=r"step 1 of the source \(epoch 0\): rollout index 1, field 'reward'"):
        batches(dm)


def test_two_ranks_get_disjoint_shares_whose_union_is_the_step():
    common = dict(path=TINY, rollouts_per_step=32, advantage_estimator="grpo", world_size=2)
    rank0, rank1 = batches(RolloutDataModule(rank=0, **common)), batches(RolloutDataModule(rank=1, **common))
    file = grpo_advantages(read_rollouts(TINY)[:32]) + grpo_advantages(read_rollouts(TINY)[32:])
    for k, (a, b) in enumerate(zip(rank0, rank1)):
        assert a.rollouts and b.rollouts
        assert not set(ids(a.rollouts)) & set(ids(b.rollouts))
        assert ids(a.rollouts + b.rollouts) == ids(file[32 * k:32 * (k + 1)])
        assert a.step_stats == b.step_stats and a.rank_costs == b.rank_costs
        assert a.partition_logical_tokens == b.partition_logical_tokens
        for batch in (a, b):
            assert batch.partition_tree_tokens[batch.rank] == batch.tree.stats.tree_tokens
            assert batch.partition_logical_tokens[batch.rank] == batch.tree.stats.logical_tokens
        assert a.imbalance < 1.2, a.rank_costs


@pytest.mark.parametrize("method", ["contiguous", "greedy"])
def test_a_rank_without_rollouts_gets_no_tree(method):
    step = random_rollouts(2, seed=3)
    got = [make_step_batch(step, rank, 3, partition_method=method) for rank in range(3)]
    empty = [b for b in got if b.tree is None]
    assert len(empty) >= 1 and all(b.rollouts == [] for b in empty)
    assert all(b.step_stats.num_rollouts == 2 for b in got)  # every rank still knows the whole step
    assert ids([r for b in got for r in b.rollouts]) == ids(step)
    dm = RolloutDataModule(source=[step], rank=2, world_size=3)
    assert batches(dm)[0].tree is None


def test_grpo_is_computed_over_the_whole_group_even_when_it_is_split_across_ranks():
    prompt = list(range(10, 60))
    step = [Rollout(input_ids=prompt + response, reward=reward, group_id="q") for response, reward in
            [([1, 2, 3], 1.0), ([2, 3, 4], 0.0), ([3, 4, 5], 0.5), ([4, 5, 6], 0.2)]]
    shares = [batches(RolloutDataModule(source=[step], advantage_estimator="grpo", rank=rank, world_size=2))[0]
              for rank in (0, 1)]
    assert all(len(b.rollouts) == 2 for b in shares)  # one tree, cut in two
    expected = {tuple(r.input_ids): r.advantages for r in grpo_advantages(step)}
    halves = {}
    for batch in shares:
        for r in batch.rollouts:
            assert r.advantages == pytest.approx(expected[tuple(r.input_ids)], rel=1e-12)
        halves.update({tuple(r.input_ids): r.advantages for r in grpo_advantages(batch.rollouts)})
    assert halves != pytest.approx(expected)  # normalising per rank would have given other values
    assert all(r.advantages == 0.0 for r in step)  # the input rollouts are untouched


def test_a_group_split_between_steps_is_refused(tmp_path):
    path = tmp_path / "groups.jsonl"
    write_rollouts(path, [r for g in range(4) for r in random_rollouts(3, seed=g, group_id=g)])
    with pytest.raises(RolloutError, match=rf"^{path}:5: rollout index 4, field 'group_id': group 1 is in step 0 \(its "
                                           rf"first rollout, {path}:4\) and in step 1"):
        RolloutDataModule(path=path, rollouts_per_step=4, advantage_estimator="grpo").setup()
    assert len(batches(RolloutDataModule(path=path, rollouts_per_step=4))) == 3  # own advantages: no problem
    assert len(batches(RolloutDataModule(path=path, rollouts_per_step=6, advantage_estimator="grpo"))) == 2


def test_a_group_whose_lines_are_apart_is_refused_when_they_fall_in_two_steps(tmp_path):
    """Two lines swapped across the step cut: before, each moved rollout was a group of one (advantage 0) and the
    rest was normalised over 3 instead of 4, without a word. Within one step the lines may be anywhere."""
    groups = [random_rollouts(4, seed=g, group_id=g) for g in range(4)]
    swapped = [r for group in groups for r in group]
    swapped[3], swapped[4] = swapped[4], swapped[3]
    path = tmp_path / "swapped.jsonl"
    write_rollouts(path, swapped)
    with pytest.raises(RolloutError, match=rf"^{path}:5: rollout index 4, field 'group_id': group 0 is in step 0 \(its "
                                           rf"first rollout, {path}:1\) and in step 1"):
        RolloutDataModule(path=path, rollouts_per_step=4, advantage_estimator="grpo").setup()
    interleaved = [groups[g % 2][g // 2] for g in range(8)] + [r for group in groups[2:] for r in group]
    write_rollouts(path, interleaved)  # groups 0 and 1 alternate within step 0: whole, so accepted
    first = batches(RolloutDataModule(path=path, rollouts_per_step=8, advantage_estimator="grpo"))[0]
    want = {tuple(r.input_ids): r.advantages for r in grpo_advantages(groups[0] + groups[1])}
    assert {tuple(r.input_ids): r.advantages for r in first.rollouts} == want


def test_shuffle_is_seeded_identical_on_every_rank_and_new_each_epoch(tmp_path):
    path = tmp_path / "steps.jsonl"
    write_rollouts(path, random_rollouts(24, seed=9))

    def epochs(seed, rank, count=2):
        dm = RolloutDataModule(path=path, rollouts_per_step=2, shuffle=True, seed=seed, rank=rank, world_size=2)
        return [[signature(b) for b in batches(dm)] for _ in range(count)]

    rank0, rank1 = epochs(7, 0), epochs(7, 1)
    assert rank0 == rank1 == epochs(7, 0)
    plain = [signature(b) for b in batches(RolloutDataModule(path=path, rollouts_per_step=2))]
    assert sorted(rank0[0]) == sorted(plain) and rank0[0] != plain
    assert rank0[0] != rank0[1] and epochs(8, 0)[0] != rank0[0]


def test_state_dict_resumes_at_the_next_step():
    common = dict(path=TINY, rollouts_per_step=8, shuffle=True, seed=3)
    reference = [signature(b) for b in batches(RolloutDataModule(**common))]
    dm = RolloutDataModule(**common)
    iterator = iter(dm.train_dataloader())
    trained = [signature(next(iterator)) for _ in range(3)]
    state = dm.state_dict()
    assert state["epoch"] == 0 and state["trained_steps"] == 3
    resumed = RolloutDataModule(**common)
    resumed.load_state_dict(state)
    assert trained + [signature(b) for b in batches(resumed)] == reference
    finished = resumed.state_dict()  # at the end of epoch 0: the next pass is epoch 1, in its own order
    assert finished["epoch_finished"]
    again = RolloutDataModule(**common)
    again.load_state_dict(finished)
    next_epoch = [signature(b) for b in batches(again)]
    assert again.state_dict()["epoch"] == 1 and sorted(next_epoch) == sorted(reference) and next_epoch != reference


class RecordingModule(L.LightningModule):
    """Manual optimisation like the DFS module; records which step each optimizer step trained."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        assert isinstance(batch, StepBatch) and batch.tree is not None
        self.seen.append(signature(batch))
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward((self.weight * float(batch.step_stats.tree_tokens)).sum())
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(datamodule, max_steps, tmp_path, ckpt_path=None):
    module = RecordingModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return module.seen


@pytest.mark.parametrize("kind", ["file", "callable"])
def test_trainer_resume_continues_with_the_next_step(tmp_path, kind):
    """Checkpoints mid-epoch and at an epoch's end resume at the right step (also with Lightning's prefetch)."""
    if kind == "file":
        def make():
            return RolloutDataModule(path=TINY, rollouts_per_step=16, shuffle=True, seed=5)
    else:
        steps = [random_rollouts(4, seed=s) for s in range(4)]

        def make():
            return RolloutDataModule(source=lambda: iter(steps))
    standalone = make()
    reference = [signature(b) for _ in range(3) for b in batches(standalone)]  # three epochs, uninterrupted
    assert len(set(reference[:4])) == 4  # the signature tells the steps apart
    assert fit(make(), 5, tmp_path) == reference[:5]
    assert fit(make(), 7, tmp_path, ckpt_path=tmp_path / "epoch=0-step=2.ckpt") == reference[2:7]  # mid-epoch
    assert fit(make(), 7, tmp_path, ckpt_path=tmp_path / "epoch=0-step=4.ckpt") == reference[4:7]  # epoch's end


def test_step_batch_stays_on_the_host_through_the_transfer_hook():
    dm = RolloutDataModule(path=TINY, rollouts_per_step=16)
    batch = batches(dm)[0]
    assert dm.transfer_batch_to_device(batch, torch.device("cpu"), 0) is batch


def test_step_batch_survives_precision_input_conversion():
    from lightning.pytorch.plugins.precision import DoublePrecision

    batch = batches(RolloutDataModule(path=TINY, rollouts_per_step=16))[0]
    converted = DoublePrecision().convert_input(batch)
    assert converted.tree is batch.tree


def test_trainer_rank_and_explicit_overrides():
    assert (RolloutDataModule(path=TINY).rank, RolloutDataModule(path=TINY).world_size) == (0, 1)
    dm = RolloutDataModule(path=TINY, rank=1, world_size=4)
    assert (dm.rank, dm.world_size) == (1, 4)
    with pytest.raises(ValueError, match="exactly one"):
        RolloutDataModule()
    with pytest.raises(ValueError, match="rollouts_per_step"):
        RolloutDataModule(source=[], rollouts_per_step=4)
    with pytest.raises(ValueError, match="unknown"):
        RolloutDataModule(path=TINY, advantage_estimator="vtrace")


def load_script():
    spec = importlib.util.spec_from_file_location("make_tiny_rollouts", REPO / "scripts" / "make_tiny_rollouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_rollouts_file_is_reproducible_and_fits_the_tiny_model(tmp_path):
    script = load_script()
    script.main(["--output", str(tmp_path / "again.jsonl")])
    assert (tmp_path / "again.jsonl").read_bytes() == TINY.read_bytes()
    assert TINY.stat().st_size < 300_000
    rollouts = read_rollouts(TINY)
    stats = PrefixTree.from_rollouts(rollouts, vocab_size=256, max_positions=512).stats
    assert stats.logical_tokens <= 15_000 and stats.compression_ratio > 2.0
    assert all(0.0 <= r.reward <= 1.0 and max(r.old_logprobs) <= 0.0 and r.group_id is not None for r in rollouts)
    assert all(r.loss_mask[0] == 0 and r.loss_mask[-1] == 1 for r in rollouts)
    prefixes = sum(any(o is not r and o.input_ids[:len(r)] == r.input_ids for o in rollouts) for r in rollouts)
    assert prefixes >= 4  # agent calls that end inside a later call's path
    for size in (8, 16, 32, 64):  # no step size that divides the file splits a group
        RolloutDataModule(path=TINY, rollouts_per_step=size, advantage_estimator="grpo").setup()
