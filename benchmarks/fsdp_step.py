"""The DFS step on FSDP2-sharded weights: the two ways to reduce gradients, and the bytes each rank holds.

Part 1 (``--ranks 2``): the bench's GRPO and agent steps on a 4-layer, hidden-256 Llama, the SAME tree on every rank
(a reduce-scatter after every backward needs the same number of backwards everywhere, so it can only be timed that
way), two schemes side by side:

- ``deferred`` (what ``dta_fsdp`` runs): one all-gather per unit before the walk, gradients accumulated unsharded,
  one reduce-scatter per unit after it;
- ``per-backward``: the same unsharded walk, but FSDP reduce-scatters every unit after every backward.

It counts the collectives of one step, times the step (median of 5, after a warm-up) and the bytes of unsharded
gradient the deferred scheme keeps until the end of the walk.

Part 2 (``--ranks 1, 2, 4``): bytes of parameters, gradients and AdamW state each rank holds after an optimizer step
(storage of its shards, not RSS), against the replicated bytes.

    python benchmarks/fsdp_step.py --ranks 2 --out bench_out/fsdp_2.json
    python benchmarks/fsdp_step.py --ranks 4 --memory-only
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lightning_dta as dta
from lightning_dta.distributed.sharding import fsdp_units, reduce_gradients, shard, state_bytes, unsharded
from lightning_dta.shapes.models import build_model
from lightning_dta.shapes.workloads import AgentWorkload, GRPOWorkload

COUNTS = {"reduce_scatter": 0, "all_gather": 0}


def _count(name: str, function):
    def counted(*args, **kwargs):
        COUNTS[name] += 1
        return function(*args, **kwargs)
    return counted


def _patch_collectives() -> None:
    """Count FSDP2's collectives (it calls these functions of torch.distributed)."""
    import torch.distributed.distributed_c10d as c10d

    reduce_scatter = _count("reduce_scatter", c10d.reduce_scatter_single)
    all_gather = _count("all_gather", c10d.all_gather_single)
    for module in (dist, c10d):
        module.reduce_scatter_single, module.all_gather_single = reduce_scatter, all_gather


def _step(model, tree, loss_fn, scheme: str) -> None:
    model.zero_grad(set_to_none=True)
    root = fsdp_units(model)[0]
    if scheme == "deferred":
        with unsharded(model):
            dta.tree_backward(model, tree, loss_fn)
        reduce_gradients(model)
    else:  # the same unsharded walk, with FSDP's reduce-scatter after every backward
        with unsharded(model):
            root.set_requires_gradient_sync(True)
            dta.tree_backward(model, tree, loss_fn)
        for unit in fsdp_units(model):
            unit.reshard()


def _unsharded_gradient_bytes(model) -> int:
    """The full-size float32 gradient buffer the deferred scheme keeps during the walk."""
    return sum(p.numel() * 4 for p in model.parameters())


def _run(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    _patch_collectives()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    model = build_model(layers=4, hidden=256, heads=4, vocab=2048)
    replicated = sum(p.numel() * p.element_size() for p in model.parameters())
    full_gradient = _unsharded_gradient_bytes(model)
    shard(model, init_device_mesh("cpu", (world,)))
    loss_fn = dta.PolicyLoss()
    result = {"world_size": world}
    if not args.memory_only:
        for name, workload in {"grpo": GRPOWorkload(), "agent": AgentWorkload()}.items():
            tree = dta.PrefixTree.from_rollouts(workload.generate(2048, 0))
            for scheme in ("deferred", "per-backward"):
                _step(model, tree, loss_fn, scheme)  # warm-up
                times, counts = [], {}
                for _ in range(args.repeats):
                    before = dict(COUNTS)
                    dist.barrier()
                    start = time.perf_counter()
                    _step(model, tree, loss_fn, scheme)
                    times.append(time.perf_counter() - start)
                    counts = {k: COUNTS[k] - before[k] for k in COUNTS}
                result[f"{name}/{scheme}"] = {"median_s": statistics.median(times), "collectives": counts,
                                              "nodes": tree.stats.num_nodes}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tree = dta.PrefixTree.from_rollouts(GRPOWorkload(1, 2).generate(2048, 1))
    _step(model, tree, loss_fn, "deferred")
    optimizer.step()
    held = state_bytes(model, [optimizer])
    result["memory"] = {"held": held, "replicated_total": replicated * 4,  # params + grads + two AdamW moments
                        "unsharded_gradient_during_step": full_gradient, "unsharded_parameters_during_step":
                        replicated}
    if rank == 0:
        out.update(result)
    dist.destroy_process_group()


def _main(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    out: dict = {}
    _run(rank, world, port, args, out)
    if rank == 0:
        with open(path, "w") as handle:
            json.dump(out, handle, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--out", default="bench_out/fsdp_step.json")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_main, args=(args.ranks, port, args, args.out), nprocs=args.ranks, join=True)
    with open(args.out) as handle:
        result = json.load(handle)
    memory = result["memory"]
    held, whole = memory["held"], memory["replicated_total"]
    during = memory["unsharded_parameters_during_step"], memory["unsharded_gradient_during_step"]
    print(f"{args.ranks} ranks: each holds {held['total'] / 2**20:.2f} MiB of parameters + gradients + AdamW state "
          f"({held['total'] / whole:.3f} of the replicated {whole / 2**20:.2f} MiB); during a step also "
          f"{during[0] / 2**20:.2f} MiB of unsharded parameters and {during[1] / 2**20:.2f} MiB of unsharded "
          "float32 gradient")
    for key, value in result.items():
        if "/" in key:
            print(f"  {key:<20} {value['median_s'] * 1000:8.1f} ms   collectives {value['collectives']}   "
                  f"({value['nodes']} tree nodes)")


if __name__ == "__main__":
    main()
