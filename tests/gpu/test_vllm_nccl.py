"""``weight_sync="vllm-nccl"`` against a real vLLM GPU server. NEVER RUN YET (docs/rl.md): it needs two GPUs.

NCCL refuses two ranks of one communicator on one GPU, so the server gets a GPU of its own (the last visible one)
and the trainer uses ``cuda:0``; a one-GPU machine skips this with that reason. The server's environment is a
vLLM 0.32 for CUDA, named by ``LIGHTNING_DTA_VLLM_GPU_PYTHON`` (its python; vLLM's pins do not fit the trainer's
environment). The server starts with random weights (``--load-format dummy``), so only the NCCL sync can give it the
trainer's: its log-probs equal the trainer's forward afterwards (float32 both sides), for a prompt longer than a
KV block, and again after a second version (the prefix-cache reset).

The same glue runs on the CPU against the fake server over a gloo group (tests/rl/test_vllm_nccl.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch
import yaml
from torch import nn
from transformers import AutoModelForCausalLM

from lightning_dta.models import config_from_dict
from lightning_dta.rl import OpenAICompatibleGenerator
from tests.helpers import REPO, vllm_server

pytestmark = pytest.mark.gpu
PYTHON = "LIGHTNING_DTA_VLLM_GPU_PYTHON"
TOLERANCE = 1e-3  # float32 both sides; the CPU build measured 6e-6, GPU kernels reduce in other orders
CUDA = torch.device("cuda", 0)
CONFIG = REPO / "configs" / "toy_rl_vllm.yaml"
EOS = 2


def missing() -> str | None:
    """Why the test cannot run here (``None``: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.device_count() < 2:
        return "one GPU: NCCL refuses two ranks on one GPU, and the server needs its own besides the trainer's"
    if not os.environ.get(PYTHON):
        return f"{PYTHON} is not set (the python of an environment with vLLM 0.32 for CUDA)"
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[vllm_server.VLLMServer]:
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("vllm_gpu")
    model_dir = vllm_server.write_model(CONFIG, root / "model")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    server_gpu = (visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())])[-1]

    def command(port: int) -> list[str]:
        return [os.environ[PYTHON], "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", vllm_server.SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--enforce-eager", "--load-format", "dummy", "--max-model-len", "256",
                "--gpu-memory-utilization", "0.3", "--weight-transfer-config", '{"backend": "nccl"}']

    started = vllm_server.start(model_dir, root / "server.log", command=command,
                                env={"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": server_gpu})
    try:
        yield started
    finally:
        vllm_server.stop(started)


def toy_policy(seed: int) -> nn.Module:
    """The toy config's architecture with sharp random logits (as tests/rl/test_vllm_server.py's, whose module
    needs the CLI's dependencies, which the GPU image lacks)."""
    torch.manual_seed(seed)
    spec = yaml.safe_load(CONFIG.read_text())["model"]["model"] | {"initializer_range": 0.5}
    return AutoModelForCausalLM.from_config(config_from_dict(spec)).eval().to(CUDA)


def gap(policy: nn.Module, prompt: list[int], tokens: list[int], logprobs: list[float]) -> float:
    """The largest difference between the server's log-probs and ``policy``'s own forward's at the sampled tokens."""
    with torch.no_grad():
        reference = policy(torch.tensor([prompt + tokens], device=CUDA)).logits[0].float().log_softmax(-1)
    return max(abs(lp - reference[len(prompt) - 1 + i, t].item()) for i, (t, lp) in enumerate(zip(tokens, logprobs)))


def test_after_an_nccl_sync_the_server_samples_with_the_trainers_weights(server) -> None:
    old, new = toy_policy(1), toy_policy(2)
    client = OpenAICompatibleGenerator(server.url, vllm_server.SERVED_NAME, weight_sync="vllm-nccl", max_new_tokens=6)
    client.attach(old, eos_token_id=EOS, pad_token_id=0, share_weights=False)  # joins the group, sends version 0
    prompt = [1] + [4 + (3 * j) % 10 for j in range(199)]  # past a KV block: the prefix cache keeps it
    (first,) = client.generate([prompt], seed=5)
    assert gap(old, prompt, first.token_ids, first.logprobs) < TOLERANCE, server.log_tail()
    start = time.perf_counter()
    client.update_weights(new, 1)
    print(f"vllm-nccl sync of the toy policy: {1e3 * (time.perf_counter() - start):.1f} ms")
    (second,) = client.generate([prompt], seed=5)
    assert gap(new, prompt, second.token_ids, second.logprobs) < TOLERANCE, server.log_tail()
    assert gap(old, prompt, second.token_ids, second.logprobs) > 0.5  # the policies disagree: stale could not pass
