"""An existing Lightning RLHF module adopting the DFS step without adopting ``DTAModule``.

    python examples/existing_lightning_module.py --max-steps 3

``PolicyModule`` stands for code you already have: its own model attribute, optimizer, scheduler and
logging. Two changes make it train on prefix trees:

1. ``self.automatic_optimization = False`` (one DFS runs one backward per tree node, not one per loss);
2. call ``dta.dfs_training_step(self, batch, loss_fn, model=...)`` in ``training_step``: it zeroes the
   gradients, runs the DFS, sums the gradients over ranks once, clips with ``self.clip_gradients`` and steps
   the optimizer. (Mixing in ``dta.DFSStepMixin`` offers the same as ``self.dfs_training_step(...)``.)

Hooks: ``on_before_backward``/``on_after_backward`` do not fire in a DFS step (Lightning would fire them once
per node through ``manual_backward``); ``on_before_optimizer_step`` fires once per step, after the cross-rank sum
and clipping, and is the place to look at gradients. Use ``Trainer(strategy="dta")`` for several devices (a
DDP wrapper is refused).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import lightning_dta as dta
from lightning_dta.lightning.data import RolloutDataModule

DATA = Path(__file__).resolve().parent.parent / "data" / "tiny_rollouts.jsonl"


class PolicyModule(L.LightningModule):
    """The "existing" module: a policy, a KL-regularised PPO loss, AdamW with warm-up."""

    def __init__(self, lr: float = 1e-3, kl_coef: float = 0.0) -> None:
        super().__init__()
        self.automatic_optimization = False  # change 1
        config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
        self.policy = AutoModelForCausalLM.from_config(config)
        self.loss_fn = dta.PolicyLoss(clip_eps=0.2, kl_coef=kl_coef)
        self.lr = lr
        self.grad_norms: list[float] = []

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.lr)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=10)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        out = dta.dfs_training_step(self, batch, self.loss_fn, model=self.policy, gradient_clip_val=1.0)  # change 2
        self.lr_schedulers().step()
        self.log_dict({"policy/loss": out.loss, "policy/clip_fraction": out.metrics["clip_fraction"],
                       "policy/grad_norm": out.grad_norm}, prog_bar=True, batch_size=1)
        return torch.tensor(out.loss)

    def on_before_optimizer_step(self, optimizer) -> None:
        # Once per step, on every rank: the gradients here are the whole step's, summed over ranks and clipped.
        self.grad_norms.append(dta.gradient_norm(self.policy.parameters()))


def main(max_steps: int = 3, devices: int = 1) -> PolicyModule:
    L.seed_everything(0)
    module = PolicyModule()
    data = RolloutDataModule(path=DATA, rollouts_per_step=16, advantage_estimator="grpo")
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=devices, max_steps=max_steps, logger=False,
                        enable_checkpointing=False)
    trainer.fit(module, data)
    return module


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    main(args.max_steps, args.devices)
