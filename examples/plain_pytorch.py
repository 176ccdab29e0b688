"""Plain PyTorch: one DFS over a step's prefix tree per optimizer step, no framework.

    python examples/plain_pytorch.py --steps 4

``tree_backward`` ADDS the gradient of the whole step's loss to ``.grad`` (one backward per tree node inside),
so the loop is the familiar zero_grad -> backward -> clip -> step, with the tree in place of the batch.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import lightning_dta as dta
from lightning_dta.core.advantages import estimate_advantages

DATA = Path(__file__).resolve().parent.parent / "data" / "tiny_rollouts.jsonl"


def main(steps: int = 4, rollouts_per_step: int = 16, path: Path = DATA) -> list[float]:
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = dta.PolicyLoss(clip_eps=0.2, agg="token-mean")
    engine = dta.EngineOptions(mode="dfs", activation="keep")  # every option is exact; they trade memory for speed
    rollouts = dta.read_rollouts(path)
    losses = []
    for step in range(steps):
        chunk = rollouts[step * rollouts_per_step:(step + 1) * rollouts_per_step]
        tree = dta.PrefixTree.from_rollouts(estimate_advantages(chunk, "grpo"))  # GRPO over the whole step
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        out = dta.tree_backward(model, tree, loss_fn, engine=engine)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seconds = time.perf_counter() - start
        losses.append(out.loss)
        stats = tree.stats
        print(f"step {step}: loss {out.loss:.4f}  clip {out.metrics['clip_fraction']:.3f}  "
              f"{stats.logical_tokens / seconds:.0f} logical tok/s  compression {stats.compression_ratio:.2f}x")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollouts-per-step", type=int, default=16)
    args = parser.parse_args()
    main(args.steps, args.rollouts_per_step)
