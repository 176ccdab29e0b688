"""The two peers of one tensor-parallel group (data-parallel size 1) on 2 gloo processes: what ``test_tp_peers.py``
checks, recorded per rank in ``{out}/rank{r}.json``.

1. ``weights``: a Llama built unseeded differently on each peer (``seed=rank``; ``vocab_parallel=False`` keeps the
   embedding and head whole) is parallelized; every weight, whole, is compared with the seed-0 model's.
2. ``calibration``: three steps through a ``RolloutDataModule(calibrate_cost_model=True)`` and ``tree_step_backward``,
   the same steps on both peers, with peer 1's clock running 10% fast (a slower GPU, noise); per step the times the
   data module observes, each peer's own walk time, and the fitted cost model at the end.
3. ``mismatch``: the data module fed a different step on each peer.
4. ``online``: a colocated ``OnlineRolloutSource`` whose generator answers differently on each peer.
5. ``timeout``: peer 0 checks with a 0.5 s bound while peer 1 arrives 1.5 s later.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import time
import types
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import lightning_dta as dta
import lightning_dta.distributed.step as step_module
from lightning_dta.contracts import ParallelLayout, TensorParallelism
from lightning_dta.core.balance import CostCalibrator
from lightning_dta.distributed.peers import TensorParallelMismatch, check_peers_agree
from lightning_dta.distributed.tensor_parallel import tensor_parallel
from lightning_dta.lightning.data import RolloutDataModule
from lightning_dta.rl import OnlineRolloutSource, ReverseDigits
from tests.helpers import tp as H
from tests.helpers.models import make_model
from tests.helpers.rl import ScriptedGenerator, tiny_policy

CLOCK_SKEW = 1.1  # peer 1's clock: its measured walk times are 10% longer


def mismatch_steps(rank: int) -> list[list[dta.Rollout]]:
    """The step each peer is fed in the ``mismatch`` case (a different one per peer)."""
    return [H.tree_rollouts(seed=10 + rank, n=6)]


def calibration_steps() -> list[list[dta.Rollout]]:
    """Three steps of growing size (the calibration below fits from three observations whose work differs)."""
    return [H.tree_rollouts(seed=20 + s, n=2 + s) for s in range(3)]


def online_replies(rank: int) -> list[list[int]]:
    return [[5, 2]] if rank == 0 else [[6, 2]]


def datamodule(source, layout: ParallelLayout, **kwargs) -> RolloutDataModule:
    """A data module under a stand-in trainer whose strategy offers ``layout`` (no Trainer, no Lightning loop)."""
    dm = RolloutDataModule(source=source, **kwargs)
    dm.trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(parallel_layout=layout))
    return dm


class Clock:
    """Stands in for ``time`` in the step module: records the walk's start and end, ``skew`` times the real clock."""

    def __init__(self, skew: float) -> None:
        self.skew, self.calls = skew, []

    def perf_counter(self) -> float:
        self.calls.append(time.perf_counter() * self.skew)
        return self.calls[-1]


def error_of(call) -> dict:
    start = time.perf_counter()
    try:
        call()
    except TensorParallelMismatch as error:
        return {"error": str(error), "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def main(rank: int, world: int, out: str) -> None:
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("data_parallel", "tensor_parallel"))
    layout = ParallelLayout(data_parallel_group=mesh["data_parallel"].get_group(), device_mesh=mesh,
                            tensor_parallelism=TensorParallelism(world, vocab_parallel=False))
    record: dict = {}

    # 1. weights
    model = make_model("llama", seed=rank)
    reference = dict(make_model("llama", seed=0).named_parameters())
    own_embedding_differs = not torch.equal(model.get_input_embeddings().weight, reference["model.embed_tokens.weight"])
    tensor_parallel(model, mesh["tensor_parallel"], vocab_parallel=False)
    record["weights"] = {
        "own_embedding_differs": own_embedding_differs,
        "replicated": sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor)),
        "differing": sorted(n for n, p in model.named_parameters()
                            if not torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, reference[n]))}

    # 2. calibration
    clock = Clock(CLOCK_SKEW if rank == 1 else 1.0)
    step_module.time = clock
    dm = datamodule(calibration_steps(), layout, calibrate_cost_model=True)
    dm.calibrator = CostCalibrator(min_observations=3)  # a fit after three steps (default six: a slower test)
    observed, own = [], []
    for batch in dm.train_dataloader():
        clock.calls.clear()
        result = dta.tree_step_backward(model, batch.tree, layout=layout)
        own.append(clock.calls[1] - clock.calls[0])
        observed.append(result.rank_seconds)
        dm.observe_step(batch, result.rank_seconds)
    step_module.time = time
    record["calibration"] = {"observed": observed, "own": own, "cost_model": dataclasses.asdict(dm.cost_model)}

    # 3. mismatch
    dm = datamodule(mismatch_steps(rank), layout)
    record["mismatch"] = error_of(lambda: next(iter(dm.train_dataloader())))

    # 4. online
    source = OnlineRolloutSource(ReverseDigits(), ScriptedGenerator(online_replies(rank)), prompts_per_step=2,
                                 samples_per_prompt=2, placement="colocated")
    source.attach(tiny_policy(), layout=layout)
    record["online"] = error_of(source.next_rollouts)

    # 5. timeout: peer 1 arrives late, and its all-gather completes peer 0's abandoned one (same rollouts: no error)
    peers = layout.tensor_parallel_group
    rollouts = mismatch_steps(0)[0]
    if rank == 0:
        record["timeout"] = error_of(lambda: check_peers_agree(rollouts, peers, "the late peer",
                                                               timeout=datetime.timedelta(seconds=0.5)))
    else:
        time.sleep(1.5)
        record["timeout"] = error_of(lambda: check_peers_agree(rollouts, peers, "the late peer"))
    torch.distributed.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    H.launch(main, 2, sys.argv[1])
