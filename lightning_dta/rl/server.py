"""``OpenAICompatibleGenerator``: generate with an external inference server (vLLM, SGLang) over HTTP.

On GPUs the usual set-up runs generation in a dedicated server and training in this process. The client sends
token-id prompts to the OpenAI-compatible ``/v1/completions`` endpoint and reads back token ids and the
log-prob of each sampled token:

- request: one per prompt, because the server seeds each request and two identical prompts (the samples of a GRPO
  group) sent with one seed would come back identical. Each has ``prompt`` (token ids, ``n=1``), the prompt's own
  ``seed``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (a vLLM/SGLang extension, sent only when > 0),
  ``logprobs=1`` (the sampled token's log-prob is always included), ``stop_token_ids``,
  ``skip_special_tokens=false``, and the vLLM flags ``return_token_ids`` / ``return_tokens_as_token_ids`` so token
  ids come back exactly, never re-tokenized from text. Up to ``max_concurrent_requests`` are in flight at once
  (the server batches them: continuous batching).
- response: ``choices[i].index`` (the prompt), ``choices[i].token_ids`` when the server returns them, otherwise
  ``choices[i].logprobs.tokens`` in vLLM's ``"token_id:123"`` form; ``choices[i].logprobs.token_logprobs``; and
  ``finish_reason``. A response that gives tokens only as text is refused: re-tokenizing text can produce other
  ids than the ones sampled, and the log-probs would then belong to different tokens.

Log-probs: vLLM reports the model's raw log-probs by default (``logprobs_mode`` ``raw_logprobs``), i.e. before
temperature and filters, which is what the training loss compares against; keep that setting.

Faults: a request that fails with a connection error, a timeout, HTTP 429 or 5xx is retried ``max_retries`` times
with exponential backoff (``retry_backoff_sec``, doubling); then generation stops with the server's own message.
Other HTTP errors (a bad request) are not retried.

Weights: after each optimizer step the server must serve the new weights, and **no key/value computed with the old
weights may serve a later request**: a prefix cache that outlives the weights gives prompts that share a cached
prefix (on vLLM's CPU build: 128 tokens, one KV block, or more) the old policy's log-probs, silently wrong
importance ratios (measured on vLLM's CPU build: off by 3.1 to 11). Both built-in syncs save the policy as a
Hugging Face checkpoint under ``weight_dir/version_N`` (``export_hf_checkpoint``: a sharded policy, ``dta_fsdp`` or
TP, is gathered collectively, every rank writing its shards and rank 0 consolidating) and then, from rank 0:

- ``weight_sync="vllm"``: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``,
  then ``POST /reset_prefix_cache``, whose JSON ``success`` is read: vLLM answers HTTP 200 with ``{"success":
  false}`` and resets nothing while a request still holds cache blocks, so the reset is retried for
  ``cache_reset_wait_sec`` and then the run stops. Both endpoints exist only on a server started with
  ``VLLM_SERVER_DEV_MODE=1``; :meth:`~OpenAICompatibleGenerator.check` (the RL callback calls it before the SFT
  warm start, ``attach`` again) checks that, the model name, and a head size vLLM's CPU attention refuses (such a
  server reports healthy and dies at the first request), and refuses with the setting to change. A reload of a
  path the server cannot read kills vLLM's engine (0.32): the path is written before it is sent, and sent
  absolute.
- ``weight_sync="sglang-disk"``: ``POST /update_weights_from_disk {"model_path": DIR, "flush_cache": true}``.
  SGLang flushes its radix cache itself after a successful load (always in older releases; newer ones have the
  ``flush_cache`` field, default true, sent explicitly here so that no server default can turn it off) and asserts
  the flush: the update waits for the requests in flight, and a flush that fails stops the server rather than
  serving stale keys/values. So a ``success`` answer means the cache is gone; no separate ``/flush_cache`` (which
  answers 400 while requests run) is needed.

No disk: ``weight_sync="vllm-nccl"`` broadcasts the parameters from rank 0's GPU to a vLLM GPU server's workers over
NCCL through vLLM 0.32's weight-transfer routes (init once, then per version start / update / finish), and then
resets the prefix cache as ``"vllm"`` does (:mod:`lightning_dta.rl.vllm_nccl`; never run against a real GPU server
yet). :meth:`~OpenAICompatibleGenerator.check` refuses, with the fix, a process without CUDA (``weight_sync="vllm"``
instead), a server without dev mode, one started without ``--weight-transfer-config '{"backend": "nccl"}'``, and a
CPU server (vLLM's CPU build has no weight transfer).

Any other mechanism (a shared file system, another transport) plugs in as a callable ``weight_sync(model, version)``,
which must give the same guarantee. With a sharded policy the sync runs on every rank; a callable then also runs
on every rank.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from lightning_dta.core.errors import ConfigError, UsageError
from lightning_dta.distributed.collectives import rank
from lightning_dta.distributed.sharding import export_hf_checkpoint
from lightning_dta.rl.generation import Completion, Generator, cut_at_stop, row_seeds
from lightning_dta.rl.vllm_nccl import NcclChannel, VLLMWeightTransfer, WeightChannel, require_nccl

WeightSync = Callable[[nn.Module, int], None]
BUILT_IN_SYNCS = ("vllm", "vllm-nccl", "sglang-disk", "none")
WEIGHT_TRANSFER_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                          "/finish_weight_update", "/reset_prefix_cache")
"""the POST routes ``"vllm-nccl"`` needs (vLLM 0.32, dev mode: ``vllm/entrypoints/rl/online/api_router.py``)."""
WEIGHT_TRANSFER_FIX = ("start the server with --weight-transfer-config '{\"backend\": \"nccl\"}' (and "
                       "VLLM_SERVER_DEV_MODE=1)")
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""the head sizes vLLM's CPU attention takes (0.32: ``CPUAttentionBackend.get_supported_head_sizes``)."""
DEV_MODE_FIX = "start the server with VLLM_SERVER_DEV_MODE=1 in its environment (README: A real vLLM server)"


