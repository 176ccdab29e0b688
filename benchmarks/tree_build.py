"""Time PrefixTree construction (and validation) on large steps: 10,000 rollouts of 2,000 tokens.

    python benchmarks/tree_build.py

Shapes: GRPO-like (625 prompts x 16 responses, 1,000 + 1,000 tokens) and no sharing at all (random).
"""

from __future__ import annotations

import time

import numpy as np

import lightning_dta as dta


def rollouts(shared: bool, rng: np.random.Generator) -> list[dta.Rollout]:
    out = []
    for _ in range(625):
        prompt = rng.integers(0, 150_000, 1000).tolist()
        for _ in range(16):
            head = prompt if shared else rng.integers(0, 150_000, 1000).tolist()
            out.append(dta.Rollout(input_ids=head + rng.integers(0, 150_000, 1000).tolist()))
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    for name, shared in (("grpo-shaped", True), ("no sharing", False)):
        data = rollouts(shared, rng)
        millions = sum(len(r) for r in data) / 1e6
        start = time.perf_counter()
        dta.validate_rollouts(data)
        validate = time.perf_counter() - start
        start = time.perf_counter()
        tree = dta.PrefixTree.from_rollouts(data, validate=False)
        build = time.perf_counter() - start
        print(f"{name:<12} {len(data)} rollouts, {millions:.0f}M tokens: build {build:.2f} s "
              f"({build / millions:.3f} s per M tokens), validate {validate:.2f} s "
              f"({validate / millions:.3f} s per M tokens); compression {tree.stats.compression_ratio:.2f}x")


if __name__ == "__main__":
    main()
