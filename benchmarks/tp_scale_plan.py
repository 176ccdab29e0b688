"""The planner's table for models past one GPU's memory (BENCHMARKS.md, "Tensor parallelism: predicted at 8B-70B").

Qwen3-8B, Qwen3-32B and a Llama-3-70B shape on 8 and 16 GPUs of 80 GB, on the tau^2-bench-like steps of the bench
workloads (``tau2-like``: 32 episodes of 8 calls, a 4.8K-token system prompt, ~9.4x compression; ``tau2-long``: the
same with contexts reaching ~16K tokens), bf16 weights, AdamW, under four designs of ``dta_fsdp``:

- gather-once FSDP2 over every GPU (``tensor_parallel_size=1``): each rank walks its own tree with the whole
  unsharded model and its gradient (float32, or bfloat16 with ``walk_gradient_dtype``);
- tensor parallelism 8 within a node x FSDP2 over the nodes: the 8 peers of a node walk one tree; a rank holds
  1/8 of the weights and of the walk's gradient, and computes 1/8 of the heads, the MLP and the vocabulary.

Every number is a prediction of ``lightning-dta plan`` (activation rates probed on the CPU on one- and two-layer
clones of what one rank computes, FLOPs from the shape), not a GPU measurement. The planner models tensor
parallelism without sequence parallelism (the residual stream and the gathered logits are whole on every rank) and
the optimizer state on the GPU (no CPU offload).

    python benchmarks/tp_scale_plan.py            # prints the markdown table (tens of minutes on 2 cores)
    python benchmarks/tp_scale_plan.py llama-70b  # one model's rows
"""

from __future__ import annotations

import contextlib
import functools
import io
import json

from lightning_dta.plan import cli

MODELS = ("qwen3-8b", "qwen3-32b", "llama-70b")
DESIGNS = (("gather-once (TP 1)", 1, "float32"), ("gather-once, bf16 walk gradient", 1, "bfloat16"),
           ("TP 8 x FSDP", 8, "float32"), ("TP 8 x FSDP, bf16 walk gradient", 8, "bfloat16"))


@functools.cache
def _rates(key: str, dtype):
    return _probe(_configs[key], dtype)


_configs: dict = {}
_probe = cli.probe_rates


def cached_probe(config, dtype):
    """The activation rates of one shape are probed once for the whole table."""
    key = config.to_json_string()
    _configs[key] = config
    return _rates(key, dtype)


def predict(model: str, workload: str, gpus: int, tensor_parallel: int, gradient: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["--model", model, "--workload", workload, "--devices", str(gpus), "--strategy", "dta_fsdp",
                         "--tensor-parallel", str(tensor_parallel), "--walk-gradient-dtype", gradient,
                         "--memory", "80GB", "--json"])
    assert code == 0, (model, workload, gpus, tensor_parallel)
    return json.loads(out.getvalue())


def main(models: tuple[str, ...] = MODELS) -> None:
    cli.probe_rates = cached_probe
    print("| model | GPUs | step | design | state per rank at rest / in the walk | cheapest fit (80 GB) | peak | "
          "TFLOPs per rank | vs vanilla-ckpt |")
    print("|---|---:|---|---|---:|---|---:|---:|---:|")
    for model in models:
        for gpus in (8, 16):
            for workload in ("tau2-like", "tau2-long"):
                for design, tp, gradient in DESIGNS:
                    record = predict(model, workload, gpus, tp, gradient)
                    state = record["state_bytes"]
                    rest = state["weights"] + state["gradients"] + state["optimizer"]
                    ckpt = record["modes"]["vanilla-ckpt"]["tflops"]
                    best = record["fits"][0] if record["fits"] else None
                    fit = "none" if best is None else best["name"]
                    peak = "" if best is None else f"{best['peak_bytes'] / 2**30:.1f} GiB"
                    tflops = "" if best is None else f"{best['tflops']:,.0f}"
                    ratio = "" if best is None else f"{ckpt / best['tflops']:.2f}x"
                    print(f"| {model} | {gpus} | {workload} | {design} | {rest / 2**30:.1f} / "
                          f"{(rest + state['unsharded_walk']) / 2**30:.1f} GiB | {fit} | {peak} | {tflops} | {ratio} |",
                          flush=True)


if __name__ == "__main__":
    import sys

    main(tuple(sys.argv[1:]) or MODELS)
