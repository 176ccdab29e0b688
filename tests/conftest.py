"""Test configuration: markers, the process-group teardown, the hypothesis profile, shared fixtures.

Markers (``--strict-markers``: a typo is an error):

- ``gpu``: needs CUDA; skipped where there is none (run them with ``pytest -m gpu`` on a GPU machine);
- ``distributed``: starts several processes (gloo on the CPU);
- ``slow``: takes more than ~15 s on 2 CPU cores (deselect with ``-m "not slow"`` for a quick loop);
- ``vllm``: against a real vLLM server from ``.venv-vllm`` (``scripts/install_vllm.sh``); skipped without it unless
  ``LIGHTNING_DTA_REQUIRE_VLLM=1`` (CI).

The README's test command runs everything that can run here.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings

from tests.helpers.models import make_model

# Property tests draw the same examples on every run (CI is deterministic); HYPOTHESIS_PROFILE=explore draws new
# ones each time, to look for counterexamples.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def destroy_process_group():
    """A test that leaves a default process group behind must not leak it into the next test."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def llama64() -> torch.nn.Module:
    return make_model("llama", torch.float64)
