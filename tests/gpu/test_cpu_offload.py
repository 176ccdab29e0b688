"""``DTAFSDPStrategy(cpu_offload=True)`` on one CUDA rank (an NCCL world of 1): a clipped step equals the hand-written
one, and full parameters and an unsharded copy (the generator's) come back on the GPU.

Under FSDP2's CPU offload the shards and their gradients live in CPU memory on a CUDA mesh: the gradient norm's
all-reduce and the gathers of full parameters used to hand NCCL CPU tensors, which it refuses (the CPU test of the
device glue, a gloo group standing in: tests/distributed/test_offload_devices.py). Tolerances as in
tests/lightning/test_accelerate.py's GPU test (float32 on the GPU against the CPU reference; the offloaded optimizer
steps on the CPU).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import lightning_dta as dta
from tests.helpers.lightning import StepBatchData, grpo_rollouts, rank_batch, reference_step, tiny_llama

pytestmark = pytest.mark.gpu
LOSS = dict(clip_eps=0.2, kl_coef=0.1)
LR, CLIP = 0.5, 0.05
RTOL, ATOL = 1e-5, 1e-6


def test_a_clipped_step_with_cpu_offload_and_the_full_weights_on_the_gpu(tmp_path: Path) -> None:
    import lightning as L

    from lightning_dta.distributed.sharding import full_parameters, local_tensor, unsharded, unsharded_copy

    rollouts = grpo_rollouts()
    module = dta.DTAModule(tiny_llama(), loss=dta.PolicyLoss(**LOSS), gradient_clip_val=CLIP,
                           optimizer=functools.partial(torch.optim.SGD, lr=LR))
    trainer = L.Trainer(strategy=dta.DTAFSDPStrategy(cpu_offload=True), accelerator="cuda", devices=1, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, StepBatchData(lambda t: [rank_batch(rollouts, 0, 1)]))
    model = module.model
    assert {local_tensor(p).device.type for p in model.parameters()} == {"cpu"}  # offloaded shards
    ref = reference_step(tiny_llama(), rollouts, LOSS, lr=LR, clip=CLIP)
    assert ref["grad_norm"] > CLIP  # clipping acts
    assert float(trainer.callback_metrics["train/grad_norm"]) == pytest.approx(ref["grad_norm"], rel=RTOL)
    weights = {name: tensor for name, tensor in full_parameters(model) if name in ref["weights"]}
    assert {w.device.type for w in weights.values()} == {"cuda"}
    for name, weight in ref["weights"].items():
        torch.testing.assert_close(weights[name].cpu(), weight, rtol=RTOL, atol=ATOL, msg=name)
    copy = unsharded_copy(model)  # the generator's copy: on the GPU, the gathered weights as they are
    for name, param in copy.named_parameters():
        assert param.device.type == "cuda" and torch.equal(param, weights[name]), name
    ids = torch.tensor([[5, 17, 33, 2, 90, 64, 1]], device="cuda")
    with unsharded(model, training=False), torch.no_grad():
        sharded_logits = model(input_ids=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(copy(input_ids=ids).logits, sharded_logits, rtol=RTOL, atol=ATOL)
