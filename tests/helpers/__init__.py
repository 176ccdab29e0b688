"""Helpers shared by the tests: tiny models, rollouts, the per-rollout reference, Lightning and RL pieces."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root: configs/, data/, examples/
