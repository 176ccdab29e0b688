"""OpenAICompatibleGenerator against a fake vLLM/SGLang server running in a thread (no real server)."""

from __future__ import annotations

import time

import pytest

from lightning_dta.rl import OnlineRolloutSource, OpenAICompatibleGenerator, ReverseDigits
from lightning_dta.rl.server import ServerError
from tests.helpers.rl import tiny_policy
from tests.helpers.server import EOS, FakeServer


@pytest.mark.parametrize("style", ["token_ids", "token_id_strings"])
def test_completions_request_and_parsing(style):
    with FakeServer(style) as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", max_new_tokens=3, temperature=0.9, top_k=5,
                                              stop_token_ids=[13], weight_sync="none", max_concurrent_requests=2)
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        prompts = [[1, 4], [1, 5, 6], [1, 7, 8, 9], [1, 4]]
        completions = generator.generate(prompts, seed=[11, 12, 13, 14])
    assert [c.token_ids for c in completions] == [[5, 9, EOS], [7, 9, 7], [10, 9, EOS], [5, 9, EOS]]  # prompt order
    assert [c.finish_reason for c in completions] == ["stop", "length", "stop", "stop"]
    assert completions[0].logprobs == pytest.approx([-0.5, -0.6, -0.7])
    # one request per prompt, each with its own seed (two identical prompts under one seed would sample alike)
    assert sorted((tuple(body["prompt"]), body["seed"]) for _, body in server.requests) == \
        sorted((tuple(p), s) for p, s in zip(prompts, [11, 12, 13, 14]))
    path, first = next((p, b) for p, b in server.requests if b["seed"] == 11)
    assert path == "/v1/completions" and first["prompt"] == [1, 4]
    assert first["model"] == "tiny" and first["max_tokens"] == 3 and first["n"] == 1 and first["top_k"] == 5
    assert first["temperature"] == 0.9 and first["logprobs"] == 1 and first["stop_token_ids"] == [EOS, 13]
    assert first["return_tokens_as_token_ids"] and first["return_token_ids"] and not first["skip_special_tokens"]


def test_text_only_tokens_and_server_failures_are_refused_with_the_fix():
    with FakeServer("text") as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="none")
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        with pytest.raises(ServerError, match="not as ids.*return_tokens_as_token_ids"):
            generator.generate([[1, 4]], seed=0)
    with FakeServer("error") as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="none", retry_backoff_sec=0.01)
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        with pytest.raises(ServerError, match="HTTP 500: CUDA out of memory"):
            generator.generate([[1, 4]], seed=0)
    unreachable = OpenAICompatibleGenerator("http://127.0.0.1:9", "tiny", weight_sync="none", timeout=5,
                                            retry_backoff_sec=0.01)
    unreachable.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
    with pytest.raises(ServerError, match="cannot reach"):
        unreachable.generate([[1, 4]], seed=0)
    with pytest.raises(ValueError, match="no weight_sync"):
        OpenAICompatibleGenerator("http://x", "tiny").attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0,
                                                            share_weights=False)
    with pytest.raises(ValueError, match="weight_dir"):
        OpenAICompatibleGenerator("http://x", "tiny", weight_sync="sglang-disk")


def test_sglang_disk_weight_sync_after_every_step(tmp_path):
    """The policy is saved per version and the server is asked to reload it: at attach, and after each step, with
    SGLang's radix-cache flush asked for explicitly (its default, but a server's default is not a guarantee)."""
    policy = tiny_policy()
    with FakeServer() as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", max_new_tokens=3, weight_sync="sglang-disk",
                                              weight_dir=str(tmp_path))
        source = OnlineRolloutSource(ReverseDigits(), generator, prompts_per_step=2, samples_per_prompt=2)
        source.attach(policy)
        rollouts = source.next_step()
        source.update_policy(policy, 1)
    reloads = [body["model_path"] for path, body in server.requests if path == "/update_weights_from_disk"]
    assert reloads == [str(tmp_path / "version_0"), str(tmp_path / "version_1")]
    assert all(body["flush_cache"] is True for path, body in server.requests if path == "/update_weights_from_disk")
    assert (tmp_path / "version_1" / "config.json").exists() and generator.version == 1
    assert len(rollouts) == 4 and all(r.input_ids[-1] in (EOS, 7) for r in rollouts)


def test_a_callable_weight_sync_gets_each_version():
    seen = []
    with FakeServer() as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync=lambda model, v: seen.append(v))
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        generator.update_weights(tiny_policy(), 4)
    assert seen == [0, 4]


