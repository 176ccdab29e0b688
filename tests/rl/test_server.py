"""OpenAICompatibleGenerator against a fake vLLM/SGLang server running in a thread (no real server)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lightning_dta.rl import OnlineRolloutSource, OpenAICompatibleGenerator, ReverseDigits
from lightning_dta.rl.server import ServerError
from tests.helpers.rl import tiny_policy

EOS = 2


class FakeServer:
    """Answers /v1/completions with scripted choices and /update_weights_from_disk like SGLang; records requests.

    ``style``: ``"token_ids"`` (vLLM ``return_token_ids``), ``"token_id_strings"`` (``"token_id:N"`` tokens),
    ``"text"`` (tokens as text only), ``"error"`` (HTTP 500).
    """

    def __init__(self, style: str = "token_ids") -> None:
        self.style = style
        self.requests: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.path, body))
                if fake.style == "error":
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"CUDA out of memory")
                    return
                reply = fake.weights(body) if self.path == "/update_weights_from_disk" else fake.complete(body)
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def complete(self, body: dict) -> dict:
        choices = []
        for index, prompt in enumerate(body["prompt"]):
            # prompt-dependent output: the last prompt token + 1, then EOS for even-length prompts
            tokens = [prompt[-1] + 1, 9] + ([EOS] if len(prompt) % 2 == 0 else [7])
            logprobs = [-0.5 - 0.1 * k for k in range(len(tokens))]
            choice = {"index": index, "text": "ignored", "finish_reason": "stop" if tokens[-1] == EOS else "length",
                      "logprobs": {"token_logprobs": logprobs, "top_logprobs": [{}] * len(tokens)}}
            if self.style == "token_ids":
                choice["token_ids"] = tokens
                choice["logprobs"]["tokens"] = [str(t) for t in tokens]
            elif self.style == "token_id_strings":
                choice["logprobs"]["tokens"] = [f"token_id:{t}" for t in tokens]
            else:
                choice["logprobs"]["tokens"] = ["a"] * len(tokens)
            choices.append(choice)
        return {"id": "cmpl-1", "object": "text_completion", "choices": list(reversed(choices))}

    def weights(self, body: dict) -> dict:
        return {"success": Path(body["model_path"], "config.json").exists(), "message": "loaded"}

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.mark.parametrize("style", ["token_ids", "token_id_strings"])
def test_completions_request_and_parsing(style):
    with FakeServer(style) as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", max_new_tokens=3, temperature=0.9, top_k=5,
                                              stop_token_ids=[13], weight_sync="none", max_prompts_per_request=2)
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        completions = generator.generate([[1, 4], [1, 5, 6], [1, 7, 8, 9]], seed=11)
    assert [c.token_ids for c in completions] == [[5, 9, EOS], [7, 9, 7], [10, 9, EOS]]  # answers in prompt order
    assert [c.finish_reason for c in completions] == ["stop", "length", "stop"]
    assert completions[0].logprobs == pytest.approx([-0.5, -0.6, -0.7])
    (path, first), (_, second) = server.requests
    assert path == "/v1/completions" and first["prompt"] == [[1, 4], [1, 5, 6]] and second["prompt"] == [[1, 7, 8, 9]]
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
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync="none")
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        with pytest.raises(ServerError, match="HTTP 500: CUDA out of memory"):
            generator.generate([[1, 4]], seed=0)
    unreachable = OpenAICompatibleGenerator("http://127.0.0.1:9", "tiny", weight_sync="none", timeout=5)
    unreachable.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
    with pytest.raises(ServerError, match="cannot reach"):
        unreachable.generate([[1, 4]], seed=0)
    with pytest.raises(ValueError, match="no weight_sync"):
        OpenAICompatibleGenerator("http://x", "tiny").attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0,
                                                            share_weights=False)
    with pytest.raises(ValueError, match="weight_dir"):
        OpenAICompatibleGenerator("http://x", "tiny", weight_sync="sglang-disk")


def test_sglang_disk_weight_sync_after_every_step(tmp_path):
    """The policy is saved per version and the server is asked to reload it: at attach, and after each step."""
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
    assert (tmp_path / "version_1" / "config.json").exists() and generator.version == 1
    assert len(rollouts) == 4 and all(r.input_ids[-1] in (EOS, 7) for r in rollouts)


def test_a_callable_weight_sync_gets_each_version():
    seen = []
    with FakeServer() as server:
        generator = OpenAICompatibleGenerator(server.url, "tiny", weight_sync=lambda model, v: seen.append(v))
        generator.attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
        generator.update_weights(tiny_policy(), 4)
    assert seen == [0, 4]
