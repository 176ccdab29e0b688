"""``DTAFSDPStrategy(walk_gradient_dtype="bfloat16")``: under bfloat16 weights the walk's unsharded gradient is kept in
bfloat16 (2 bytes per parameter instead of float32's 4), and the error this costs against float32 accumulation.

One gloo process in this one (FSDP2 over a 1-rank data-parallel dimension: the walk's buffers are those of any
data-parallel size), the package's step on the strategy's layout, through ``benchmarks/tp_memory.py`` (which prints
the same table for a larger model on 2 ranks). The bfloat16 accumulation must differ from the float32 one (else the
option did nothing) and stay within a few bfloat16 roundings of it: measured 2.1e-3 relative over the whole
gradient, worst tensor 3.2e-3 (bfloat16 has 8 significant bits: one rounding is up to 3.9e-3).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from tests import helpers
from tests.helpers.tp import free_port

pytestmark = pytest.mark.distributed


def tp_memory():
    spec = importlib.util.spec_from_file_location("tp_memory", helpers.REPO / "benchmarks" / "tp_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bfloat16_walk_gradient_halves_the_gradient_held_and_its_error_is_reported() -> None:
    bench = tp_memory()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    result = bench.measure(bench.model_config(layers=2, hidden=64, vocab=256), rollouts=8)
    print("\n" + bench.table(result, 1))
    fp32, bf16 = result["records"]["float32"], result["records"]["bfloat16"]
    assert fp32["parameter_dtype"] == bf16["parameter_dtype"] == str(torch.bfloat16)
    assert fp32["gradient_dtypes"] == [str(torch.float32)] and bf16["gradient_dtypes"] == [str(torch.bfloat16)]
    n = fp32["parameters"]
    assert fp32["weights"] == bf16["weights"] == 2 * n  # the unsharded bfloat16 weights
    assert fp32["gradient"] == 4 * n and bf16["gradient"] == 2 * n  # 4 -> 2 bytes per parameter
    assert fp32["loss"] == bf16["loss"]  # the same forward: only the accumulation differs
    assert 1e-4 < result["relative_error"] < 1e-2, result["relative_error"]  # measured 2.1e-3
    assert result["worst_parameter_error"] < 2e-2, (result["worst_parameter_error"], result["worst_parameter"])
