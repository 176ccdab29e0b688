"""Communication per step and per GPU: gather-once FSDP2 vs tensor parallelism x FSDP2 (arithmetic, not a measurement).

BENCHMARKS.md, "Tensor parallelism: communication per step". For ``P`` parameters, ``D`` GPUs, tensor-parallel size
``t`` (``d = D / t`` data-parallel ranks), bf16-mixed (bf16 compute weights, float32 gradients), ring collectives
(a rank sends and receives ``(n - 1) / n`` of the buffer in an all-gather or a reduce-scatter, twice that in an
all-reduce):

- FSDP2 per step: one all-gather of the compute weights (2 B per parameter) and one reduce-scatter of the float32
  gradient (4 B), over the ``d`` data-parallel ranks, of a rank's ``1/t`` of the model:
  ``6 P / t * (d - 1) / d`` bytes;
- tensor parallelism per step, over the ``t`` peers of a group that walk one tree of ``T`` computed tokens: every
  layer all-reduces its attention output and its MLP output (``hidden`` bf16 values per token) in the forward and
  their gradients in the backward, and ``activation="recompute"`` re-runs the forward of inner chunks (``R`` tokens);
  the vocabulary-parallel embedding all-reduces one ``hidden`` vector per token, the head all-gathers the logits of
  the ``S`` scored positions (``V`` bf16 values): ``2 (t - 1) / t * 2 B * (2 L h (2 T + R) + h T) + (t - 1) / t * 2 B
  * V S``.

The token counts come from the bench workloads (one walker's share: the step split over ``d`` walkers by the
partition), ``R`` is taken as the tokens of inner nodes (an upper bound: recompute re-runs exactly those).

    python benchmarks/tp_comm.py
"""

from __future__ import annotations

from lightning_dta.core.balance import partition
from lightning_dta.core.tree import PrefixTree
from lightning_dta.shapes.models import PRESETS, model_config
from lightning_dta.shapes.workloads import WORKLOADS

GIB = 2**30


def step_tokens(workload: str, walkers: int, vocab: int) -> tuple[int, int, int]:
    """Computed tokens, inner-node tokens and scored positions of the busiest walker."""
    rollouts = WORKLOADS[workload].generate(vocab, 0)
    shares = partition(rollouts, walkers) if walkers > 1 else [list(range(len(rollouts)))]
    worst = (0, 0, 0)
    for share in shares:
        tree = PrefixTree.from_rollouts([rollouts[i] for i in share])
        inner = sum(node.length for node in tree.iter_nodes() if node.children)
        scored = sum(sum(r.mask()[1:]) for r in tree.rollouts)
        worst = max(worst, (tree.stats.tree_tokens, inner, scored))
    return worst


def main() -> None:
    print("| model | GPUs | step | design | FSDP2 per GPU | tensor-parallel per GPU | total per GPU |")
    print("|---|---:|---|---|---:|---:|---:|")
    for name in ("qwen3-8b", "qwen3-32b"):
        shape = PRESETS[name]
        parameters = sum(p.numel() for p in _meta_model(name).parameters())
        for gpus in (8, 16):
            for workload in ("tau2-like", "tau2-long"):
                for t in (1, 8):
                    d = gpus // t
                    fsdp = 6 * parameters / t * (d - 1) / d
                    tokens, inner, scored = step_tokens(workload, d, shape["vocab"])
                    tp = 0.0
                    if t > 1:
                        hidden, layers = shape["hidden"], shape["layers"]
                        values = 2 * layers * hidden * (2 * tokens + inner) + hidden * tokens  # all-reduced, bf16
                        tp = 2 * (t - 1) / t * 2 * values + (t - 1) / t * 2 * shape["vocab"] * scored
                    design = "gather-once FSDP2" if t == 1 else f"TP {t} x FSDP2 over {d}"
                    print(f"| {name} | {gpus} | {workload} ({tokens:,} tree tokens per walker) | {design} | "
                          f"{fsdp / GIB:.1f} GiB | {tp / GIB:.1f} GiB | {(fsdp + tp) / GIB:.1f} GiB |")


def _meta_model(name: str):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(**PRESETS[name]))


if __name__ == "__main__":
    main()
