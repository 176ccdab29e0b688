"""``weight_sync="vllm-nccl"`` against the fake server, with a gloo group in place of NCCL (no GPU here).

What the client must do (vLLM 0.32's weight-transfer routes, :mod:`lightning_dta.rl.vllm_nccl`): join the workers'
group once, then per version announce the metadata, broadcast every parameter while that call is in flight,
finish, and reset the prefix cache; and refuse, with the fix, a set-up where that cannot work. References come
from the policy itself: ``named_parameters()`` is the list vLLM's ``load_weights`` takes.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dta.core.errors import ConfigError
from lightning_dta.rl import OpenAICompatibleGenerator
from lightning_dta.rl.server import ServerError
from tests.helpers.channels import GlooChannel, RecordingChannel
from tests.helpers.rl import tiny_policy
from tests.helpers.server import EOS, FakeServer

SYNC = ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]


def attach(generator: OpenAICompatibleGenerator, policy: torch.nn.Module) -> None:
    generator.attach(policy, eos_token_id=EOS, pad_token_id=0, share_weights=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_version_announces_the_metadata_then_broadcasts_every_tensor_bitwise_then_resets_the_cache(dtype):
    policy = tiny_policy().to(dtype)
    with FakeServer(device="cuda", weight_transfer="nccl") as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="vllm-nccl", weight_channel=GlooChannel)
        attach(generator, policy)
        version_0 = {name: p.detach().clone() for name, p in policy.named_parameters()}
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p))
        generator.update_weights(policy, 1)
    posts = [(path, body) for path, body in server.requests if path != "/v1/completions"]
    assert [path for path, _ in posts] == ["/init_weight_transfer_engine", *SYNC, *SYNC]  # the group: joined once
    init_info = posts[0][1]["init_info"]
    assert init_info == {"master_address": "127.0.0.1", "master_port": init_info["master_port"], "rank_offset": 1,
                         "world_size": 2, "packed": False}  # the trainer rank 0, the one worker rank 1
    params = list(policy.named_parameters())
    update_info = {"names": [name for name, _ in params], "dtype_names": [str(dtype).split(".")[1]] * len(params),
                   "shapes": [list(p.shape) for _, p in params]}
    assert [body for path, body in posts if path == "/update_weights"] == [{"update_info": update_info}] * 2
    assert [body for path, body in posts if path == "/finish_weight_update"] == [{"weight_version": "0"},
                                                                                {"weight_version": "1"}]
    assert [list(received) for received in server.received] == [update_info["names"]] * 2
    for received, expected in zip(server.received, [version_0, dict(params)], strict=True):
        for name, tensor in expected.items():  # bitwise: what the worker holds is the trainer's tensor
            assert received[name].dtype == dtype and torch.equal(received[name], tensor.detach()), name
    assert not torch.equal(server.received[0][params[0][0]], server.received[1][params[0][0]])


def test_a_failed_update_stops_with_the_servers_message_without_retrying_finishing_or_resetting():
    with FakeServer(device="cuda", weight_transfer="nccl", update_failure="CUDA out of memory in load_weights") \
            as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="vllm-nccl",
                                              weight_channel=RecordingChannel, retry_backoff_sec=0.01)
        with pytest.raises(ServerError, match=r"/update_weights failed with HTTP 500: .*CUDA out of memory in "
                                              r"load_weights.*\(not retried\)"):
            attach(generator, tiny_policy())
    assert [path for path, _ in server.requests] == ["/init_weight_transfer_engine", "/start_weight_update",
                                                     "/update_weights"]


def test_refusals_name_the_setting_to_change_before_any_transfer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # so the test means the same on a GPU machine
    with FakeServer(device="cuda", weight_transfer="nccl") as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="vllm-nccl")  # the NCCL channel
        with pytest.raises(ConfigError, match=r"broadcasts the weights over NCCL from a GPU, and this process has no "
                                              r"CUDA device\. Fix: weight_sync='vllm'"):
            attach(generator, tiny_policy())
    assert server.requests == [] and server.gets == []  # refused before asking the server anything
    monkeypatch.undo()

    cases = [  # (the server, what the message must say)
        (FakeServer(device="cuda", weight_transfer="nccl", dev_mode=False),
         r"needs the server's /init_weight_transfer_engine \(POST\).*HTTP 404.*Fix: start the server with "
         "VLLM_SERVER_DEV_MODE=1"),
        (FakeServer(device="cuda"),  # dev mode, but no --weight-transfer-config
         r"weight_transfer_config None \(every transfer call would fail\)\. Fix: start the server with "
         r"--weight-transfer-config '\{\"backend\": \"nccl\"\}'"),
        (FakeServer(device="cpu", weight_transfer="nccl"),
         r"runs vLLM's CPU build, whose weight transfer has no CPU path.*Fix: weight_sync='vllm'$"),
    ]
    for server, message in cases:
        with server:
            generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="vllm-nccl",
                                                  weight_channel=RecordingChannel)
            with pytest.raises(ServerError, match=message):
                attach(generator, tiny_policy())
        assert server.requests == []  # nothing posted: no group joined, no weights announced