class ServerError(UsageError, RuntimeError):
    """The inference server failed or answered in a form the client cannot use; the message says what to change."""


class OpenAICompatibleGenerator(Generator):
    """Sample from a vLLM or SGLang server's ``/v1/completions`` endpoint (see the module docstring).

    Args:
        base_url: the server, e.g. ``"http://localhost:8000"`` (``/v1/completions`` is appended).
        model: the served model name (the request's ``model`` field).
        max_new_tokens, temperature, top_p, top_k: sampling (``top_k=0``: not sent).
        stop_token_ids: stop tokens besides the tokenizer's EOS.
        weight_sync: ``"vllm"``, ``"vllm-nccl"``, ``"sglang-disk"`` (module docstring), a callable ``(model,
            version) -> None``, or ``"none"`` to keep the server's weights (evaluation only: RL would keep sampling
            from the initial policy). Required.
        weight_dir: where ``"vllm"`` and ``"sglang-disk"`` write each version (a directory the server can read).
        weight_channel: with ``"vllm-nccl"``, makes the trainer's end of the group with the server's workers
            (a :class:`~lightning_dta.rl.vllm_nccl.WeightChannel`; default: NCCL on the current CUDA device).
        timeout: seconds per HTTP request.
        api_key: sent as a bearer token when given.
        max_concurrent_requests: requests (one per prompt) in flight at once.
        max_retries, retry_backoff_sec: retries of a failed request (connection, timeout, HTTP 429/5xx) and the
            first wait between them (doubling); then the run stops with the server's message.
        extra_body: more request fields (e.g. ``{"repetition_penalty": 1.0}``).
    """

    placement = "disaggregated"  # the online source's default: rank 0 talks to the server and broadcasts
    cache_reset_wait_sec = 30.0  # how long "vllm" retries a prefix-cache reset that requests in flight refuse

    def __init__(self, base_url: str, model: str, max_new_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, stop_token_ids: list[int] | None = None,
                 weight_sync: str | WeightSync | None = None, weight_dir: str | None = None, timeout: float = 600.0,
                 api_key: str | None = None, max_concurrent_requests: int = 64, max_retries: int = 3,
                 retry_backoff_sec: float = 1.0, extra_body: dict[str, Any] | None = None,
                 weight_channel: Callable[[], WeightChannel] | None = None) -> None:
        if max_new_tokens < 1 or max_concurrent_requests < 1:
            raise ConfigError("max_new_tokens and max_concurrent_requests must be >= 1")
        if max_retries < 0 or retry_backoff_sec < 0:
            raise ConfigError("max_retries and retry_backoff_sec must be >= 0")
        if isinstance(weight_sync, str) and weight_sync not in BUILT_IN_SYNCS:
            raise ConfigError(f"weight_sync={weight_sync!r}. Fix: 'vllm', 'vllm-nccl', 'sglang-disk', 'none' or a "
                              "callable(model, version)")
        if weight_sync in ("vllm", "sglang-disk") and not weight_dir:
            raise ConfigError(f"weight_sync={weight_sync!r} needs weight_dir. Fix: weight_dir, a directory the server "
                              "can read")
        self.base_url = base_url.rstrip("/")
        self.model_name = model
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.extra_stop_ids = list(stop_token_ids or [])
        self.weight_sync, self.weight_dir = weight_sync, weight_dir
        self.timeout, self.api_key = timeout, api_key
        self.max_concurrent_requests = max_concurrent_requests
        self.max_retries, self.retry_backoff_sec = max_retries, retry_backoff_sec
        self.extra_body = dict(extra_body or {})
        self.weight_channel = weight_channel
        self.transfer: VLLMWeightTransfer | None = None  # "vllm-nccl": made at the first sync (attach)
        self.stop_ids: list[int] = list(self.extra_stop_ids)
        self.version = 0

    def attach(self, policy: nn.Module, *, eos_token_id: int | None, pad_token_id: int | None,
               share_weights: bool) -> None:
        """Record the stop tokens, check that the server offers what ``weight_sync`` needs (``"vllm"``), and push the
        policy's current weights (the server may hold older ones, e.g. from before an SFT warm start).
        ``share_weights`` does not apply: the server always has its own copy."""
        if self.weight_sync is None:
            raise ConfigError("OpenAICompatibleGenerator has no weight_sync: the server would keep sampling from its "
                             "initial weights while the policy trains. Fix: weight_sync='vllm' or 'sglang-disk' (with "
                             "weight_dir), 'vllm-nccl', a callable(model, version) that updates your server, or "
                             "'none' on purpose")
        self.stop_ids = list(dict.fromkeys(([] if eos_token_id is None else [eos_token_id]) + self.extra_stop_ids))
        if not self.stop_ids:
            raise ConfigError("no stop token: the tokenizer has no eos_token_id and no stop_token_ids were given")
        self.check(policy)  # again: a plain loop calls attach only (a few ms)
        self.update_weights(policy, self.version)

    def check(self, policy: nn.Module) -> None:
        """With ``weight_sync="vllm"`` or ``"vllm-nccl"``, refuse (from rank 0) with the setting to change a set-up
        that cannot work: unreachable, serving another model name, without the dev-mode endpoints, on the CPU with
        a head size its attention refuses (such a server answers /health and dies at the first request); for
        ``"vllm-nccl"`` also no CUDA here, a server started without the NCCL weight transfer, or a CPU server."""
        if self.weight_sync not in ("vllm", "vllm-nccl") or rank() != 0:
            return
        nccl = self.weight_sync == "vllm-nccl"
        if nccl and self.weight_channel is None:
            require_nccl()
        models = self._get("/v1/models")
        served = [m.get("id") for m in models.get("data", [])] if isinstance(models, dict) else []
        if self.model_name not in served:
            raise ServerError(f"the server at {self.base_url} serves {served}, not model={self.model_name!r}. Fix: "
                              f"model: {served[0] if served else 'its --served-model-name'}")
        for path in WEIGHT_TRANSFER_ROUTES if nccl else ("/collective_rpc", "/reset_prefix_cache"):
            if self._status(path) == 404:  # a POST route answers a GET with 405: the route exists
                raise ServerError(f"weight_sync={self.weight_sync!r} needs the server's {path} (POST), and the server "
                                  f"at {self.base_url} has none (HTTP 404): it runs without vLLM's dev mode. Fix: "
                                  f"{DEV_MODE_FIX}")
        info = self._get("/server_info?config_format=json")
        vllm_config = info.get("vllm_config") if isinstance(info, dict) else None
        vllm_config = vllm_config if isinstance(vllm_config, dict) else {}
        device = (vllm_config.get("device_config") or {}).get("device")
        if nccl and device == "cpu":
            raise ServerError(f"the server at {self.base_url} runs vLLM's CPU build, whose weight transfer has no CPU "
                              "path (NCCL or CUDA IPC only). Fix: weight_sync='vllm'")
        transfer = vllm_config.get("weight_transfer_config")
        if nccl and (transfer or {}).get("backend") != "nccl":
            raise ServerError(f"weight_sync='vllm-nccl' needs the server's NCCL weight transfer, and the server at "
                              f"{self.base_url} has weight_transfer_config {transfer} (every transfer call would "
                              f"fail). Fix: {WEIGHT_TRANSFER_FIX}")
        # a user's model: a transformers config's fields when it has one (head_dim is an optional field)
        config = getattr(policy, "config", None)
        heads = getattr(config, "num_attention_heads", None)  # a user's model config
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)  # optional
        if device == "cpu" and head_dim is not None and head_dim not in CPU_ATTENTION_HEAD_SIZES:
            raise ServerError(f"the model's head_dim is {head_dim}, and the server at {self.base_url} runs vLLM's "
                              f"CPU attention, which takes head sizes {list(CPU_ATTENTION_HEAD_SIZES)} only (it "
                              "would die at the first request). Fix: a model whose hidden_size / "
                              "num_attention_heads is one of them (configs/toy_rl_vllm.yaml: 64 / 2), or a GPU server")

    def update_weights(self, policy: nn.Module, version: int) -> None:
        if callable(self.weight_sync):
            self.weight_sync(policy, version)
        elif self.weight_sync == "vllm-nccl":
            if self.transfer is None:  # once, at attach: join the server's workers' group
                self.transfer = VLLMWeightTransfer(self._post_once, self._get, self.weight_channel or NcclChannel,
                                                   self.timeout)
                if rank() == 0:
                    self.transfer.connect()
            self.transfer.send(policy, version)  # every rank that syncs: a sharded policy is gathered collectively
            if rank() == 0:
                self.reset_prefix_cache(version)
        elif self.weight_sync in ("vllm", "sglang-disk"):
            path = (Path(self.weight_dir) / f"version_{version}").resolve()  # the server has another working dir
            with quiet_progress_bars():  # transformers' "Writing model shards" bar, once a step, says nothing
                export_hf_checkpoint(policy, path)  # sharded: every rank writes its shards, rank 0 consolidates
            if rank() == 0 and self.weight_sync == "vllm":
                self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
                self.reset_prefix_cache(version)
            elif rank() == 0:
                reply = self._post("/update_weights_from_disk", {"model_path": str(path), "flush_cache": True})
                if isinstance(reply, dict) and reply.get("success") is False:
                    raise ServerError(f"the server refused the weights of version {version} at {path}: "
                                      f"{reply.get('message', reply)}")
        self.version = version

    def reset_prefix_cache(self, version: int) -> None:
        """Drop vLLM's prefix cache after a reload: ``/reset_prefix_cache`` answers ``{"success": false}`` (HTTP 200)
        while a request holds cache blocks, so retry until it succeeds or ``cache_reset_wait_sec`` has passed."""
        deadline = time.monotonic() + self.cache_reset_wait_sec
        while True:
            reply = self._post("/reset_prefix_cache", {})
            if isinstance(reply, dict) and reply.get("success") is True:
                return
            if time.monotonic() >= deadline:
                raise ServerError(f"the server at {self.base_url} loaded the weights of version {version} but did "
                                  f"not reset its prefix cache within {self.cache_reset_wait_sec:.0f} s (it answered "
                                  f"{reply}: requests still hold cache blocks), so prompts would reuse keys/values "
                                  "computed with the old weights. Fix: let no other client use the server during "
                                  "training, or raise OpenAICompatibleGenerator.cache_reset_wait_sec")
            time.sleep(0.2)

    def generate(self, prompts: Sequence[Sequence[int]], seed: int | Sequence[int]) -> list[Completion]:
        seeds = row_seeds(seed, len(prompts))
        workers = min(self.max_concurrent_requests, max(len(prompts), 1))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lightning-dta-request") as pool:
            return list(pool.map(self._complete, [list(p) for p in prompts], seeds, range(len(prompts))))

    def request_body(self, prompt: list[int], seed: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_name, "prompt": prompt, "n": 1, "max_tokens": self.max_new_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "seed": seed % 2**31, "logprobs": 1,
            "stop_token_ids": self.stop_ids, "skip_special_tokens": False, "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if self.top_k > 0:
            body["top_k"] = self.top_k
        return body | self.extra_body

    def _complete(self, prompt: list[int], seed: int, number: int) -> Completion:
        reply = self._post("/v1/completions", self.request_body(prompt, seed))
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or len(choices) != 1:
            raise ServerError(f"/v1/completions returned {len(choices) if isinstance(choices, list) else 'no'} "
                              "choices for one prompt; the server must answer it once (n=1)")
        return self._parse_choice(choices[0], number)

    def _parse_choice(self, choice: dict[str, Any], number: int) -> Completion:
        logprobs = choice.get("logprobs") or {}
        token_logprobs = logprobs.get("token_logprobs")
        token_ids = choice.get("token_ids")
        if token_ids is None:
            tokens = logprobs.get("tokens") or []
            if not tokens and not choice.get("text"):
                raise ServerError(f"choice {number}: the server returned no tokens (neither token_ids nor "
                                  "logprobs.tokens). Fix: a vLLM or SGLang server that answers /v1/completions with "
                                  "return_token_ids or return_tokens_as_token_ids")
            if not tokens or not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                shown = f"({tokens[:3]}...)" if tokens else f"(only text: {str(choice.get('text', ''))[:40]!r})"
                raise ServerError(
                    f"choice {number}: the server returned its tokens as text {shown}, not as ids; "
                    "re-tokenizing text can give other ids than the sampled ones. Fix: a vLLM that honours "
                    "return_token_ids or return_tokens_as_token_ids (or start it with --return-tokens-as-token-ids)")
            token_ids = [int(t.split(":", 1)[1]) for t in tokens]
        if not token_ids and choice.get("text"):
            raise ServerError(f"choice {number}: the server returned text ({str(choice['text'])[:40]!r}) but no "
                              "token ids: the completion cannot be trained on the tokens that were sampled. Fix: a "
                              "server that returns token ids (vLLM: --return-tokens-as-token-ids)")
        if token_logprobs is None or len(token_logprobs) != len(token_ids):
            raise ServerError(f"choice {number}: {len(token_ids)} tokens but "
                              f"{'no' if token_logprobs is None else len(token_logprobs)} token_logprobs; request "
                              "logprobs=1 from a server that supports it")
        if any(lp is None for lp in token_logprobs):
            raise ServerError(f"choice {number}: a generated token has no log-prob (null in token_logprobs)")
        completion = cut_at_stop([int(t) for t in token_ids], [float(lp) for lp in token_logprobs], set(self.stop_ids))
        if len(completion.token_ids) < len(token_ids):
            raise ServerError(f"choice {number}: the server kept generating after a stop token "
                              f"({token_ids}); send stop_token_ids it honours")
        if choice.get("finish_reason") == "stop":  # also a stop string, or a stop token the server left out
            completion.finish_reason = "stop"
        return completion

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` as JSON, retrying transient failures with exponential backoff (module docstring)."""
        return self._request("POST", path, body)

    def _post_once(self, path: str, body: dict[str, Any]) -> Any:
        """POST without retries: for calls a retry would repeat half-done (a weight transfer's)."""
        return self._request("POST", path, body, retries=0)

    def _get(self, path: str) -> Any:
        """GET ``path``'s JSON, retried as :meth:`_post` is."""
        return self._request("GET", path, None)

    def _status(self, path: str) -> int:
        """The HTTP status of a GET of ``path`` (a 4xx is an answer here, not an error); unreachable: ServerError."""
        try:
            self._get(path)
        except ServerError as error:
            if isinstance(error.__cause__, urllib.error.HTTPError) and error.__cause__.code < 500:
                return error.__cause__.code
            raise
        return 200

    def _request(self, method: str, path: str, body: dict[str, Any] | None, retries: int | None = None) -> Any:
        retries = self.max_retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return self._request_once(method, path, body)
            except _Transient as error:
                if attempt == retries:
                    what, fix = str(error), ""
                    if " Fix: " in what:  # the message ends with its fix
                        what, fix = what.split(" Fix: ", 1)
                        fix = f" Fix: {fix}"
                    tries = f"gave up after {attempt + 1} attempts; max_retries={retries}" if retries else "not retried"
                    raise ServerError(f"{what.rstrip('.')} ({tries}).{fix}") from error.__cause__
                time.sleep(self.retry_backoff_sec * 2**attempt)
        raise AssertionError("unreachable")

    def _request_once(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        where = f"{self.base_url}{path}"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read().decode() or "null")
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            message = f"{method} {where} failed with HTTP {error.code}: {detail}"
            if error.code == 429 or error.code >= 500:
                raise _Transient(message) from error
            raise ServerError(message) from error
        except urllib.error.URLError as error:
            raise _Transient(f"cannot reach the inference server at {where}: {error.reason}. Fix: start the server "
                             "(README: A real vLLM server), or set base_url to where it listens") from error
        except TimeoutError as error:
            raise _Transient(f"{method} {where} timed out after {self.timeout:.0f} s") from error
        except json.JSONDecodeError as error:
            raise _Transient(f"{method} {where} did not answer with JSON ({error})") from error


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' progress bars off for the block (restored after)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


class _Transient(Exception):
    """A failure worth retrying (connection, timeout, HTTP 429/5xx, a garbled answer)."""
