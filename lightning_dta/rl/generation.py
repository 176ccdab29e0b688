"""Sampling completions from the policy: the generator interface and the in-process Hugging Face generator.

A generator turns token prompts into :class:`Completion` objects: the sampled token ids and the behaviour
log-prob of each, recorded at generation time. Those log-probs become the rollouts' ``old_logprobs``; the PPO
ratio and the decoupled-PPO weight are measured against them, so they must be the log-probs of the policy
that sampled, not a later recomputation.

:class:`HFGenerator` runs ``model.generate`` in this process (CPU or GPU, no extra dependency); it is the
default. :class:`~lightning_dta.rl.server.OpenAICompatibleGenerator` talks to a vLLM or SGLang server instead.

Sampling is reproducible. ``generate`` draws from the sampling distribution with the Gumbel-max trick inside a
logits processor that owns one seeded ``torch.Generator`` per prompt and lets ``generate`` pick the argmax:
exactly a sample from the (temperature / top-k / top-p) distribution, but independent of the global RNG (a
background generation thread and the trainer never disturb each other's random streams) and of the other
prompts in the batch. Each prompt's noise depends only on its own seed, so the same prompts and seeds give the
same completions however they are batched: in synchronous and asynchronous mode, on one rank or on eight.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from lightning_dta.core.errors import ConfigError
from lightning_dta.distributed.sharding import copy_weights, is_sharded, unsharded_copy


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    Attributes:
        token_ids: the generated tokens; when generation stopped on a stop token, that token is the last one
            (so the model is trained to stop).
        logprobs: the behaviour log-prob of each generated token under the policy at temperature 1 (the
            distribution the training loss evaluates), one per token.
        finish_reason: ``"stop"`` (a stop token was generated) or ``"length"`` (``max_new_tokens`` reached).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class Generator(ABC):
    """Produces completions for token prompts with the current policy, and follows the trainer's weights.

    The loop calls :meth:`check` first, :meth:`attach` once (the trainer's policy, before the first generation),
    :meth:`generate` for every batch of LLM calls, and :meth:`update_weights` after every optimizer step.
    """

    max_new_tokens: int
    placement: str = "colocated"  # the online source's default: every rank generates with its own instance

    def check(self, policy: nn.Module) -> None:
        """Refuse a set-up this generator cannot work with (a server without an endpoint it needs, a model it cannot
        run) before any time is spent: the RL callback calls it before the SFT warm start. The default accepts
        every set-up."""
        return None

    @abstractmethod
    def attach(self, policy: nn.Module, *, eos_token_id: int | None, pad_token_id: int | None,
               share_weights: bool) -> None:
        """Connect to the trainer's ``policy``. ``share_weights=True``: generate with the very same module
        (synchronous mode, generation and training never overlap); ``False``: keep a private copy that only
        :meth:`update_weights` changes (asynchronous mode, training runs while this generator samples)."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], seed: int | Sequence[int]) -> list[Completion]:
        """One completion per prompt, in order. ``seed``: one sampling seed per prompt (a completion must depend
        on its prompt and its seed only, not on the batch), or one int from which :func:`row_seeds` derives them."""

    @abstractmethod
    def update_weights(self, policy: nn.Module, version: int) -> None:
        """Make the next generations use ``policy``'s current weights, tagged ``version``."""


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (step, prompt, sample, turn, ...): the same on every process and machine."""
    return random.Random(":".join(map(str, parts))).getrandbits(63)


def row_seeds(seed: int | Sequence[int], rows: int) -> list[int]:
    """One sampling seed per prompt: the given ones, or derived from one batch seed and the prompt's position."""
    if isinstance(seed, int):
        return [derive_seed("row", seed, row) for row in range(rows)]
    seeds = [int(s) for s in seed]
    if len(seeds) != rows:
        raise ValueError(f"got {len(seeds)} seeds for {rows} prompts; give one seed per prompt (or one int)")
    return seeds


class GumbelSampler(LogitsProcessor):
    """Turn greedy decoding into exact sampling: add Gumbel noise from a private, seeded ``torch.Generator`` per
    batch row, so a row's samples do not depend on the other rows.

    ``argmax(scores + Gumbel)`` is a sample from ``softmax(scores)`` (the Gumbel-max trick); tokens the warpers
    filtered out stay at ``-inf``.
    """

    def __init__(self, generators: list[torch.Generator]) -> None:
        self.generators = generators

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        exponential = torch.stack([torch.empty(vocab, dtype=torch.float32, device=g.device).exponential_(generator=g)
                                   for g in self.generators])
        return scores - exponential.to(scores.device, scores.dtype).log()  # -log(Exp(1)) is Gumbel(0, 1)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Generate without dropout, then give the trainer back the mode it had."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def cut_at_stop(token_ids: Sequence[int], logprobs: Sequence[float], stop_ids: set[int]) -> Completion:
    """The completion up to and including its first stop token (``"stop"``), or all of it (``"length"``)."""
    for position, token in enumerate(token_ids):
        if token in stop_ids:
            return Completion(list(token_ids[:position + 1]), list(logprobs[:position + 1]), "stop")
    return Completion(list(token_ids), list(logprobs), "length")


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    """Refuse an empty prompt by its index: a causal LM needs at least one token to condition on."""
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ConfigError(f"prompt {index} is empty; a causal LM needs at least one token to condition on "
                              "(start prompts with a BOS token)")


class HFGenerator(Generator):
    """Sample with the policy's own ``model.generate`` (the default generator; works on the CPU).

    Args:
        max_new_tokens: the most tokens one LLM call generates.
        temperature, top_k, top_p: the sampling distribution (``top_k=0`` and ``top_p=1.0`` switch the filters
            off). With the defaults (1.0, 0, 1.0) the samples come from exactly the policy the loss trains, so
            ``old_logprobs`` are its log-probs. Otherwise the recorded log-probs are still the temperature-1
            policy's (what the loss compares against), and the samples are off that policy by the filter.
        stop_token_ids: tokens that end a call besides the tokenizer's EOS (e.g. an end-of-turn token).
        batch_size: the most sequences in one ``generate`` call (bounds generation memory).
        model: generate with this model instead of the trainer's policy (a draft or a frozen model); its
            weights still follow :meth:`update_weights`. ``None`` (default): the policy given to :meth:`attach`.
    """

    def __init__(self, max_new_tokens: int = 16, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 stop_token_ids: list[int] | None = None, batch_size: int = 64, model: nn.Module | None = None) -> None:
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if not temperature > 0 or not math.isfinite(temperature):
            raise ConfigError(f"temperature={temperature} must be a positive number (use a small one, not 0, for "
                             "near-greedy sampling: RL needs samples from a distribution)")
        if top_k < 0 or not 0.0 < top_p <= 1.0:
            raise ConfigError(f"top_k={top_k} must be >= 0 and top_p={top_p} in (0, 1]")
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.extra_stop_ids = list(stop_token_ids or [])
        self.batch_size = batch_size
        self.model = model
        self.version = 0
        self.eos_token_id: int | None = None
        self.pad_token_id: int | None = None

    @property
    def stop_ids(self) -> list[int]:
        ids = ([] if self.eos_token_id is None else [self.eos_token_id]) + self.extra_stop_ids
        return list(dict.fromkeys(ids))

    def attach(self, policy: nn.Module, *, eos_token_id: int | None, pad_token_id: int | None,
               share_weights: bool) -> None:
        if eos_token_id is None and not self.extra_stop_ids:
            raise ConfigError("HFGenerator has no stop token: the tokenizer has no eos_token_id and no "
                             "stop_token_ids were given, so every call would run to max_new_tokens and the policy "
                             "could never learn to stop. Fix: use a tokenizer with an EOS token, or pass "
                             "HFGenerator(stop_token_ids=[...])")
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None
                                                                            else self.extra_stop_ids[0])
        if self.model is None:
            if share_weights:
                self.model = policy
            elif is_sharded(policy):  # FSDP2 refuses deepcopy: an unsharded copy, gathered one tensor at a time
                self.model = unsharded_copy(policy)
            else:
                self.model = copy.deepcopy(policy)
        elif not share_weights or self.model is not policy:
            self.update_weights(policy, self.version)
        if self.model is not policy:
            self.model.requires_grad_(False)

    def update_weights(self, policy: nn.Module, version: int) -> None:
        """Copy ``policy``'s parameters and buffers into the generation model (nothing to do when shared)."""
        if self.model is None:
            raise RuntimeError("HFGenerator.update_weights before attach(): the generator has no model yet")
        if self.model is not policy:  # a sharded policy is gathered one tensor at a time (every rank calls this)
            try:
                copy_weights(policy, self.model)
            except ValueError as error:
                raise ConfigError(f"{error}: give HFGenerator(model=...) the same architecture as the "
                                  "policy") from error
        self.version = version

    def _processors(self, generators: list[torch.Generator]) -> LogitsProcessorList:
        processors = LogitsProcessorList()
        if self.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            processors.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            processors.append(TopPLogitsWarper(self.top_p))
        processors.append(GumbelSampler(generators))
        return processors

    def generate(self, prompts: Sequence[Sequence[int]], seed: int | Sequence[int]) -> list[Completion]:
        if self.model is None:
            raise RuntimeError("HFGenerator.generate before attach(): call attach(policy, ...) first (the "
                               "OnlineRLCallback does it when training starts)")
        check_prompts(prompts)
        device = next(self.model.parameters()).device
        noise_device = device if device.type == "cuda" else torch.device("cpu")
        generators = [torch.Generator(device=noise_device).manual_seed(s) for s in row_seeds(seed, len(prompts))]
        completions: list[Completion] = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            completions += self._generate_batch(prompts[start:end], generators[start:end], device)
        return completions

    def _generate_batch(self, prompts: Sequence[Sequence[int]], generators: list[torch.Generator],
                        device: torch.device) -> list[Completion]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every row's next token comes from the last column
            input_ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        # A fresh GenerationConfig: a hub model's own defaults (do_sample, top_k=20, ...) must not leak in.
        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=self.max_new_tokens,
                                  eos_token_id=self.stop_ids, pad_token_id=self.pad_token_id, use_cache=True,
                                  return_dict_in_generate=True, output_logits=True)
        with torch.no_grad(), eval_mode(self.model):
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                      generation_config=config, logits_processor=self._processors(generators))
        new_tokens = out.sequences[:, width:].cpu()
        # out.logits: one [rows, vocab] tensor per step, before any warper; score each step on its own so that no
        # [rows, steps, vocab] copy is made (with a 150K vocabulary that would be gigabytes)
        logprobs = torch.stack([torch.log_softmax(step.float(), dim=-1).gather(
            -1, new_tokens[:, s, None].to(step.device))[:, 0] for s, step in enumerate(out.logits)], dim=1).cpu()
        stop_ids = set(self.stop_ids)
        return [cut_at_stop(new_tokens[row].tolist(), logprobs[row].tolist(), stop_ids) for row in range(len(prompts))]
