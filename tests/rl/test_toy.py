"""The whole loop on the shipped toy config (configs/toy_rl_cpu.yaml): the reward rises, in sync and async mode.

Both runs are the README command (``lightning-dta fit --config configs/toy_rl_cpu.yaml``) in-process, shortened
to 100 RL steps after the config's 80-step SFT warm start: about 30 s (sync) and 40-50 s (async) on 2 CPU cores.

The margin. Measured with this config (lr 1e-3), 100 steps, seeds 0-6 (``seed_everything`` and the source's and
task's seeds together), mean reward of the first 10 steps -> the last 10 steps (each window averages 640
episodes; the noise of a window mean is about 0.015):

- sync:  +0.19, +0.18, +0.16, +0.16, +0.18, +0.06, +0.15
- async (max_staleness 1, importance_weight_cap 2): +0.19, +0.25, +0.19, +0.21, +0.21, +0.11, +0.16

(Re-measured on 2026-12-01, one thread, after sampling moved to one seeded generator per prompt: a completion no
longer depends on the other prompts of its batch, so every trajectory changed.) The test uses seed 0 (sync
0.624 -> 0.818, async 0.614 -> 0.808) and asserts a rise of ``MARGIN = 0.1``, below 13 of the 14 runs above
(sync seed 5 rises 0.06 in 100 steps).
Why it does not flake: a run is deterministic on a machine - sampling uses its own seeded generator, and the sync
reward sequence is bit-identical with 1 and 2 torch threads and between runs.
In async mode the only timing effect is the version that generates a step (always the previous one here: a
step's generation takes about a fifth of a training step), and the staleness bound is asserted for every step.
"""

from __future__ import annotations

import csv
import importlib.util
import statistics
import sys
from pathlib import Path

import pytest
import torch

from lightning_dta import cli
from lightning_dta.rl import OnlineRLCallback
from tests import helpers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice on workers and logging

REPO = helpers.REPO
STEPS = 100
WINDOW = 10
MARGIN = 0.1
LOGGED = ("rollout/reward_mean", "rollout/reward_std", "rollout/response_tokens_mean", "rollout/compression_ratio",
          "time/generation_sec", "time/train_sec", "time/wait_sec", "rl/logical_tokens_per_sec", "rl/staleness",
          "throughput/logical_tokens_per_sec", "train/compression_ratio", "train/approx_kl", "train/ratio_mean",
          "train/logprob_gap_max", "train/logprob_gap_mean", "train/logprob_gap_kl")


def run_toy(tmp_path: Path, mode: str, *extra: str, config: Path = REPO / "configs" / "toy_rl_cpu.yaml"
            ) -> tuple[list[dict[str, float]], list[dict[str, float]], Path]:
    """Fit the shipped config (or ``config``); return the callback's per-step history, the CSV rows and the log
    directory."""
    args = ["fit", "--config", str(config), f"--trainer.max_steps={STEPS}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_progress_bar=false",
            f"--data.source.init_args.rollout_mode={mode}", *extra]
    argv = sys.argv
    sys.argv = ["lightning-dta"]  # LightningCLI warns when pytest's arguments sit beside args=
    try:
        trainer = cli.cli_main(args).trainer
    finally:
        sys.argv = argv
    (callback,) = [c for c in trainer.callbacks if isinstance(c, OnlineRLCallback)]
    log_dir = Path(trainer.log_dir)
    rows = [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(open(log_dir / "metrics.csv"))]
    rows = sorted((r for r in rows if "rollout/reward_mean" in r), key=lambda r: r["step"])
    return callback.history, rows, log_dir


def rise(history: list[dict[str, float]]) -> tuple[float, float]:
    rewards = [h["rollout/reward_mean"] for h in history]
    return statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The toy model's matrices are tiny: one intra-op thread is as fast as two, the rewards are bit-identical
    either way, and a single thread does not stall in thread barriers when other jobs share the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory, one_torch_thread):
    return run_toy(tmp_path_factory.mktemp("sync"), "sync")


@pytest.mark.slow
def test_toy_rl_reward_rises(sync_run):
    history, rows, log_dir = sync_run
    assert len(history) == len(rows) == STEPS
    first, last = rise(history)
    assert last >= first + MARGIN, f"reward {first:.3f} -> {last:.3f}: no clear rise in {STEPS} steps"
    # on-policy: every step was generated with the weights of the step before it
    assert all(h["rl/staleness"] == 0 and h["rl/policy_version"] == h["step"] for h in history)
    assert max(r["train/approx_kl"] for r in rows) < 1e-5  # behaviour log-probs = the trained policy's
    # the trainer's and the generator's log-probs of each sampled token: float32 rounding (measured: at most 1.6e-5
    # over these 100 steps, 2.7e-5 over 150)
    assert max(r["train/logprob_gap_max"] for r in rows) < 1e-4
    for row in rows:  # logged every step
        assert all(key in row for key in LOGGED), sorted(set(LOGGED) - set(row))
        assert row["rollout/compression_ratio"] > 1.5 and row["rl/logical_tokens_per_sec"] > 0
        assert row["rollout/compression_ratio"] == pytest.approx(row["train/compression_ratio"])
    png = log_dir / "reward.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.long
