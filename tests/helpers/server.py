"""A fake vLLM/SGLang server in a thread: scripted completions, SGLang- and vLLM-style weight reloads (vLLM's
dev-mode endpoints, a prefix-cache reset that refuses while "requests hold blocks"), vLLM 0.32's weight-transfer
routes (receiving the tensors over a gloo group, as its workers do over NCCL), scripted failures."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from tests.helpers.channels import join_gloo

EOS = 2
TRANSFER_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                   "/finish_weight_update")
DEV_MODE_ROUTES = ("/collective_rpc", "/reset_prefix_cache", *TRANSFER_ROUTES)
# vLLM 0.32's NCCLWeightTransferInitInfo / NCCLWeightTransferUpdateInfo fields: anything else is refused
INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
               "packed_buffer_size_bytes", "packed_num_buffers"}
UPDATE_FIELDS = {"names", "dtype_names", "shapes"}


class FakeServer:
    """Answers /v1/completions with scripted choices and /update_weights_from_disk like SGLang; records requests.

    ``style``: ``"token_ids"`` (vLLM ``return_token_ids``), ``"token_id_strings"`` (``"token_id:N"`` tokens),
    ``"text"`` (tokens as text only), ``"error"`` (HTTP 500). ``failures``: answer that many requests first with
    ``failure_code`` (a transient overload), then normally. ``dev_mode``: offer vLLM's ``/collective_rpc``,
    ``/reset_prefix_cache`` and ``/server_info`` (on ``device``), as ``VLLM_SERVER_DEV_MODE=1`` does; otherwise they
    answer 404. ``reset_refusals``: answer that many resets ``{"success": false}`` first (requests holding blocks).

    Weight transfer (vLLM 0.32, dev mode): ``weight_transfer="nccl"`` is a server started with
    ``--weight-transfer-config '{"backend": "nccl"}'`` (``None``: without, and every transfer call fails as vLLM's
    does). One worker (``/get_world_size``). An ``init_info`` with ``master_address``/``master_port`` makes the
    worker join that gloo group as rank ``rank_offset``; ``/update_weights`` then receives one broadcast per
    parameter into ``torch.empty(shape, dtype)`` and keeps them in ``received`` (one dict per update); with
    ``nccl_unique_id_b64`` only the control messages are checked. ``update_failure``: ``/update_weights`` answers
    HTTP 500 with that message before receiving anything.
    """

    def __init__(self, style: str = "token_ids", failures: int = 0, failure_code: int = 503, dev_mode: bool = True,
                 reset_refusals: int = 0, device: str = "cpu", weight_transfer: str | None = None,
                 update_failure: str | None = None) -> None:
        self.style = style
        self.failures, self.failure_code = failures, failure_code
        self.dev_mode, self.reset_refusals, self.device = dev_mode, reset_refusals, device
        self.weight_transfer, self.update_failure = weight_transfer, update_failure
        self.group = None  # the worker's end of the trainer's gloo group
        self.updating = False
        self.received: list[dict[str, torch.Tensor]] = []
        self.requests: list[tuple[str, dict]] = []  # POSTs: (path, body)
        self.gets: list[str] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append((self.path, body))
                    failing = fake.failures > 0
                    fake.failures -= int(failing)
                if fake.style == "error" or failing:
                    self.send_response(500 if fake.style == "error" else fake.failure_code)
                    self.end_headers()
                    self.wfile.write(b"CUDA out of memory" if fake.style == "error" else b"server overloaded")
                    return
                if self.path in DEV_MODE_ROUTES and not fake.dev_mode:
                    self.answer(404, {"detail": "Not Found"})
                elif self.path == "/update_weights_from_disk":
                    self.answer(200, fake.weights(body))
                elif self.path == "/collective_rpc":
                    self.answer(200, {"results": [None]})
                elif self.path in TRANSFER_ROUTES:
                    try:
                        self.answer(200, fake.transfer(self.path, body))
                    except RuntimeError as error:  # vLLM: the worker's error, as an internal server error
                        self.answer(500, {"error": str(error)})
                elif self.path == "/reset_prefix_cache":
                    with fake.lock:
                        refused = fake.reset_refusals > 0
                        fake.reset_refusals -= int(refused)
                    self.answer(200, {"success": not refused})
                else:
                    self.answer(200, fake.complete(body))

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                with fake.lock:
                    fake.gets.append(self.path)
                if self.path == "/v1/models":
                    self.answer(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
                elif self.path.startswith("/server_info") and fake.dev_mode:
                    transfer = {"backend": fake.weight_transfer} if fake.weight_transfer else None
                    self.answer(200, {"vllm_config": {"device_config": {"device": fake.device},
                                                      "weight_transfer_config": transfer}})
                elif self.path == "/get_world_size" and fake.dev_mode:
                    self.answer(200, {"world_size": 1})
                elif self.path in DEV_MODE_ROUTES and fake.dev_mode:
                    self.answer(405, {"detail": "Method Not Allowed"})
                else:
                    self.answer(404, {"detail": "Not Found"})

            def answer(self, code: int, reply: dict) -> None:
                data = json.dumps(reply).encode()
                self.send_response(code)
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
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        for index, prompt in enumerate(prompts):
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

    def transfer(self, path: str, body: dict) -> dict:
        """One weight-transfer call, checked as vLLM 0.32's worker checks it (class docstring)."""
        if not self.weight_transfer:
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable weight "
                               "transfer.")
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            if set(info) - INIT_FIELDS:
                raise RuntimeError(f"Invalid init_info: unexpected {sorted(set(info) - INIT_FIELDS)}")
            if "master_address" in info:
                self.group = join_gloo(info["master_address"], info["master_port"], info["rank_offset"],
                                       info["world_size"])
            return {"message": "Weight transfer initialized"}
        if path == "/start_weight_update":
            if self.updating:
                raise RuntimeError("start_weight_update called while a weight update is already active")
            self.updating = True
            return {"message": "Weight update started"}
        if not self.updating:
            raise RuntimeError(f"{path} without a matching start_weight_update")
        if path == "/update_weights":
            info = body["update_info"]
            if set(info) != UPDATE_FIELDS:
                raise RuntimeError(f"Invalid update_info: fields {sorted(info)}, not {sorted(UPDATE_FIELDS)}")
            if self.update_failure:
                self.updating = False
                raise RuntimeError(self.update_failure)
            received = {}
            for name, dtype_name, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
                if self.group is not None:
                    self.group.broadcast(tensor, 0).wait()
                received[name] = tensor
            self.received.append(received)
            return {"message": "Weights updated"}
        self.updating = False  # /finish_weight_update
        return {"message": "Weight update finished"}

    def weights(self, body: dict) -> dict:
        return {"success": Path(body["model_path"], "config.json").exists(), "message": "loaded"}

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
