"""The peers of a tensor-parallel group walk the same trees, or stop at once (``peers_worker.py``, 2 gloo processes).

Peers walk one tree together, so the all-reduces inside each layer pair up only if their trees are equal: peers with
different trees hang until the collective timeout or train on wrong gradients. Three inputs could make them differ,
each checked here against what it must be by definition: the weights (peer 0's on every peer, a model built
unseeded included), the partition's calibration (the same measured times on every peer, whatever each peer's own
clock read), and the step itself (a digest compared before any walk; different steps stop every peer with every
digest named, in milliseconds, and a peer that does not come ends the wait after its bound).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_dta.distributed.peers import rollouts_digest
from tests import helpers
from tests.distributed.peers_worker import mismatch_steps
from tests.helpers.lightning import clean_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
REPLICATED = {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}  # vocab_parallel=False: whole


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One launch of the worker; each rank's record. About 30 s on 2 busy cores (most of it starting torch)."""
    out = tmp_path_factory.mktemp("peers")
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.peers_worker", str(out)], cwd=helpers.REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def digest_hex(rank: int) -> str:
    return f"{rollouts_digest(mismatch_steps(rank)[0]) & (2**64 - 1):016x}"


def test_weights_built_unseeded_differently_are_peer_zeros_after_setup(ranks: list[dict]) -> None:
    """Peer 1 built its Llama from seed 1, peer 0 from seed 0; after ``tensor_parallel`` every weight of every peer,
    the replicated embedding and head included, equals the seed-0 model's (before: peer 1 kept its own embedding and
    head, and the peers computed different logits from the same all-reduced activations)."""
    assert ranks[1]["weights"]["own_embedding_differs"] and not ranks[0]["weights"]["own_embedding_differs"]
    for rank in ranks:
        assert REPLICATED <= set(rank["weights"]["replicated"])
        assert rank["weights"]["differing"] == []


def test_calibration_sees_the_same_times_on_every_peer(ranks: list[dict]) -> None:
    """Peer 1's clock runs 10% fast; the times each data module observes are, per step, the slowest peer's own walk
    time on both peers, and the fitted cost models are equal (before: each peer fitted its own times, and the
    partitions of a larger run drift apart: peer 0 trained 6 rollouts where peer 1 trained 7, at step 53)."""
    own = [rank["calibration"]["own"] for rank in ranks]
    assert all(a != b for a, b in zip(*own))  # the peers' own clocks disagree at every step
    expected = [[max(a, b)] for a, b in zip(*own)]
    for rank in ranks:
        assert rank["calibration"]["observed"] == expected
    assert ranks[0]["calibration"]["cost_model"] == ranks[1]["calibration"]["cost_model"]


def test_different_trees_stop_both_peers_naming_both_digests(ranks: list[dict]) -> None:
    """Each peer's data module is fed another step: both stop before any walk, each naming both digests (computed
    here from the rollouts), the step and the fix, within the check's single all-gather (no collective timeout)."""
    for rank in ranks:
        found = rank["mismatch"]
        assert found["error"] is not None, found
        assert "step 0 of the source" in found["error"] and "Fix:" in found["error"]
        assert f"rank 0: {digest_hex(0)}" in found["error"] and f"rank 1: {digest_hex(1)}" in found["error"]
        assert found["seconds"] < 10


def test_colocated_generations_that_differ_stop_both_peers(ranks: list[dict]) -> None:
    """A colocated online source whose generator answers differently on each peer: both peers stop when the step is
    gathered, before the data module partitions it, naming the generation."""
    errors = [rank["online"]["error"] for rank in ranks]
    assert all(e is not None and "as each tensor-parallel peer generated it" in e for e in errors), errors
    assert "rank 0: " in errors[0] and "rank 1: " in errors[0]
    assert errors[0].replace("seen from rank 0", "seen from rank 1") == errors[1]  # the same digests on both


def test_a_peer_that_does_not_come_ends_the_wait_after_its_bound(ranks: list[dict]) -> None:
    """Peer 0 waits 0.5 s for a peer that comes 1.5 s later: it stops after its bound, with the ranks it waited
    for; the late peer's check completes the abandoned exchange (same rollouts: no error)."""
    late = ranks[0]["timeout"]
    assert late["error"] is not None and "waited 0.5 s" in late["error"] and "ranks [0, 1]" in late["error"]
    assert 0.5 <= late["seconds"] < 1.4
    assert ranks[1]["timeout"]["error"] is None
