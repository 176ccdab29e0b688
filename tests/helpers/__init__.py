"""Helpers shared by the tests: tiny models, rollouts, the per-rollout reference, Lightning and RL pieces."""

import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root: configs/, data/, examples/


def free_port() -> int:
    """A TCP port nothing listens on now (for a test's own process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