def test_toy_rl_async_staleness_one_reaches_a_comparable_reward(sync_run, tmp_path):
    """Generation runs one step ahead of training: every step is trained at most 1 optimizer step after the
    weights that generated it, and decoupled PPO (prox log-probs recomputed on the current weights) learns as
    well as the synchronous run (last-window reward within 0.1 of it)."""
    history, rows, _ = run_toy(tmp_path, "async")
    assert len(history) == STEPS
    staleness = [h["rl/staleness"] for h in history]
    assert all(0 <= s <= 1 for s in staleness) and staleness.count(1) >= STEPS // 2  # bounded, and really ahead
    first, last = rise(history)
    assert last >= first + MARGIN, f"async reward {first:.3f} -> {last:.3f}: no clear rise in {STEPS} steps"
    _, sync_last = rise(sync_run[0])
    assert last >= sync_last - 0.1, f"async reaches {last:.3f}, sync {sync_last:.3f}"
    # the loss sees ratio = 1 against prox (this step's weights) and a real behaviour gap (old = stale weights)
    stale_rows = [r for r, s in zip(rows, staleness) if s == 1]
    assert all(r["train/ratio_mean"] == pytest.approx(1.0, abs=1e-4) for r in stale_rows)
    assert statistics.fmean(r["train/approx_kl"] for r in stale_rows) > 1e-4


@pytest.mark.slow
@pytest.mark.long
def test_toy_rl_learns_with_gspo(tmp_path):
    """GSPO (sequence-level ratio, the paper's clip range 3e-4/4e-4, seq-mean-token-mean) on the same task and seed:
    the reward rises by the same margin. Measured 100 steps, seeds 0/1/2: +0.20, +0.16, +0.17."""
    history, _, _ = run_toy(tmp_path, "sync", "--model.loss.loss_mode=gspo", "--model.loss.clip_eps=0.0003",
                            "--model.loss.clip_eps_high=0.0004", "--model.loss.agg=seq-mean-token-mean")
    first, last = rise(history)
    assert last >= first + MARGIN, f"GSPO reward {first:.3f} -> {last:.3f}: no clear rise in {STEPS} steps"


CRITIC = ("{model_type: llama, vocab_size: 16, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
          "num_attention_heads: 4, num_key_value_heads: 4, max_position_embeddings: 64}")


@pytest.mark.slow
@pytest.mark.long
def test_toy_rl_learns_with_ppo_a_critic_and_gae(tmp_path):
    """PPO with a learned baseline: a critic of the policy's shape (zero value head), GAE with gamma = lam = 1
    (advantage = reward - value), the critic trained in the same step. Measured 100 steps, seeds 0/1/2: +0.19,
    +0.14, +0.13; the critic's value MSE falls from 0.18 to 0.03 (seed 0)."""
    history, rows, _ = run_toy(tmp_path, "sync", f"--model.critic.model={CRITIC}",
                               "--data.source.init_args.advantage_estimator=gae")
    first, last = rise(history)
    assert last >= first + MARGIN, f"PPO+GAE reward {first:.3f} -> {last:.3f}: no clear rise in {STEPS} steps"
    mse = [r["critic/value_mse"] for r in rows if "critic/value_mse" in r]
    assert len(mse) == STEPS and statistics.fmean(mse[-WINDOW:]) < statistics.fmean(mse[:WINDOW])  # it learns


# A tiny Qwen3.5 of the toy's size: a Gated DeltaNet layer, then attention.
HYBRID = dict(model_type="qwen3_5_text", vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=4,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=64,
              tie_word_embeddings=False)


@pytest.mark.slow
@pytest.mark.long
def test_toy_rl_learns_with_a_hybrid_policy(tmp_path):
    """The shipped config with a hybrid policy (Qwen3.5's Gated DeltaNet next to attention): HF generation with its
    own recurrent cache, the tree walk handing recurrent states between nodes, the reward rising. The SFT warm start
    is cut to 20 steps (with the config's 80 the hybrid already solves the task: 0.957 -> 0.993), so RL has
    something to learn. Measured, 100 steps (first and last 10 steps): seed 0 0.281 -> 0.868 (compression 2.0x ->
    3.9x), seed 1 0.271 -> 0.847; the test runs seed 0, about 2 minutes on 2 busy cores."""
    import yaml

    config = yaml.safe_load((REPO / "configs" / "toy_rl_cpu.yaml").read_text())
    config["model"]["model"] = HYBRID
    (online,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("OnlineRLCallback")]
    online["init_args"]["sft_warmup_steps"] = 20
    path = tmp_path / "toy_rl_hybrid.yaml"
    path.write_text(yaml.safe_dump(config))
    history, rows, _ = run_toy(tmp_path, "sync", config=path)
    first, last = rise(history)
    assert last >= first + 0.3, f"hybrid reward {first:.3f} -> {last:.3f}: no clear rise in {STEPS} steps"
    assert all(r["rollout/compression_ratio"] > 1.5 for r in rows)  # the tree is shared


@pytest.mark.slow
def test_plain_pytorch_example_is_the_same_loop(sync_run):
    """examples/online_rl.py (no Lightning) with the config's settings and seed gives the same first steps."""
    spec = importlib.util.spec_from_file_location("example_online_rl", REPO / "examples" / "online_rl.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rewards = example.main(steps=3, mode="sync", seed=0, verbose=False)
    assert rewards == pytest.approx([h["rollout/reward_mean"] for h in sync_run[0][:3]], abs=1e-12)
