"""After a DFS step on FSDP2-sharded weights every unit reshards after forward as it did before the step: the step
switches the setting off for its walk and its reduction (no collective in between), then gives each unit its own back.

One gloo process (the units' state is the same on any number of ranks). The reference is torch's own behaviour: the
same model, sharded the same way, with no step run. Sharded with ``fully_shard``'s default, FSDP2 chooses the root's
setting itself (no resharding after the root's forward, which its backward would gather again at once) and reshards
the decoder layers: the units differ, so a restore that only looked at the root, or set one value for all, fails.
(``DTAFSDPStrategy``'s explicit settings: tests/lightning/test_fsdp.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightning_dta as dta
from tests.helpers.lightning import grpo_rollouts, tiny_llama
from tests.helpers.tp import free_port

pytestmark = pytest.mark.distributed


def sharded_llama() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def sharded_after_forward(model: torch.nn.Module) -> list[bool]:
    """Whether each parameter is a DTensor shard after a forward (an unsharded unit holds plain full tensors)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 17, 33, 2]]))
    return [isinstance(p, DTensor) for p in model.parameters()]


def test_every_unit_reshards_after_forward_as_before_the_step() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    expected = sharded_after_forward(sharded_llama())
    assert True in expected and False in expected  # layers resharded, the root's embeddings, norm and head not
    model = sharded_llama()
    dta.tree_step_backward(model, dta.PrefixTree.from_rollouts(grpo_rollouts()))
    assert sharded_after_forward(model) == expected
