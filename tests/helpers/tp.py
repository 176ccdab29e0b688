"""Shared pieces of the tensor-parallel tests (tests/distributed/): launching gloo processes from a worker script,
the rollouts the TP matrix walks, whole gradients of tensor-parallel models and their comparison with one process.

A worker (``python -m tests.distributed.<worker>``) calls :func:`launch` with a function of ``(rank, world, *args)``;
every process joins a gloo group with a short collective timeout, so a desynchronised walk fails in minutes
instead of hanging for half an hour, and a rank that raises ends the whole job (its peers would wait forever).
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import lightning_dta as dta
from tests.helpers.models import VOCAB, make_rollout, random_tree_rollouts
from tests.helpers.reference import ZERO_FLOOR

COLLECTIVE_TIMEOUT_S = 180  # a collective that waits longer is a hang (a walk out of step on its TP peers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a peer blocked in a collective would wait for this rank forever
    dist.destroy_process_group()


def launch(fn: Callable, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo processes (raises if any of them fails)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


def tp_mesh(world: int):
    """The 1-D mesh named ``tensor_parallel`` over every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("tensor_parallel",))


def critic_from(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``dta.value_model(model)`` with a random head (the default zero head gives every position the same value)."""
    critic = dta.value_model(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = critic.get_output_embeddings().weight
        weight.copy_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * 0.5)
    return critic


def tree_rollouts(seed: int = 1, n: int = 10) -> list[dta.Rollout]:
    """Branching at several depths, duplicates and strict prefixes; behaviour log-probs far from the model's."""
    return random_tree_rollouts(random.Random(seed), num_rollouts=n)


def untrained_prefix_rollouts(seed: int = 3, groups: int = 2, samples: int = 3) -> list[dta.Rollout]:
    """Prompts that are never trained (loss mask 0) shared by a group, and a shared untrained 'tool output' after
    the first turn: inner nodes whose pop is seeded by key/value gradients only (no loss of their own)."""
    rng = random.Random(seed)
    rollouts = []
    for _ in range(groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(6, 10))]
        turn = [rng.randrange(VOCAB) for _ in range(4)]
        for s in range(samples):
            tail = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 7))]
            ids = prompt + turn + tail if s < samples - 1 else prompt + tail
            rollout = make_rollout(rng, ids)
            rollout.loss_mask = [0] * (len(ids) - len(tail)) + [1] * len(tail)
            rollouts.append(rollout)
    return rollouts


def near_policy_rollouts(model: torch.nn.Module, rollouts: list[dta.Rollout], noise: float, seed: int
                         ) -> list[dta.Rollout]:
    """``rollouts`` with behaviour log-probs = the (plain) model's own plus noise and no proximal ones: token and
    sequence (GSPO) ratios lie near 1, so a tight clip range catches some tokens or rollouts and not others."""
    rng = random.Random(seed)
    current = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts))
    out = []
    for rollout, logp in zip(rollouts, current):
        old = [0.0] + [min(0.0, float(v) + rng.gauss(0, noise)) for v in logp]
        out.append(dta.Rollout(input_ids=list(rollout.input_ids), loss_mask=list(rollout.loss_mask),
                               advantages=rollout.advantages, old_logprobs=old, ref_logprobs=rollout.ref_logprobs))
    return out


def critic_rollouts(rollouts: list[dta.Rollout], seed: int = 5) -> list[dta.Rollout]:
    """The same token trees with returns and old values for ``ValueLoss`` (value clipping active)."""
    rng = random.Random(seed)
    return [dta.Rollout(input_ids=list(r.input_ids), loss_mask=list(r.loss_mask),
                        returns=[0.0] + [rng.gauss(0, 1) for _ in range(len(r) - 1)],
                        old_values=[0.0] + [rng.gauss(0, 0.3) for _ in range(len(r) - 1)]) for r in rollouts]


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a DTensor's gathered: a collective, every rank calls it, same order)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = grad.detach().clone()
    return out


def worst_relative_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The worst per-parameter ``||a - e|| / max(||e||, ZERO_FLOOR * ||E||)`` (tests/helpers/reference.py's
    measure) and where; infinite when the parameter sets differ (a gradient missing on one side)."""
    if set(got) != set(expected):
        return float("inf"), f"parameter sets differ: {sorted(set(got) ^ set(expected))[:4]}"
    total = float(torch.sqrt(sum(e.double().norm() ** 2 for e in expected.values())))
    worst, where = 0.0, ""
    for name, e in expected.items():
        scale = max(float(e.norm()), ZERO_FLOOR * total)
        error = float((got[name].double() - e.double()).norm())
        relative = error / scale if scale else (0.0 if error == 0 else float("inf"))
        if relative > worst:
            worst, where = relative, name
    return worst, where


def worst_list_error(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """Per-rollout outputs (log-probs, values): the worst max-abs difference relative to the rollout's largest."""
    return max(float((a - b).abs().max() / max(float(b.abs().max()), 1e-300)) if b.numel() else 0.0
               for a, b in zip(got, expected, strict=True))
