"""The digest tensor-parallel peers compare each step (``lightning_dta/distributed/peers.py``), on one process: equal
for equal rollouts however they are held, different as soon as anything the peers would walk differs."""

from __future__ import annotations

import dataclasses

import torch

import lightning_dta as dta
from lightning_dta.distributed.peers import rollouts_digest


def step() -> list[dta.Rollout]:
    return [dta.Rollout(input_ids=[1, 5, 6, 7], loss_mask=[0, 0, 1, 1], advantages=0.5),
            dta.Rollout(input_ids=[1, 5, 8], loss_mask=None, advantages=[0.0, 0.1, -0.2])]


def test_equal_rollouts_have_one_digest_whatever_holds_them() -> None:
    tensors = [dataclasses.replace(r, input_ids=torch.tensor(r.input_ids)) for r in step()]
    assert rollouts_digest(step()) == rollouts_digest(tensors) == rollouts_digest(list(step()))
    assert rollouts_digest([]) == rollouts_digest([])


def test_anything_the_walk_reads_changes_the_digest() -> None:
    base = rollouts_digest(step())
    changed = []
    for change in (dict(input_ids=[1, 5, 6, 9]), dict(loss_mask=[0, 1, 1, 1]), dict(loss_mask=None),
                   dict(advantages=0.25), dict(advantages=[0.5, 0.5, 0.5, 0.5])):
        rollouts = step()
        rollouts[0] = dataclasses.replace(rollouts[0], **change)
        changed.append(rollouts_digest(rollouts))
    changed.append(rollouts_digest(step()[::-1]))  # another order: another walk
    changed.append(rollouts_digest(step()[:1]))  # a rollout fewer
    assert base not in changed and len(set(changed)) == len(changed)