def test_transient_failures_are_retried_with_backoff_then_stop_with_the_servers_message():
    with FakeServer(failures=2) as server:  # two 503s, then answers
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="none", max_retries=3,
                                              retry_backoff_sec=0.05)
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        start = time.perf_counter()
        (completion,) = generator.generate([[1, 4]], seed=0)
        waited = time.perf_counter() - start
    assert completion.token_ids == [5, 9, EOS] and len(server.requests) == 3
    assert waited >= 0.05 + 0.1  # backoff 0.05 s, then 0.1 s
    with FakeServer("error") as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="none", max_retries=2,
                                              retry_backoff_sec=0.01)
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        with pytest.raises(ServerError, match=r"HTTP 500: CUDA out of memory \(gave up after 3 attempts"):
            generator.generate([[1, 4]], seed=0)
    assert len(server.requests) == 3
    with FakeServer(failures=5, failure_code=400) as server:  # a bad request is not retried
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="none", retry_backoff_sec=0.01)
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        with pytest.raises(ServerError, match="HTTP 400"):
            generator.generate([[1, 4]], seed=0)
    assert len(server.requests) == 1


def test_a_choice_without_token_ids_is_refused_whatever_else_it_holds():
    """Text without any token: refused as tokens-as-text (``all([])`` used to let it through as 0 tokens); empty
    token lists beside text: refused, not an empty completion; nothing at all: refused as no tokens."""
    generator = OpenAICompatibleGenerator("http://x", "tiny", weight_sync="none")
    with pytest.raises(ServerError, match="returned its tokens as text \\(only text: 'hello'\\)"):
        generator._parse_choice({"text": "hello", "logprobs": {"token_logprobs": [-0.5]}}, 0)
    with pytest.raises(ServerError, match="returned text \\('hello'\\) but no token ids"):
        generator._parse_choice({"text": "hello", "token_ids": [], "logprobs": {"token_logprobs": []}}, 0)
    with pytest.raises(ServerError, match="returned no tokens"):
        generator._parse_choice({"text": "", "logprobs": {}}, 0)
    empty = generator._parse_choice({"text": "", "token_ids": [], "logprobs": {"token_logprobs": []}}, 0)
    assert empty.token_ids == []  # an empty completion with no text is what it says


def test_vllm_weight_sync_reloads_then_resets_the_prefix_cache_at_attach_and_after_every_step(tmp_path):
    """Each version: saved, reloaded over /collective_rpc from its absolute path, then the prefix cache reset (in
    that order: a cache reset before the reload would keep the keys/values computed in between)."""
    policy = tiny_policy()
    with FakeServer(device="cuda") as server:  # tiny_policy's head_dim 8: a GPU server's
        generator = OpenAICompatibleGenerator(server.url, "tiny", max_new_tokens=3, weight_sync="vllm",
                                              weight_dir=str(tmp_path))
        generator.attach(policy, eos_token_id=EOS, pad_token_id=0, share_weights=False)
        generator.update_weights(policy, 1)
    posts = [(path, body) for path, body in server.requests if path in ("/collective_rpc", "/reset_prefix_cache")]
    assert posts == [
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "version_0")}}),
        ("/reset_prefix_cache", {}),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "version_1")}}),
        ("/reset_prefix_cache", {}),
    ]
    assert (tmp_path / "version_1" / "model.safetensors").exists()


def test_vllm_cache_reset_is_retried_while_refused_then_stops_with_the_fix(tmp_path):
    """vLLM answers a reset that requests in flight block with HTTP 200 and {"success": false}: read, retried."""
    with FakeServer(reset_refusals=3, device="cuda") as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="vllm", weight_dir=str(tmp_path))
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
    assert [p for p, _ in server.requests].count("/reset_prefix_cache") == 4  # 3 refused, then reset
    with FakeServer(reset_refusals=10**6, device="cuda") as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="vllm", weight_dir=str(tmp_path))
        generator.cache_reset_wait_sec = 0.5
        with pytest.raises(ServerError, match=r"version 0 but did not reset its prefix cache.*\{'success': False\}"
                                              r".*old weights\. Fix: "):
            generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)


def test_vllm_sync_refuses_a_server_without_dev_mode_another_model_name_or_a_cpu_head_size(tmp_path):
    """Checked at attach, before any weights are written: one message with the server setting to change."""
    def attach(server, model="tiny", policy=None):
        generator = OpenAICompatibleGenerator(server.url, model, weight_sync="vllm", weight_dir=str(tmp_path))
        generator.attach(policy or tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)

    with FakeServer(dev_mode=False) as server:
        with pytest.raises(ServerError, match=r"/collective_rpc.*HTTP 404.*Fix: start the server with "
                                              "VLLM_SERVER_DEV_MODE=1"):
            attach(server)
    with FakeServer() as server:
        with pytest.raises(ServerError, match=r"serves \['tiny'\], not model='toy'. Fix: model: tiny"):
            attach(server, model="toy")
        head_dim = tiny_policy().config.head_dim
        assert head_dim not in (32, 64)
        with pytest.raises(ServerError, match=f"head_dim is {head_dim}.*CPU attention.*Fix: "):
            attach(server)
    with FakeServer(device="cuda") as server:  # a GPU server takes other head sizes: not refused here
        attach(server)  # only this attach got as far as writing a version
    assert [p.name for p in tmp_path.iterdir()] == ["version_0"]
