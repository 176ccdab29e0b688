"""One DFS step with ``Trainer(strategy="dta", accelerator="cpu", devices=N)``, run as a script by test_distributed.

Every process first computes the single-process reference itself (plain ``tree_backward`` over ALL rollouts,
clipping, SGD), before any process group exists, then joins the N-rank Trainer run. Rank 1 perturbs its initial
weights, so matching results also prove the broadcast at setup. Each rank saves its gradients (after the
cross-rank sum and the clipping), its updated weights, the reference and the logged loss and log-prob gap to
``OUT/rank{r}.pt``.

With ``--critic`` the module also trains a critic (GAE advantages from its values, whitened over the whole step,
rewards on the rollouts) and each rank saves the critic's weights: test_distributed compares 2 ranks with 1.

Usage (from the repository root): python -m tests.lightning.dist_worker OUT DEVICES [EMPTY_RANK] [--critic]
(the "dta" launcher re-runs it once per extra rank)
"""

from __future__ import annotations

import functools
import os
import sys

import lightning as L
import torch

import lightning_dta as dta
from tests.helpers.lightning import StepBatchData, grpo_rollouts, rank_batch, reference_step, tiny_llama
from tests.helpers.reference import reference_logprob_gap

LR = 0.5
CLIP = 0.05  # below the gradient norm, so clipping is active and must act on the SUMMED gradient
LOSS = dict(clip_eps=0.2, kl_coef=0.1, agg="token-mean")


class _GAEData(StepBatchData):
    advantage_estimator = "gae"


def main() -> None:
    with_critic = "--critic" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--critic"]
    out_dir, devices = args[0], int(args[1])
    empty_rank = int(args[2]) if len(args) > 2 else None
    rollouts = grpo_rollouts()
    for index, rollout in enumerate(rollouts):
        rollout.reward = (index % 5) / 4  # for GAE; ignored otherwise
    model = tiny_llama()
    ref = reference_step(model, rollouts, LOSS, lr=LR, clip=CLIP)
    ref["logprob_gap"] = reference_logprob_gap(model, rollouts)
    if int(os.environ.get("LOCAL_RANK", "0")) == 1:
        with torch.no_grad():  # a different start on rank 1: the strategy must broadcast rank 0's weights
            for p in model.parameters():
                p.add_(1.0)
    critic = {}
    if with_critic:
        value = dta.value_model(tiny_llama(seed=1))
        with torch.no_grad():
            value.get_output_embeddings().weight.fill_(0.01)
        initial = {n: p.detach().clone() for n, p in value.named_parameters()}
        critic = dict(critic=dta.PPOCritic(value, optimizer=functools.partial(torch.optim.SGD, lr=LR), gamma=0.9,
                                           lam=0.8, whiten=True))
    module = dta.DTAModule(model, optimizer=functools.partial(torch.optim.SGD, lr=LR), gradient_clip_val=CLIP,
                           loss=dta.PolicyLoss(**LOSS), **critic)
    data = (_GAEData if with_critic else StepBatchData)(
        lambda t: [rank_batch(rollouts, t.global_rank, t.world_size, empty_rank)])
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=devices, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    rank = trainer.global_rank
    torch.save({"grads": {n: p.grad.clone() for n, p in module.model.named_parameters()},
                "weights": {n: p.detach().clone() for n, p in module.model.named_parameters()},
                "loss": float(trainer.callback_metrics["train/loss"]),
                "grad_norm": float(trainer.callback_metrics["train/grad_norm"]),
                "logprob_gap": tuple(float(trainer.callback_metrics[f"train/logprob_gap_{name}"])
                                     for name in ("max", "mean", "kl")),
                "had_tree": rank_batch(rollouts, rank, devices, empty_rank).tree is not None,
                "world_size": trainer.world_size, "reference": ref,
                "critic": {n: p.detach().clone() for n, p in module.critic.model.named_parameters()}
                if with_critic else None,
                "critic_initial": initial if with_critic else None},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
