"""Bytes per parameter held during the walk under ``dta_fsdp`` with bfloat16 weights: the walk's gradient accumulated
in float32 (``DTAFSDPStrategy(walk_gradient_dtype="float32")``, the default) or in bfloat16 (``"bfloat16"``), and the
error of the bfloat16 accumulation against the float32 one.

Gather-once (lightning_dta/distributed/sharding.py): before the walk every FSDP2 unit is all-gathered once; during
it the unsharded weights stay and every backward (one per pop) adds to an unsharded gradient; one reduce-scatter
after it. With ``precision="bf16-true"`` the unsharded weights are bfloat16 (2 bytes/param); the unsharded gradient
is kept in FSDP2's ``reduce_dtype``: float32 (each backward's bfloat16 gradient is added to a float32 buffer,
``FSDPParam.unsharded_accumulated_grad``), or, with ``reduce_dtype`` unset (``walk_gradient_dtype="bfloat16"``), in
the parameters' bfloat16 (``.grad`` of the unsharded parameter). The script runs the package's step
(``tree_step_backward`` on a model parallelized by ``parallelize_model`` with the layout of ``DTAFSDPStrategy``) and
reads, at the end of the walk (just before the reduce-scatter), the bytes of every FSDP2 parameter's unsharded weight
and unsharded gradient, divided by the number of parameters. On the CPU there is no allocator statistic to read
(``torch.cuda.memory_stats`` is CUDA only), so these are the tensors' own ``nbytes``; the shards (weights, AdamW
state) and the activations come on top.

The error: the same bfloat16 weights, the same tree, both accumulations; the reduced gradients compared (float64
norms), over all parameters (``||g_bf16 - g_fp32|| / ||g_fp32||``) and the worst single parameter tensor.

    python benchmarks/tp_memory.py [--world 2] [--layers 4] [--hidden 256] [--rollouts 24]

Measured (defaults: 2.89 M parameters, 2 gloo ranks, torch 2.13 CPU): float32 2.00 + 4.00 = 6.00 bytes/param held
during the walk, bfloat16 2.00 + 2.00 = 4.00; bfloat16 vs float32 accumulation 3.4e-3 relative over the whole
reduced gradient (worst tensor 5.7e-3, ``model.norm.weight``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import socket

import torch
import torch.distributed as dist

import lightning_dta as dta
import lightning_dta.distributed.step as step_module
from lightning_dta.contracts import DATA_PARALLEL, TENSOR_PARALLEL, ParallelLayout
from lightning_dta.distributed.parallelize import parallelize_model
from lightning_dta.distributed.sharding import fsdp_units
from lightning_dta.distributed.step import tree_step_backward
from lightning_dta.models import build_causal_lm

DTYPES = ("float32", "bfloat16")


def model_config(layers: int, hidden: int, vocab: int) -> dict:
    return dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False)


def grpo_tree(vocab: int, rollouts: int, seed: int, rank: int) -> dta.PrefixTree:
    """Groups of 4 samples after a shared prompt, with a shared second turn in half of them: many pops, so many
    backwards add to the walk's gradient."""
    rng = random.Random(seed * 1000 + rank)
    out = []
    while len(out) < rollouts:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(24, 48))]
        turn = [rng.randrange(vocab) for _ in range(8)]
        for s in range(4):
            tail = [rng.randrange(vocab) for _ in range(rng.randint(8, 24))]
            ids = prompt + (turn if s % 2 else []) + tail
            n = len(ids)
            out.append(dta.Rollout(input_ids=ids, loss_mask=[0] * len(prompt) + [1] * (n - len(prompt)),
                                   advantages=rng.gauss(0, 1), old_logprobs=[-rng.uniform(0.5, 4.0) for _ in range(n)]))
    return dta.PrefixTree.from_rollouts(out[:rollouts])


