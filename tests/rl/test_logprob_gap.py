"""The log-prob gap between the trainer and the generator (``lightning_dta/rl/gap.py``), against its definition
(``tests/helpers/reference.py``: each rollout forwarded on its own, float64 log-softmax), and the per-phase times.

- the training step measures the gap on its own forward (no extra pass), in every engine mode, leaving out the
  tokens without behaviour log-probs; its maximum is the largest over the step's chunks;
- with in-process HF generation the gap of every step is float rounding (max below 1e-5; measured: see the test);
- a generator whose log-probs are off, or whose weights are not synced, trips ``max_logprob_gap`` with the numbers,
  which are the definition's; through ``lightning-dta fit`` that is one line and exit 2;
- ``time/weight_sync_sec`` is the hand-over alone (in-process copy or a server's weight sync, not the async wait
  for the generation thread), and ``time/step_sec`` runs until the weights are handed back; an
  ``OpenAICompatibleGenerator``'s log-probs are watched like the in-process generator's.
The 2-rank reduction (the largest, the token-weighted means) is in tests/lightning/test_distributed.py.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback

import lightning_dta as dta
from lightning_dta import cli
from lightning_dta.core.errors import ConfigError
from lightning_dta.lightning.data import RolloutDataModule
from lightning_dta.rl import HFGenerator, OnlineRLCallback, OnlineRolloutSource, ReverseDigits
from lightning_dta.rl.gap import LogprobGap, LogprobGapError
from lightning_dta.rl.generation import Generator
from lightning_dta.rl.server import OpenAICompatibleGenerator
from tests.helpers.lightning import grpo_rollouts, tiny_llama
from tests.helpers.online import small_config
from tests.helpers.reference import reference_logprob_gap
from tests.helpers.rl import (
    PerturbedHFGenerator,
    ScriptedGenerator,
    SlowSyncHFGenerator,
    UnsyncedHFGenerator,
    tiny_policy,
)
from tests.helpers.server import FakeServer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice on workers and logging


def close(logged: LogprobGap, reference: tuple[float, float, float], atol: float) -> bool:
    return all(abs(a - b) <= atol for a, b in zip((logged.max, logged.mean, logged.kl), reference))


@pytest.mark.parametrize("mode", ["dfs", "vanilla", "mask"])
def test_the_training_step_measures_the_gap_of_its_own_forward(mode: str) -> None:
    model, rollouts = tiny_llama(), grpo_rollouts()
    rollouts[0].old_logprobs = None  # no behaviour log-probs: not part of the gap
    out = dta.tree_backward(model, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss(),
                            engine=dta.EngineOptions(mode=mode))
    gap = LogprobGap.from_metrics(out.metrics)
    reference = reference_logprob_gap(model, rollouts)
    assert reference[0] > 1.0  # the rollouts' behaviour log-probs are far from the model's: a real gap
    # float32 engine against the float64 reference: log-probs within ~1e-6
    assert close(gap, reference, atol=1e-5), (gap, reference)


def test_a_step_without_behaviour_logprobs_has_no_gap() -> None:
    rollouts = grpo_rollouts()
    for rollout in rollouts:
        rollout.old_logprobs = None
    out = dta.tree_backward(tiny_llama(), dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss())
    assert LogprobGap.from_metrics(out.metrics) is None


class GapReference(Callback):
    """Before each step: the gap of the step's rollouts from its definition, with the weights the step trains."""

    def __init__(self) -> None:
        self.references: list[tuple[float, float, float]] = []
        self.logged: list[LogprobGap] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.references.append(reference_logprob_gap(pl_module.model, batch.tree.rollouts))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append(LogprobGap.from_metrics(outputs["step"].metrics))


