"""Online RL in a plain PyTorch loop: the loop of ``configs/toy_rl_cpu.yaml`` without Lightning.

    python examples/online_rl.py --steps 150
    python examples/online_rl.py --steps 150 --mode async     # generation one step ahead, decoupled PPO

Each step: the source generates 16 prompts x 4 samples with the current weights (or takes them from its
background thread in async mode), scores them and sets GRPO advantages; one DFS step trains on the step's
prefix tree; ``update_policy`` hands the new weights to the generator. What the Lightning run adds on top is
logging, the reward plot and checkpointing (``lightning_dta.rl.OnlineRLCallback``).
"""

from __future__ import annotations

import argparse

import torch

import lightning_dta as dta
from lightning_dta.lightning.module import build_causal_lm
from lightning_dta.rl import HFGenerator, OnlineRolloutSource, ReverseDigits, sft_warm_start

TINY_LLAMA = {"model_type": "llama", "vocab_size": 16, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 64, "tie_word_embeddings": False}


def main(steps: int = 150, mode: str = "sync", seed: int = 0, sft_steps: int = 80, verbose: bool = True
         ) -> list[float]:
    """Train and return the mean reward of every step."""
    torch.manual_seed(seed)
    env = ReverseDigits(seed=seed)
    tokenizer = env.default_tokenizer()
    model = build_causal_lm(TINY_LLAMA)
    warm = sft_warm_start(model, env, tokenizer, sft_steps)
    if verbose:
        print(f"SFT warm start: demonstration NLL {warm.nll_before:.3f} -> {warm.nll_after:.3f}")
    source = OnlineRolloutSource(env, HFGenerator(max_new_tokens=8), tokenizer, prompts_per_step=16,
                                 samples_per_prompt=4, rollout_mode=mode, max_staleness=1, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss_fn = dta.PolicyLoss(clip_eps=0.2, importance_weight_cap=2.0)  # async: the decoupled weight truncated
    rewards = []
    source.attach(model)
    with source:  # close() stops the background thread in async mode, also on an exception
        for step in range(steps):
            rollouts = source.next_step()
            tree = dta.PrefixTree.from_rollouts(rollouts, vocab_size=TINY_LLAMA["vocab_size"])
            optimizer.zero_grad(set_to_none=True)
            dta.tree_backward(model, tree, loss_fn)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            source.update_policy(model, step + 1)
            info = source.last_step
            rewards.append(info.reward_mean)
            if verbose and (step + 1) % 10 == 0:
                print(f"step {step + 1:4d} | reward {info.reward_mean:.3f} | compression "
                      f"{tree.stats.compression_ratio:.2f}x | staleness {info.staleness}")
    return rewards


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--mode", choices=["sync", "async"], default="sync")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.steps, args.mode, args.seed)
