"""Which rollouts of a tree make the loss non-finite: the diagnosis of a skipped step, run only after one.

A step is skipped when its loss or gradient norm is not finite; the user needs the rollouts behind it, not a
NaN. One forward-only walk gives every token's log-prob; each rollout's loss terms are then evaluated on their
own (no gradient) and the rollouts with a non-finite term are named.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_dta.contracts import Objective
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.logprobs import tree_logprobs
from lightning_dta.engine.options import EngineOptions
from lightning_dta.engine.step_data import StepData


def nonfinite_rollouts(model: nn.Module, tree: PrefixTree, loss_fn: Objective,
                       engine: EngineOptions | None = None) -> list[int]:
    """Indices (in ``tree.rollouts``) of the rollouts with a non-finite loss term under the current weights.

    The entropy bonus is evaluated at zero entropy, i.e. left out: the walk keeps log-probs, not logits. A
    position's entropy lies in [0, log V] when its logits are finite, and a NaN or +inf logit makes the
    log-normaliser, so every log-prob at that position, non-finite: a non-finite log-prob counts on its own.
    """
    logprobs = tree_logprobs(model, tree, engine=engine)
    step = StepData(tree, loss_fn)
    if loss_fn.needs_sequence_ratio:
        step.set_current_logprobs(logprobs)
    bad = []
    for index, logp in enumerate(logprobs):
        targets = step.targets([index], 0, len(tree.rollouts[index]))
        if targets.empty:
            continue
        values = logp.detach().cpu()[targets.columns][None]  # position p predicts token p + 1: entry p
        if not bool(torch.isfinite(values).all()):
            bad.append(index)
            continue
        data = targets.data  # on the CPU: StepData's default device
        values = values.to(data.mask.dtype)
        no_entropy = torch.zeros_like(values)  # [1, L]: the bonus left out (docstring)
        term = loss_fn(values, no_entropy, data, dict.fromkeys(loss_fn.metric_sums, 0.0))
        if not math.isfinite(float(term)):
            bad.append(index)
    return bad