def online_fit(generator: Generator, steps: int, max_logprob_gap: float | None = None,
               **source_options) -> tuple[GapReference, OnlineRLCallback]:
    source = OnlineRolloutSource(ReverseDigits(), generator, prompts_per_step=4, samples_per_prompt=2,
                                 max_logprob_gap=max_logprob_gap, **source_options)
    module = dta.DTAModule(tiny_policy(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    reference, callback = GapReference(), OnlineRLCallback(print_every_n_steps=0, reward_plot=None)
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[reference, callback])
    trainer.fit(module, RolloutDataModule(source=source))
    return reference, callback


def test_hf_generation_is_at_float_rounding_on_every_step() -> None:
    reference, callback = online_fit(HFGenerator(max_new_tokens=6), steps=4, max_logprob_gap=1e-5)
    assert len(reference.logged) == 4
    for logged, definition in zip(reference.logged, reference.references):
        # measured (float32, 2026-12-02): max 2.4e-7 to 4.8e-7 (1 to 2 float32 ulps of a log-prob near -3), mean
        # 9e-8 to 1e-7, KL 0 (exp(r) - 1 - r of r ~ 1e-7 rounds to 0 in float32; the float64 definition: 7e-15)
        assert logged.max < 1e-5, logged
        assert definition[0] < 1e-5, definition  # the generator against the definition, too
    assert [h["logprob_gap_max"] for h in callback.history] == [g.max for g in reference.logged]


def numbers(message: str) -> tuple[float, float, float]:
    found = re.search(r"up to (\S+) from the generator's \(mean (\S+), KL\(generator \|\| trainer\) (\S+) per",
                      message)
    return float(found[1]), float(found[2]), float(found[3])


def test_perturbed_logprobs_trip_the_threshold_with_the_definitions_numbers() -> None:
    with pytest.raises(LogprobGapError) as error:
        online_fit(PerturbedHFGenerator(offset=0.1, max_new_tokens=6), steps=3, max_logprob_gap=1e-3)
    message = str(error.value)
    assert message.startswith("step 0: ") and "max_logprob_gap=0.001" in message and "Fix: " in message
    (definition,) = reference_for_error(error)
    assert definition[0] == pytest.approx(0.2, abs=1e-5)  # offset 0.1 x (position % 3) of 6 tokens at most
    shown = numbers(message)  # 4 significant digits
    assert all(a == pytest.approx(b, rel=1e-3, abs=1e-9) for a, b in zip(shown, definition)), (shown, definition)


def reference_for_error(error: pytest.ExceptionInfo) -> list[tuple[float, float, float]]:
    """The GapReference of the failed run (the traceback's frame of online_fit holds it)."""
    for entry in error.traceback:
        if entry.name == "online_fit":
            return entry.frame.f_locals["reference"].references
    raise AssertionError("online_fit is not in the traceback")


def test_a_generator_whose_weights_are_not_synced_trips_the_threshold_after_the_first_step() -> None:
    """Async with max_staleness 0: the generator's own copy should follow every optimizer step; a sync that does
    nothing passes step 0 (the same weights) and trips the first step whose weights moved past the bound (step 2
    here: a random policy's first groups are mostly all-zero rewards, so step 0 barely moves the weights), with
    the definition's numbers."""
    with pytest.raises(LogprobGapError) as error:
        online_fit(UnsyncedHFGenerator(max_new_tokens=6), steps=6, max_logprob_gap=1e-3, rollout_mode="async",
                   max_staleness=0)
    message = str(error.value)
    references = reference_for_error(error)
    tripped = len(references) - 1
    assert tripped >= 1 and references[0][0] < 1e-5, references  # step 0: the very weights that generated it
    assert all(r[0] <= 1e-3 for r in references[:-1]) and references[-1][0] > 1e-3, references
    assert message.startswith(f"step {tripped}: ") and "Fix: " in message
    shown = numbers(message)
    assert all(a == pytest.approx(b, rel=1e-3, abs=1e-9) for a, b in zip(shown, references[-1]))


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "high"])
def test_a_bad_threshold_is_refused_with_the_fix(value) -> None:
    with pytest.raises(ConfigError, match=r"max_logprob_gap=.*Fix: a number > 0"):
        OnlineRolloutSource(ReverseDigits(), max_logprob_gap=value)


def test_the_threshold_through_the_cli_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-dta"])
    monkeypatch.delenv(cli.TRACEBACK, raising=False)
    status = cli.main(["fit", "--config", str(small_config(tmp_path)), "--trainer.devices=1", "--trainer.max_steps=2",
                       "--trainer.enable_progress_bar=false", "--trainer.logger=false",
                       "--data.source.init_args.max_logprob_gap=1e-3",
                       "--data.source.init_args.generator.class_path=tests.helpers.rl.PerturbedHFGenerator"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    assert err.startswith("lightning-dta fit: error: step 0: the trainer's log-probs of the sampled tokens are up "
                          "to 0.2") and "max_logprob_gap=0.001" in err and "Fix: " in err, err


def test_weight_sync_time_is_the_hand_over_and_the_step_time_includes_it() -> None:
    _, callback = online_fit(SlowSyncHFGenerator(sync_sec=0.3, max_new_tokens=6), steps=2, rollout_mode="async",
                             max_staleness=0)
    for metrics in callback.history:
        assert 0.3 <= metrics["time/weight_sync_sec"] < 0.6, metrics
        parts = metrics["time/wait_sec"] + metrics["time/train_sec"] + metrics["time/weight_sync_sec"]
        assert metrics["time/step_sec"] >= parts, metrics  # asked for the step -> weights handed back


def test_a_servers_phases_are_timed_and_its_logprobs_watched() -> None:
    """OpenAICompatibleGenerator (disaggregated) with a weight sync of 0.2 s: each phase is timed as for the
    in-process generator, and the fake server's made-up log-probs show as the definition's gap."""
    syncs = []

    def weight_sync(model, version):
        time.sleep(0.2)
        syncs.append(version)

    with FakeServer() as server:
        generator = OpenAICompatibleGenerator(server.url, "toy", max_new_tokens=6, weight_sync=weight_sync)
        reference, callback = online_fit(generator, steps=2)
    assert syncs == [0, 1, 2]  # attach, then after each optimizer step
    for metrics in callback.history:
        assert metrics["time/generation_sec"] > 0 and 0.2 <= metrics["time/weight_sync_sec"] < 0.5, metrics
        parts = metrics["time/wait_sec"] + metrics["time/train_sec"] + metrics["time/weight_sync_sec"]
        assert metrics["time/step_sec"] >= parts, metrics
    for logged, definition in zip(reference.logged, reference.references):
        assert definition[0] > 0.1 and close(logged, definition, atol=1e-5), (logged, definition)


def test_async_weight_sync_time_leaves_out_the_wait_for_the_generation_thread() -> None:
    """max_staleness 1: update_policy first waits for the step being generated (1 s here), then hands the weights
    over (0.05 s): the wait is not weight-sync time."""

    class SlowSync(ScriptedGenerator):
        def update_weights(self, policy, version):
            time.sleep(0.05)
            super().update_weights(policy, version)

    source = OnlineRolloutSource(ReverseDigits(), SlowSync([[5, 2]], delay=1.0), prompts_per_step=1,
                                 samples_per_prompt=1, rollout_mode="async", max_staleness=1)
    with source:
        source.attach(tiny_policy())
        source.next_step()
        source.update_policy(source.policy, 1)
    assert 0.05 <= source.last_weight_sync_sec < 0.5, source.last_weight_sync_sec
