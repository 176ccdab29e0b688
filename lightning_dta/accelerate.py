"""DFS steps in a Hugging Face Accelerate training loop.

``accelerator.prepare`` wraps the model in ``DistributedDataParallel`` on several processes. DDP reduces
gradients from autograd hooks that it arms in its own ``forward``; a DFS step runs one backward per tree node,
so going through the wrapper would all-reduce once per node. :func:`accelerate_tree_backward` therefore runs the
DFS on the unwrapped model under ``accelerator.no_sync`` (the wrapper's hooks stay disarmed) and then sums the
gradients over processes once, in flattened buckets, after an all-reduce of the step's loss normaliser, exactly
as :class:`~lightning_dta.DTAStrategy` does in Lightning. The loop keeps its usual shape::

    model, optimizer = accelerator.prepare(model, optimizer)
    for tree in trees:                                   # this process's tree of each step (or None)
        out = accelerate_tree_backward(accelerator, model, tree, loss_fn)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

One call is one whole optimizer step: do not wrap it in ``accelerator.accumulate`` (that would skip the
optimizer step while the gradients are already summed). Supported: a single process, DDP on CPU (gloo) and GPU
(NCCL), and FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``): the sharded model runs the DFS step of
:mod:`lightning_dta.distributed.sharding` (one all-gather per unit, no collective during the walk, one
reduce-scatter per
unit, summed). FSDP1 and DeepSpeed ZeRO keep partial gradients the step cannot sum and are refused, as is fp16
loss scaling, which ``accelerator.backward`` applies and a DFS step does not call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.sharding import is_sharded, sum_over_ranks
from lightning_dta.distributed.step import StepOutput, gradient_norm, tree_step_backward
from lightning_dta.engine import EngineOptions

if TYPE_CHECKING:
    from accelerate import Accelerator

SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP")


def accelerate_tree_backward(accelerator: Accelerator, model: nn.Module, tree: PrefixTree | None,
                             loss_fn: PolicyLoss | None = None, *, engine: EngineOptions | None = None) -> StepOutput:
    """Add the whole step's gradient (all processes) to ``.grad`` of every process; call it on every process.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the prepared model (DDP-wrapped or not).
        tree: this process's share of the step (``None``: it still joins every collective).
        loss_fn: the policy loss (default ``PolicyLoss()``).
        engine: the :class:`~lightning_dta.EngineOptions` of the step (default ``EngineOptions()``).

    Returns:
        Step-wide metrics, identical on every process; ``grad_norm`` is the norm of the summed gradient.
    """
    # Accelerate's enum has a name; older releases gave a string
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in SUPPORTED:
        raise NotImplementedError(f"accelerate_tree_backward supports {SUPPORTED}, not {kind}: its partial "
                                  "gradients cannot be summed by the step. Fix: DDP (accelerate launch --multi_gpu) or "
                                  "FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2))")
    # optional library feature: only mixed-precision plugins have a grad scaler
    if getattr(accelerator, "scaler", None) is not None:
        raise RuntimeError("fp16 mixed precision scales the loss inside accelerator.backward, which a DFS step does "
                           "not call. Fix: mixed_precision='bf16' or 'no'.")
    fsdp1 = NotImplementedError("accelerate_tree_backward supports FSDP2 only: FSDP1's flat parameters keep partial "
                                "gradients the step cannot sum. Fix: FullyShardedDataParallelPlugin(fsdp_version=2)")
    # optional library feature: Accelerate's state and its FSDP plugin exist only under FSDP
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    # optional library feature: Accelerate's state and its FSDP plugin exist only under FSDP
    if kind == "FSDP" and getattr(plugin, "fsdp_version", 1) != 2:
        raise fsdp1
    inner = accelerator.unwrap_model(model)
    if kind == "FSDP":
        if not is_sharded(inner):
            raise fsdp1
        sum_over_ranks(inner)
        out = tree_step_backward(inner, tree, loss_fn, engine=engine)
    else:
        with accelerator.no_sync(model):
            out = tree_step_backward(inner, tree, loss_fn, engine=engine)
    out.grad_norm = gradient_norm(inner.parameters())
    return out