def layout_of(walk_gradient_dtype: str, mesh) -> ParallelLayout:
    """The layout ``DTAFSDPStrategy(walk_gradient_dtype=...)`` offers under ``precision="bf16-true"``."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    strategy = dta.DTAFSDPStrategy(walk_gradient_dtype=walk_gradient_dtype)
    strategy.precision_plugin = HalfPrecision("bf16-true")
    return ParallelLayout(device_mesh=mesh, sharding=strategy._sharding())


def held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """The bytes of every FSDP2 parameter's unsharded weight and unsharded gradient (accumulated in
    ``reduce_dtype`` or kept in the parameter dtype), and the number of parameters."""
    out = dict(weights=0, gradient=0, parameters=0)
    for unit in fsdp_units(model):
        group = unit._get_fsdp_state()._fsdp_param_group  # FSDP2's own records of the unit's parameters
        for param in group.fsdp_params if group is not None else ():
            unsharded = param._unsharded_param
            grad = param.unsharded_accumulated_grad if param.unsharded_accumulated_grad is not None else unsharded.grad
            out["weights"] += unsharded.numel() * unsharded.element_size()
            out["gradient"] += 0 if grad is None else grad.numel() * grad.element_size()
            out["parameters"] += unsharded.numel()
    return out


@contextlib.contextmanager
def measured_before_reduce(model: torch.nn.Module, record: dict):
    """Read :func:`held_bytes` at the end of the walk, when the step calls ``reduce_gradients``."""
    original = step_module.reduce_gradients

    def reduce(m):
        record.update(held_bytes(model))
        grad_dtypes = {str(p.unsharded_accumulated_grad.dtype if p.unsharded_accumulated_grad is not None
                           else p._unsharded_param.grad.dtype)
                       for u in fsdp_units(model) for p in u._get_fsdp_state()._fsdp_param_group.fsdp_params
                       if p.unsharded_accumulated_grad is not None or p._unsharded_param.grad is not None}
        record["gradient_dtypes"] = sorted(grad_dtypes)
        original(m)

    step_module.reduce_gradients = reduce
    try:
        yield
    finally:
        step_module.reduce_gradients = original


def run_step(walk_gradient_dtype: str, config: dict, rollouts: int, seed: int = 0) -> tuple[dict, dict]:
    """One step on every rank of the current process group: (the bytes record, the reduced full gradients)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
    torch.manual_seed(seed)
    model = build_causal_lm(dict(config))
    layout = layout_of(walk_gradient_dtype, mesh)
    parallelize_model(model, layout, torch.device("cpu"))
    tree = grpo_tree(config["vocab_size"], rollouts, seed, rank)
    record: dict = {}
    with measured_before_reduce(model, record):
        out = tree_step_backward(model, tree, dta.PolicyLoss(clip_eps=0.2), layout=layout)
    record["loss"] = out.loss
    grads = {name: p.grad.full_tensor().double() for name, p in model.named_parameters()}
    record["parameter_dtype"] = str(next(model.parameters()).dtype)
    return record, grads


def compare(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """(relative error of the whole gradient, the worst parameter tensor's, its name)."""
    total = sum(float((got[n] - e).norm()) ** 2 for n, e in expected.items()) ** 0.5
    norm = sum(float(e.norm()) ** 2 for e in expected.values()) ** 0.5
    worst, where = 0.0, ""
    for name, e in expected.items():
        error = float((got[name] - e).norm()) / max(float(e.norm()), 1e-30)
        if error > worst:
            worst, where = error, name
    return total / norm, worst, where


def measure(config: dict, rollouts: int, seed: int = 0) -> dict:
    """Both walk-gradient dtypes on the current process group; the records and the bfloat16 error."""
    records, grads = {}, {}
    for dtype in DTYPES:
        records[dtype], grads[dtype] = run_step(dtype, config, rollouts, seed)
    total, worst, where = compare(grads["bfloat16"], grads["float32"])
    return dict(records=records, relative_error=total, worst_parameter_error=worst, worst_parameter=where)


def table(result: dict, world: int) -> str:
    lines = ["| walk gradient | unsharded weights B/param | unsharded gradient B/param | held during the walk B/param |"
             " gradient dtype |", "|---|---|---|---|---|"]
    for dtype in DTYPES:
        r = result["records"][dtype]
        n = r["parameters"]
        lines.append(f"| {dtype} | {r['weights'] / n:.2f} | {r['gradient'] / n:.2f} | "
                     f"{(r['weights'] + r['gradient']) / n:.2f} | {', '.join(r['gradient_dtypes'])} |")
    n = result["records"]["float32"]["parameters"]
    lines.append("")
    lines.append(f"{n / 1e6:.2f} M parameters, bf16-true weights, {world} data-parallel rank(s), one step; bfloat16 vs "
                 f"float32 accumulation: reduced gradient relative error {result['relative_error']:.2e} (worst tensor "
                 f"{result['worst_parameter_error']:.2e}, {result['worst_parameter']}).")
    return "\n".join(lines)


def _entry(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        result = measure(model_config(args.layers, args.hidden, args.vocab), args.rollouts)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="data-parallel ranks (gloo processes)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rollouts", type=int, default=24, help="rollouts per rank")
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        path = os.path.join(tmp, "result.pt")
        mp.spawn(_entry, args=(args.world, port, args, path), nprocs=args.world, join=True)
        result = torch.load(path, weights_only=False)
    text = table(result, args.world)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
