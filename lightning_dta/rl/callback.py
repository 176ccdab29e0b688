"""``OnlineRLCallback``: the Lightning glue of the online RL loop.

The loop is: the data module asks the :class:`~lightning_dta.rl.source.OnlineRolloutSource` for a step (it
generates or takes one from its background thread, scores it, estimates advantages), the module trains it with
one DFS step, then this callback refreshes the generator's weights and bumps the policy version
(``update_policy``) and logs what the step was made of. It also connects the source to the policy when
training starts (after an optional SFT warm start), closes it when training ends or fails, and saves the reward
curve as a PNG.

A callback rather than a ``DTAModule`` method: it keeps ``DTAModule`` a plain trainer of rollout trees (used
unchanged with rollout files), and Lightning calls ``on_train_batch_end`` after the optimizer step, exactly when
the weights of the next generation are final.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_dta.contracts import parallel_layout
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.losses import PolicyLoss
from lightning_dta.distributed.collectives import all_gather_floats, broadcast_module
from lightning_dta.distributed.sharding import is_sharded
from lightning_dta.distributed.step import StepOutput
from lightning_dta.lightning.data import RolloutDataModule
from lightning_dta.rl.gap import LogprobGap, check_logprob_gap
from lightning_dta.rl.plot import save_reward_plot
from lightning_dta.rl.source import OnlineRolloutSource, StepInfo
from lightning_dta.rl.warmup import WarmStartResult, sft_warm_start


class OnlineRLCallback(Callback):
    """Attach the online rollout source to the policy, refresh its weights after every optimizer step, log.

    Logged every step (``on_step``): ``rollout/reward_mean``, ``rollout/reward_std``, ``rollout/accuracy`` (when
    the environment reports ``correct``), ``rollout/response_tokens_mean`` (generated tokens per episode),
    ``rollout/calls_per_episode``, ``rollout/compression_ratio`` (logical / tree tokens of the step's whole tree),
    ``time/generation_sec``, ``time/wait_sec`` (the trainer waiting for the step), ``time/prepare_sec``
    (advantages, prox/ref log-probs), ``time/train_sec``, ``time/weight_sync_sec`` (the refresh after the optimizer
    step: the generator's copy or the server's weight sync, without an async wait for the generation thread),
    ``time/step_sec`` (end to end: from asking for the step to the weights handed back) - each the slowest rank's,
    with ``time/generation_sec_mean`` and
    ``rl/slowest_generation_rank`` / ``rl/slowest_train_rank`` beside them,
    ``rl/logical_tokens_per_sec`` (end to end), ``rl/policy_version`` and ``rl/staleness``. The progress bar shows
    ``reward``. With several steps per generation batch (the source's ``generation``) the ``rollout/*`` metrics,
    the generation time and ``rl/policy_version`` describe the step's generation batch (``rl/staleness`` counts the
    optimizer steps since it was generated: 0, 1, 2, ... over its steps); the step's own tree (its
    compression), PPO's ``train/clip_fraction``, ``train/ratio_mean`` and ``train/ratio_std`` are the training
    module's ``train/*``, as is the log-prob gap (``train/logprob_gap_max``, ``_mean``, ``_kl``:
    :mod:`lightning_dta.rl.gap`), which this callback checks against the source's ``max_logprob_gap`` after each
    step trained with the weights that generated it, stopping the run with the numbers when it is exceeded.

    Args:
        sft_warmup_steps: supervised steps on the environment's demonstrations before RL (0 = none); skipped
            when training resumes from a checkpoint.
        sft_warmup_lr, sft_warmup_batch_size: the warm start's AdamW learning rate and demonstrations per step.
        print_every_n_steps: print a one-line summary every this many steps (0 = never).
        reward_plot: save the reward curve to this PNG when training ends; a relative path is relative to the
            run's log directory (``trainer.log_dir``, e.g. ``runs/toy_rl_cpu/version_0``, beside ``metrics.csv``), so
            runs do not overwrite each other's plots. ``None``: no plot.
        policy_attr: the LightningModule attribute holding the causal LM (``DTAModule.model``).
    """

    def __init__(self, sft_warmup_steps: int = 0, sft_warmup_lr: float = 3e-3, sft_warmup_batch_size: int = 32,
                 print_every_n_steps: int = 10, reward_plot: str | None = "reward.png",
                 policy_attr: str = "model") -> None:
        if sft_warmup_steps < 0 or print_every_n_steps < 0:
            raise ConfigError("sft_warmup_steps and print_every_n_steps must be >= 0")
        self.sft_warmup_steps, self.sft_warmup_lr = sft_warmup_steps, sft_warmup_lr
        self.sft_warmup_batch_size = sft_warmup_batch_size
        self.print_every_n_steps = print_every_n_steps
        self.reward_plot = reward_plot
        self.policy_attr = policy_attr
        self.source: OnlineRolloutSource | None = None
        self.history: list[dict[str, float]] = []  # the logged metrics of every step, with "step"
        self.warm_start: WarmStartResult | None = None
        self._batch_start: float | None = None
        self._version = 0  # the policy version handed to the source: trained batches so far

    # ------------------------------------------------------------------ set-up checks

    def _policy(self, pl_module: LightningModule) -> nn.Module:
        policy = getattr(pl_module, self.policy_attr, None)
        if not isinstance(policy, nn.Module):
            raise TypeError(f"OnlineRLCallback: {type(pl_module).__name__}.{self.policy_attr} is not the causal LM "
                            f"(got {type(policy).__name__}); set policy_attr to the attribute that holds it")
        return policy

    @staticmethod
    def _find_source(trainer: Trainer, pl_module: LightningModule) -> OnlineRolloutSource:
        datamodule = trainer.datamodule
        source = datamodule.source if isinstance(datamodule, RolloutDataModule) else None
        if not isinstance(source, OnlineRolloutSource):
            raise TypeError("OnlineRLCallback needs a RolloutDataModule whose source is an OnlineRolloutSource: "
                            "trainer.fit(module, datamodule=RolloutDataModule(source=OnlineRolloutSource(...))); got "
                            f"{type(datamodule).__name__} with source {type(source).__name__}")
        loss_fn = getattr(pl_module, "loss_fn", None)  # a user's module: DTAModule's loss, if it has one
        if isinstance(loss_fn, PolicyLoss) and loss_fn.kl_coef > 0 and not source.ref_logprobs:
            raise ConfigError(f"kl_coef={loss_fn.kl_coef} but the rollouts carry no reference log-probs, so the KL "
                             "term would be silently zero. Fix: OnlineRolloutSource(ref_logprobs=True), or kl_coef=0")
        return source

    # ------------------------------------------------------------------ hooks

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        source = self._find_source(trainer, pl_module)
        policy = self._policy(pl_module)
        engine = getattr(pl_module, "engine", None)  # a user's module: DTAModule's EngineOptions, if it has them
        source.generator.check(policy)  # a misconfigured server is refused now, not after the warm start
        if self.sft_warmup_steps and trainer.global_step == 0:
            self.warm_start = sft_warm_start(policy, source.env, source.resolve_tokenizer(), self.sft_warmup_steps,
                                             lr=self.sft_warmup_lr, batch_size=self.sft_warmup_batch_size,
                                             add_bos=source.add_bos, engine=engine,
                                             layout=parallel_layout(trainer.strategy))
            if not is_sharded(policy):
                broadcast_module(policy)  # every rank ran the same warm start; rank 0's weights are the run's
            self._print(trainer, f"SFT warm start: {self.warm_start.steps} steps in {self.warm_start.seconds:.1f}s, "
                                 f"demonstration NLL {self.warm_start.nll_before:.3f} -> "
                                 f"{self.warm_start.nll_after:.3f} per token")
        source.attach(policy, version=trainer.global_step, engine=engine, layout=parallel_layout(trainer.strategy))
        self._version = trainer.global_step
        self.source = source

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.source is None or self._batch_start is None:
            return
        train_sec = time.perf_counter() - self._batch_start
        # The version counts trained batches: a skipped (non-finite) step advances it with unchanged weights, so
        # the async producer's pinned versions keep pace with the steps (global_step would stall and deadlock it).
        self._version = max(self._version + 1, trainer.global_step)
        self.source.update_policy(self._policy(pl_module), self._version)
        info = self.source.last_step
        if info is None:
            raise RuntimeError("a step was trained but the rollout source handed none out")
        handed = self.source.last_step_logical_tokens
        if isinstance(batch, StepBatch) and batch.step_stats.logical_tokens != handed:
            raise RuntimeError(f"the trained step has {batch.step_stats.logical_tokens} logical tokens but the "
                               f"source's last step has {handed}: the metrics would describe another "
                               "step (was a step prefetched?)")
        step_sec = time.perf_counter() - info.requested_at  # end to end: asked for the step -> weights handed back
        metrics = self._metrics(info, train_sec, step_sec, self.source.last_weight_sync_sec,
                                trainer.strategy.root_device)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("reward", info.reward_mean, prog_bar=True, logger=False, on_step=True, on_epoch=False,
                      batch_size=1)
        step = trainer.global_step - 1  # the step just trained, numbered as in metrics.csv (from 0)
        gap = self._logprob_gap(outputs)
        self.history.append({"step": float(step), "reward_min": min(info.rewards), "reward_max": max(info.rewards),
                             **metrics, **({} if gap is None else {"logprob_gap_max": gap.max})})
        if self.print_every_n_steps and (step + 1) % self.print_every_n_steps == 0:
            self._print(trainer, self._line(step, metrics, gap))
        if gap is not None:  # every rank holds the step-wide gap: every rank stops alike
            check_logprob_gap(gap, self.source.max_logprob_gap, step, info.staleness)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()
        if not self.history:
            return
        window = min(10, len(self.history))
        first = statistics.fmean(h["rollout/reward_mean"] for h in self.history[:window])
        last = statistics.fmean(h["rollout/reward_mean"] for h in self.history[-window:])
        message = (f"reward: first {window} steps {first:.3f} -> last {window} steps {last:.3f} "
                   f"({len(self.history)} steps)")
        log_dir = trainer.log_dir  # a collective (a broadcast from rank 0): every rank asks
        if self.reward_plot and trainer.is_global_zero:
            try:
                path = Path(log_dir or ".") / self.reward_plot  # an absolute reward_plot stays as is
                save_reward_plot([int(h["step"]) for h in self.history],
                                 [h["rollout/reward_mean"] for h in self.history],
                                 [h["rollout/reward_std"] for h in self.history], path,
                                 bounds=([h["reward_min"] for h in self.history],
                                         [h["reward_max"] for h in self.history]))
                message += f"; reward plot: {path}"
            except ImportError as error:
                rank_zero_warn(f"the reward plot was not saved: {error}")
        self._print(trainer, message)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    # ------------------------------------------------------------------ helpers

    def _close(self) -> None:
        if self.source is not None:
            self.source.close()
            if self.source.discarded_steps:
                rank_zero_info(f"{self.source.discarded_steps} step(s) generated ahead by the background thread "
                               "were not trained (training ended first)")
            self.source = None

    def _logprob_gap(self, outputs: Any) -> LogprobGap | None:
        """The trained step's log-prob gap, from the :class:`StepOutput` the training step returns under ``"step"``
        (``DTAModule`` does); a bound without it is refused rather than never checked."""
        out = outputs.get("step") if isinstance(outputs, Mapping) else None
        if not isinstance(out, StepOutput):
            if self.source is not None and self.source.max_logprob_gap is not None:
                raise ConfigError(f"max_logprob_gap={self.source.max_logprob_gap} is set, but the training step "
                                  "returned no StepOutput to read the log-prob gap from. Fix: return {'loss': ..., "
                                  "'step': out} from training_step, out being dfs_training_step's result (DTAModule "
                                  "does), or max_logprob_gap: null")
            return None
        return None if out.skipped else LogprobGap.from_metrics(out.metrics)

    @staticmethod
    def _metrics(info: StepInfo, train_sec: float, step_sec: float, weight_sync_sec: float,
                 device: torch.device) -> dict[str, float]:
        """The step's metrics, the same on every rank: the step's content is every rank's, and the times are the
        slowest rank's (one all-gather; ``*_mean`` is the mean over ranks, ``slowest_*_rank`` which rank)."""
        episodes = len(info.rewards)
        per_rank = [info.generation_sec, info.prepare_sec, train_sec, weight_sync_sec, step_sec]
        ranks = all_gather_floats(per_rank, device)  # every rank calls this hook: no hang
        slowest = [max(r[i] for r in ranks) for i in range(len(per_rank))]
        generation_sec, prepare_sec, train_sec, weight_sync_sec, step_sec = slowest
        metrics = {
            "rollout/reward_mean": info.reward_mean,
            "rollout/reward_std": info.reward_std,
            "rollout/response_tokens_mean": statistics.fmean(info.response_tokens),
            "rollout/calls_per_episode": info.calls / episodes,
            "rollout/compression_ratio": info.compression_ratio,
            "time/generation_sec": generation_sec,
            "time/generation_sec_mean": statistics.fmean(r[0] for r in ranks),
            "time/wait_sec": info.wait_sec,
            "time/prepare_sec": prepare_sec,
            "time/train_sec": train_sec,
            "time/weight_sync_sec": weight_sync_sec,
            "time/step_sec": step_sec,
            "rl/slowest_generation_rank": float(max(range(len(ranks)), key=lambda r: ranks[r][0])),
            "rl/slowest_train_rank": float(max(range(len(ranks)), key=lambda r: ranks[r][2])),
            "rl/logical_tokens_per_sec": info.logical_tokens / max(step_sec, 1e-9),
            "rl/policy_version": float(info.policy_version),
            "rl/staleness": float(info.staleness),
        }
        if info.correct:
            metrics["rollout/accuracy"] = sum(info.correct) / len(info.correct)
        return metrics

    @staticmethod
    def _line(step: int, m: dict[str, float], gap: LogprobGap | None = None) -> str:
        accuracy = f" | acc {m['rollout/accuracy']:.2f}" if "rollout/accuracy" in m else ""
        logprob_gap = f" | logprob gap {gap.max:.1e}" if gap is not None else ""
        return (f"step {step:4d} | reward {m['rollout/reward_mean']:.3f} ± {m['rollout/reward_std']:.3f}{accuracy} | "
                f"len {m['rollout/response_tokens_mean']:.1f} | compression {m['rollout/compression_ratio']:.2f}x | "
                f"gen {m['time/generation_sec']:.2f}s train {m['time/train_sec']:.2f}s | "
                f"{m['rl/logical_tokens_per_sec']:.0f} tok/s | staleness {m['rl/staleness']:.0f}{logprob_gap}")

    @staticmethod
    def _print(trainer: Trainer, line: str) -> None:
        if not trainer.is_global_zero:
            return
        bar = trainer.progress_bar_callback
        if bar is not None and hasattr(bar, "print"):
            bar.print(line)  # above the progress bar, not through it
        else:
            print(line, flush=True)
