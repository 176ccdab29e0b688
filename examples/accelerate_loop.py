"""Hugging Face Accelerate: a DFS step inside an ordinary ``accelerator.prepare`` training loop.

    python examples/accelerate_loop.py --steps 3
    accelerate launch --cpu --num_processes 2 examples/accelerate_loop.py --steps 3

Every process builds the same step (advantages over the whole step, then the same balanced partition) and
keeps its own share (``make_step_batch``); ``accelerate_tree_backward`` runs the DFS on the unwrapped model and
sums the gradients over processes once. The rest is the usual loop: clip, step, zero.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM

import lightning_dta as dta
from lightning_dta.accelerate import accelerate_tree_backward
from lightning_dta.core.advantages import grpo_advantages
from lightning_dta.lightning.data import make_step_batch

DATA = Path(__file__).resolve().parent.parent / "data" / "tiny_rollouts.jsonl"


def main(steps: int = 3, rollouts_per_step: int = 16, accelerator: Accelerator | None = None) -> list[float]:
    accelerator = accelerator or Accelerator()
    torch.manual_seed(0)  # prepare() broadcasts process 0's weights anyway (DDP)
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    loss_fn = dta.PolicyLoss(clip_eps=0.2)
    rollouts = dta.read_rollouts(DATA)
    losses = []
    for step in range(steps):
        chunk = rollouts[step * rollouts_per_step:(step + 1) * rollouts_per_step]
        batch = make_step_batch(grpo_advantages(chunk), accelerator.process_index, accelerator.num_processes)
        out = accelerate_tree_backward(accelerator, model, batch.tree, loss_fn)  # batch.tree may be None
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss)
        accelerator.print(f"step {step}: loss {out.loss:.4f}  grad norm {out.grad_norm:.3f}  "
                          f"logical tokens {out.metrics['logical_tokens']:.0f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    main(args.steps)
