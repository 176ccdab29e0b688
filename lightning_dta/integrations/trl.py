"""``DTAGRPOTrainer``: TRL's ``GRPOTrainer`` whose training step is one DFS step over the prefix tree of the batch's
completions. One changed import::

    from lightning_dta.integrations.trl import DTAGRPOTrainer as GRPOTrainer

TRL's generation, rewards, advantages, logging, config and optimizer loop stay TRL's (``pip install -e ".[trl]"``,
TRL 1.16.0). What changes is the loss and its backward: TRL forwards every completion with its prompt, padded;
here the completions of an optimizer step become ``Rollout`` objects (prompt + completion, the loss mask on the
completion's trained tokens, TRL's advantages and its old/reference/vLLM log-probs) and one
:func:`~lightning_dta.accelerate.accelerate_tree_backward` walks their prefix tree: a group's prompt (and the
history multi-turn completions share) is forwarded once, and the gradient is exactly TRL's (the loss is
``PolicyLoss.from_trl(args)``, docs/losses.md; ``tests/integrations/test_trl_trainer.py`` compares the two per
parameter).

How the step is hooked: TRL's ``Trainer`` calls ``training_step`` once per micro-batch, then clips and steps the
optimizer. This trainer overrides ``training_step``: each call still runs TRL's ``_prepare_inputs`` (which generates
and buffers), keeps the micro-batch, and on the last micro-batch of the optimizer step walks the tree of all of them
and adds the whole step's gradient; it returns the step's loss on that call and 0 on the others, so the logged
sum is TRL's. ``accelerator.backward`` is not called (a DFS runs one backward per tree node), so nothing is counted
twice.

Refused at construction, each with its reason: what ``PolicyLoss.from_trl`` cannot express; DeepSpeed and FSDP
(their partitioned parameters; this trainer runs on one process or DDP); Liger kernels; an MoE router's
auxiliary loss; ``cast_lm_head_to_fp32``; ``bnpo`` and the entropy bonus on several processes (TRL normalises them
per process). ``gradient_checkpointing=True`` (TRL's default) becomes the engine's ``activation="recompute"``:
transformers' checkpointing drops the KV cache a tree walk needs. Multimodal inputs are refused at the first step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from trl import GRPOTrainer

from lightning_dta.accelerate import accelerate_tree_backward
from lightning_dta.core.conversions import Converted
from lightning_dta.core.conversions.trl import from_trl
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.step import StepOutput
from lightning_dta.engine.options import EngineOptions

MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
              "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images", "num_tiles")
LOG = logging.getLogger(__name__)
# TRL's per-token tensors by their names in the inputs dict (the converter's rollout_fields map them)
PER_TOKEN = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")


class DTAGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with a DFS tree walk for its training step (module docstring).

    Args:
        *args, **kwargs: ``GRPOTrainer``'s.
        engine: the :class:`~lightning_dta.EngineOptions` of the walk (default ``EngineOptions()``); the policy's
            temperature is taken from ``args.temperature``.
    """

    def __init__(self, *args: Any, engine: EngineOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # transformers 5 names it activation_checkpointing (gradient_checkpointing is its deprecated alias); the
        # Trainer turns it on at train(), which would drop the KV cache a tree walk needs: the walk recomputes
        recompute = bool(getattr(self.args, "activation_checkpointing", None) or self.args.gradient_checkpointing)
        if recompute:
            self.args.gradient_checkpointing = False
            if hasattr(self.args, "activation_checkpointing"):  # optional library feature: transformers >= 5
                self.args.activation_checkpointing = False
        self.dta_loss: Converted = from_trl(self.args)
        self._refuse_unsupported()
        overrides = dict(self.dta_loss.engine)
        if recompute and (engine is None or engine.activation == "keep"):
            overrides["activation"] = "recompute"
            LOG.info("gradient_checkpointing=True (TRL's default): the tree walk recomputes instead "
                     "(EngineOptions(activation='recompute'): the same memory idea; transformers' checkpointing drops "
                     "the KV cache the walk needs)")
        self.dta_engine = EngineOptions.resolve(engine, **overrides)
        self.dta_last_step: StepOutput | None = None  # the last tree step's metrics (loss, compression, ...)
        self._window: list[dict[str, Any]] = []

    def _refuse_unsupported(self) -> None:
        kind = getattr(self.accelerator.distributed_type, "name", str(self.accelerator.distributed_type))  # enum
        reasons = {
            "DeepSpeed/FSDP": (kind not in ("NO", "MULTI_CPU", "MULTI_GPU"),
                               f"the accelerator runs {kind}: the tree walk sums whole gradients over processes "
                               "and cannot walk partitioned parameters (ZeRO-3, FSDP). Fix: DDP or one process"),
            "use_liger_kernel": (bool(self.args.use_liger_kernel), "Liger's kernels replace layers the engine's KV "
                                 "cache contract is tested with. Fix: use_liger_kernel=False"),
            "router_aux_loss_coef": (bool(self.aux_loss_enabled), "the MoE router's auxiliary loss is not added by "
                                     "the tree walk. Fix: router_aux_loss_coef=0 (or a dense model)"),
            "cast_lm_head_to_fp32": (bool(self.args.cast_lm_head_to_fp32), "the walk computes the log-probs from the "
                                     "model's own logits. Fix: cast_lm_head_to_fp32=False"),
            "loss_type='bnpo'": (self.loss_type == "bnpo" and self.accelerator.num_processes > 1,
                                 "TRL averages each process's own token mean. Fix: loss_type='dapo'"),
            "entropy_coef": (self.dta_loss.loss.entropy_coef != 0 and self.accelerator.num_processes > 1,
                             "TRL's entropy bonus is each process's token mean. Fix: entropy_coef=0 or one process"),
            "n_gpu": (self.args.n_gpu > 1, "torch.nn.DataParallel replicas. Fix: launch one process per GPU (DDP)"),
        }
        for name, (refused, reason) in reasons.items():
            if refused:
                raise ValueError(f"DTAGRPOTrainer does not support {name}: {reason}")

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """TRL's micro-batch bookkeeping (generation through ``_prepare_inputs``, ``_step``, the step-time metric);
        on the optimizer step's last micro-batch, the tree walk of all of them (module docstring)."""
        started = time.perf_counter()
        model.train()
        # optional optimizer feature: schedule-free optimizers switch modes, as Trainer.training_step does
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        self._window.append(self._prepare_inputs(inputs))
        if len(self._window) < self.current_gradient_accumulation_steps:
            loss = torch.zeros((), device=self.accelerator.device)
        else:
            window, self._window = self._window, []
            loss = self._tree_step(model, window)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - started
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _tree_step(self, model: torch.nn.Module, window: list[dict[str, Any]]) -> torch.Tensor:
        rollouts = [r for batch in window for r in self.rollouts(batch)]
        tree = PrefixTree.from_rollouts(rollouts)
        out = accelerate_tree_backward(self.accelerator, model, tree, self.dta_loss.loss, engine=self.dta_engine)
        self.dta_last_step = out
        metrics = out.metrics
        for name, value in (("entropy", metrics["entropy"]), ("clip_ratio/region_mean", metrics["clip_fraction"]),
                            ("dta/compression_ratio", metrics["compression_ratio"]),
                            ("dta/tree_tokens", metrics["tree_tokens"]),
                            ("dta/importance_weight_mean", metrics["importance_weight_mean"])):
            self._metrics["train"][name].append(float(value))
        if self.beta != 0.0:
            self._metrics["train"]["kl"].append(float(metrics["ref_kl"]))
        return torch.tensor(out.loss, device=self.accelerator.device)

    def rollouts(self, inputs: dict[str, Any]) -> list[Rollout]:
        """One micro-batch of TRL's inputs as rollouts: prompt (unpadded) + completion, the loss mask
        ``completion_mask x tool_mask`` on the completion, TRL's advantages, its per-token log-probs in the fields
        ``PolicyLoss.from_trl`` maps them to (0 on the prompt, where nothing is trained)."""
        multimodal = [key for key in MULTIMODAL if key in inputs]
        if multimodal:
            raise ValueError(f"DTAGRPOTrainer does not support multimodal inputs ({multimodal}): the tree walk "
                             "forwards token ids only. Fix: GRPOTrainer for vision-language models")
        fields = {name: self.dta_loss.rollout_fields[name] for name in PER_TOKEN
                  if name in inputs and name in self.dta_loss.rollout_fields}
        prompt_ids, prompt_mask = inputs["prompt_ids"].cpu(), inputs["prompt_mask"].cpu().bool()
        completion_ids, completion_mask = inputs["completion_ids"].cpu(), inputs["completion_mask"].cpu()
        trained = completion_mask * inputs["tool_mask"].cpu() if "tool_mask" in inputs else completion_mask
        advantages = inputs["advantages"].detach().cpu().double()
        values = {name: inputs[name].detach().cpu().double() for name in fields}
        out = []
        for i in range(completion_ids.shape[0]):
            prompt = prompt_ids[i][prompt_mask[i]].tolist()
            present = torch.nonzero(completion_mask[i]).flatten()
            n = int(present[-1]) + 1 if present.numel() else 0  # what TRL's attention mask lets the forward see
            if n == 0 and len(prompt) < 2:  # a masked-out completion after a one-token prompt: keep one token
                n = 1
            ids = prompt + completion_ids[i, :n].tolist()
            pad = [0.0] * len(prompt)
            per_token = {ours: pad + values[theirs][i, :n].tolist() for theirs, ours in fields.items()}
            advantage = float(advantages[i]) if advantages.dim() == 1 else pad + advantages[i, :n].tolist()
            out.append(Rollout(input_ids=ids, loss_mask=[0] * len(prompt) + trained[i, :n].long().tolist(),
                               advantages=advantage, **per_token))
        return out
