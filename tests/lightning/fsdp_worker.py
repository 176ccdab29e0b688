"""Several DFS optimizer steps with ``Trainer(strategy=..., devices=N)``, run as a script by test_fsdp.

The step data: three steps of GRPO-like rollouts partitioned across the ranks by ``RolloutDataModule`` (so every
rank walks a different tree), the last step with one rollout only (one rank is empty). AdamW (sharded optimizer
state), clipping below the gradient norm (clipping is active). Each rank saves its logged loss and gradient norm
and FSDP2's all-gathers per step, the full trained weights, the bytes of parameters / gradients / optimizer state
it holds, and the logits of the trained model on a fixed input.

Usage (from the repository root):
    python -m tests.lightning.fsdp_worker OUT STRATEGY DEVICES ACTIVATION STEPS [--save CKPT] [--resume CKPT]
        [--export DIR] [--model HF_DIR] [--keep-unsharded] [--tensor-parallel N]

``--tensor-parallel N``: ``DTAFSDPStrategy(tensor_parallel_size=N)`` (tests/distributed/test_tp_checkpoints.py); the
output file is then ``dta_fsdp-tpN-DEVICES-rankR.pt``.
"""

from __future__ import annotations

import argparse
import functools
import os

import lightning as L
import torch
import torch.distributed as dist

import lightning_dta as dta
from lightning_dta.distributed.sharding import export_hf_checkpoint, full_parameters, state_bytes, unsharded
from lightning_dta.lightning.data import RolloutDataModule
from tests.helpers.lightning import TINY_LLAMA, grpo_rollouts, run_name

CLIP = 0.2
LOSS = dict(clip_eps=0.2, kl_coef=0.1)


def steps() -> list[list[dta.Rollout]]:
    return [grpo_rollouts(seed=0), grpo_rollouts(seed=1, groups=2, per_group=5), grpo_rollouts(seed=2)[:1]]


class Record(L.Callback):
    """Per step: the logged loss and gradient norm, whether this rank had a tree, the bytes it holds, and the
    all-gathers FSDP2 ran (counted at ``torch.distributed.all_gather_single``, which FSDP2 calls)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.gathers = 0
        gather = dist.all_gather_single

        def counted(*args, **kwargs):
            self.gathers += 1
            return gather(*args, **kwargs)

        dist.all_gather_single = counted

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.gathers = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.rows.append({"loss": float(metrics["train/loss"]), "grad_norm": float(metrics["train/grad_norm"]),
                          "had_tree": batch.tree is not None, "all_gathers": self.gathers,
                          "bytes": state_bytes(pl_module.model, [o.optimizer for o in [pl_module.optimizers()]])})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("strategy")
    parser.add_argument("devices", type=int)
    parser.add_argument("activation")
    parser.add_argument("steps", type=int)
    parser.add_argument("--save", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--export", default=None)
    parser.add_argument("--model", default=None, help="a local Hugging Face checkpoint instead of TINY_LLAMA")
    parser.add_argument("--keep-unsharded", action="store_true", help="DTAFSDPStrategy(reshard_after_forward=False)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="DTAFSDPStrategy(tensor_parallel_size=N)")
    args = parser.parse_args()
    torch.manual_seed(0)
    strategy = args.strategy
    if args.keep_unsharded or args.tensor_parallel > 1:
        strategy = dta.DTAFSDPStrategy(reshard_after_forward=not args.keep_unsharded,
                                       tensor_parallel_size=args.tensor_parallel)
    module = dta.DTAModule(args.model or {**TINY_LLAMA}, loss=dta.PolicyLoss(**LOSS),
                           engine=dta.EngineOptions(activation=args.activation, chunk_size=3),
                           optimizer=functools.partial(torch.optim.AdamW, lr=3e-3), gradient_clip_val=CLIP)
    data = RolloutDataModule(source=steps(), calibrate_cost_model=False)
    record = Record()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record])
    trainer.fit(module, data, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    model = module.model
    weights = {name: tensor.detach().clone() for name, tensor in full_parameters(model)}  # every rank gathers
    ids = torch.tensor([[5, 17, 33, 2, 90, 64, 1]])
    with unsharded(model, training=False), torch.no_grad():
        logits = model(input_ids=ids).logits
    if args.export:
        export_hf_checkpoint(model, args.export)
    torch.save({"rows": record.rows, "weights": weights, "logits": logits, "world_size": trainer.world_size},
               os.path.join(args.out, f"{run_name(args.strategy, args.devices, args.tensor_parallel)}-rank"
                                      f"{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
