"""OpenAICompatibleGenerator against a REAL vLLM server (PyPI's CPU build, ``.venv-vllm``), one server per module.

What only a real server shows: its samples' log-probs are the trainer's own forward's (float32, to rounding); after
``weight_sync="vllm"`` a prompt longer than one CPU KV block (128 tokens) gets the new weights' log-probs, not keys
and values its prefix cache computed with the old ones (without the cache reset they were off by 9-11 here); a bad
server setting stops ``lightning-dta fit`` with one line and exit 2; and a fit of the toy task against it keeps the
server's weights the trainer's, step after step (marker ``long``: the reward rises over 150 steps).

References are computed from definitions: ``log_softmax`` of the policy's own forward at the sampled tokens.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from transformers import AutoModelForCausalLM

from lightning_dta import cli
from lightning_dta.models import config_from_dict
from lightning_dta.rl import OpenAICompatibleGenerator, ReverseDigits
from tests.helpers import REPO, free_port, vllm_server
from tests.helpers.lightning import clean_env

pytestmark = pytest.mark.vllm

CONFIG = REPO / "configs" / "toy_rl_vllm.yaml"
EOS = 2
GENERATOR = "--data.source.init_args.generator.init_args"
TOLERANCE = 5e-5  # float32 server vs float32 forward: measured <= 6e-6 (weights at initializer_range 0.5)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[vllm_server.VLLMServer]:
    reason = vllm_server.missing()
    if reason is not None:
        if os.environ.get(vllm_server.REQUIRE) == "1":
            pytest.fail(f"{reason} ({vllm_server.REQUIRE}=1: the real-server tests must run)")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("vllm")
    started = vllm_server.start(vllm_server.write_model(CONFIG, root / "model"), root / "server.log")
    try:
        yield started
    finally:
        vllm_server.stop(started)


def toy_policy(seed: int) -> nn.Module:
    """The toy config's architecture with sharp random logits (initializer_range 0.5: samples are not uniform)."""
    torch.manual_seed(seed)
    spec = yaml.safe_load(CONFIG.read_text())["model"]["model"] | {"initializer_range": 0.5}
    return AutoModelForCausalLM.from_config(config_from_dict(spec)).eval()


def reference(policy: nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(token | prompt, earlier tokens) under ``policy``'s own forward."""
    with torch.no_grad():
        logprobs = policy(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def gap(policy: nn.Module, prompts: list[list[int]], completions) -> float:
    return max(abs(a - b) for p, c in zip(prompts, completions)
               for a, b in zip(c.logprobs, reference(policy, p, c.token_ids)))


def generator(server, tmp_path: Path, **kwargs) -> OpenAICompatibleGenerator:
    return OpenAICompatibleGenerator(server.url, vllm_server.SERVED_NAME, weight_sync="vllm",
                                     weight_dir=str(tmp_path / "weights"), **kwargs)


def toy_prompts(count: int) -> list[list[int]]:
    env = ReverseDigits()
    tokenizer = env.default_tokenizer()
    return [[tokenizer.bos_token_id, *tokenizer(env.reset(i), add_special_tokens=False)["input_ids"]]
            for i in range(count)]


def test_samples_and_logprobs_are_the_trainers_forward(server, tmp_path: Path) -> None:
    policy = toy_policy(0)
    client = generator(server, tmp_path, max_new_tokens=8)
    client.attach(policy, eos_token_id=EOS, pad_token_id=0, share_weights=False)
    prompts = toy_prompts(32)
    completions = client.generate(prompts, seed=list(range(32)))
    assert all(1 <= len(c.token_ids) <= 8 and all(0 <= t < 16 for t in c.token_ids) for c in completions)
    assert all((c.token_ids[-1] == EOS) == (c.finish_reason == "stop") for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) > 16  # sampled, not one answer
    assert gap(policy, prompts, completions) < TOLERANCE
    again = client.generate(prompts, seed=list(range(32)))
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]  # seeded per prompt


def test_after_a_weight_sync_long_prompts_get_the_new_weights_logprobs(server, tmp_path: Path) -> None:
    """A 200-token prompt fills one CPU KV block (128 tokens) that the prefix cache keeps: reloading the weights
    alone leaves that block's keys/values the old policy's (measured: log-probs off by 9-11 without the reset)."""
    old, new = toy_policy(1), toy_policy(2)
    client = generator(server, tmp_path, max_new_tokens=6)
    client.attach(old, eos_token_id=EOS, pad_token_id=0, share_weights=False)
    prompt = [[1] + [4 + (3 * j) % 10 for j in range(199)]]
    assert gap(old, prompt, client.generate(prompt, seed=5)) < TOLERANCE  # now cached, computed with the old weights
    client.update_weights(new, 1)
    completions = client.generate(prompt, seed=5)
    assert gap(new, prompt, completions) < TOLERANCE
    assert gap(old, prompt, completions) > 0.5  # the two policies disagree: a stale cache could not pass


@pytest.mark.parametrize("case", ["head size", "unreachable"])
def test_a_bad_server_setting_stops_fit_with_one_line_and_exit_2(case, request, tmp_path: Path, capsys,
                                                                 monkeypatch) -> None:
    """Refused before the SFT warm start (no steps spent): one line, the setting to change, exit 2. (A server
    without dev mode: tests/rl/test_server.py, a fake one; starting a second real server costs ~25 s.)"""
    monkeypatch.setattr(sys, "argv", ["lightning-dta"])
    monkeypatch.delenv(cli.TRACEBACK, raising=False)
    url = request.getfixturevalue("server").url if case == "head size" else f"http://127.0.0.1:{free_port()}"
    heads = ["--model.model.num_attention_heads=4", "--model.model.num_key_value_heads=4"]  # head_dim 64/4 = 16
    status = cli.main(["fit", "--config", str(CONFIG), "--trainer.logger=false", "--trainer.max_steps=1",
                       "--trainer.enable_progress_bar=false", f"{GENERATOR}.base_url={url}",
                       f"{GENERATOR}.weight_dir={tmp_path}", f"{GENERATOR}.max_retries=0",
                       *(heads if case == "head size" else [])])
    captured = capsys.readouterr()
    assert status == 2, captured.err
    (line,) = captured.err.strip().splitlines()
    expected = {"head size": r"head_dim is 16.*CPU attention.*Fix: ", "unreachable": r"cannot reach.*Fix: start"}[case]
    assert line.startswith("lightning-dta fit: error: ") and re.search(expected, line), line
    assert "SFT warm start" not in captured.out + captured.err
    assert not list(tmp_path.iterdir())  # no weights written


@pytest.mark.slow
def test_fit_against_the_server_keeps_its_weights_the_trainers(server, tmp_path: Path, monkeypatch) -> None:
    """`lightning-dta fit` of the toy task, 12 RL steps: afterwards the server samples with the trained policy's
    log-probs (every step's weights reached it; the last one too)."""
    from lightning_dta.lightning.cli import cli_main

    monkeypatch.setattr(sys, "argv", ["lightning-dta"])
    run = cli_main(["fit", "--config", str(CONFIG), "--trainer.max_steps=12", "--trainer.enable_progress_bar=false",
                    f"--trainer.logger.init_args.save_dir={tmp_path}",
                    f"{GENERATOR}.base_url={server.url}", f"{GENERATOR}.weight_dir={tmp_path / 'weights'}"])
    policy = run.model.model.eval()
    versions = sorted(int(p.name.removeprefix("version_")) for p in (tmp_path / "weights").iterdir())
    assert versions == list(range(13))  # at attach, then after each of the 12 steps
    # every step's trainer log-probs are the server's to float32 rounding (the config's max_logprob_gap, 1e-3,
    # would have stopped the run; this bounds it tighter)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        gaps = [float(row["train/logprob_gap_max"]) for row in csv.DictReader(f) if row.get("train/logprob_gap_max")]
    assert len(gaps) == 12 and max(gaps) < TOLERANCE, gaps
    probe = OpenAICompatibleGenerator(server.url, vllm_server.SERVED_NAME, max_new_tokens=8, weight_sync="none")
    probe.attach(policy, eos_token_id=EOS, pad_token_id=0, share_weights=False)
    prompts = toy_prompts(16)
    assert gap(policy, prompts, probe.generate(prompts, seed=list(range(16)))) < TOLERANCE


def test_an_unsynced_server_trips_the_logprob_gap_bound(server, tmp_path: Path, capsys, monkeypatch) -> None:
    """weight_sync: none: the server keeps the checkpoint it started from while the trainer's policy is another
    (its SFT warm start): the first RL step's gap is far above the config's max_logprob_gap (1e-3),
    and the run stops there with the numbers, one line, exit 2."""
    monkeypatch.setattr(sys, "argv", ["lightning-dta"])
    monkeypatch.delenv(cli.TRACEBACK, raising=False)
    status = cli.main(["fit", "--config", str(CONFIG), "--trainer.logger=false", "--trainer.max_steps=3",
                       "--trainer.enable_progress_bar=false", f"{GENERATOR}.base_url={server.url}",
                       f"{GENERATOR}.weight_sync=none", f"{GENERATOR}.weight_dir=null"])
    err = capsys.readouterr().err
    assert status == 2, err
    (line,) = err.strip().splitlines()
    assert re.search(r"step 0: the trainer's log-probs of the sampled tokens are up to .* max_logprob_gap=0.001"
                     r".*Fix: ", line), line


@pytest.mark.long
def test_the_toy_task_learns_against_the_server(server, tmp_path: Path) -> None:
    """configs/toy_rl_vllm.yaml as the README prints it, 150 RL steps (~2 minutes): measured 0.643 -> 0.863."""
    proc = subprocess.run([str(Path(sys.executable).parent / "lightning-dta"), "fit", "--config", str(CONFIG),
                           f"--trainer.logger.init_args.save_dir={tmp_path}",
                           f"{GENERATOR}.base_url={server.url}", f"{GENERATOR}.weight_dir={tmp_path / 'weights'}"],
                          cwd=REPO, env=clean_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = map(float, re.search(r"reward: first 10 steps ([\d.]+) -> last 10 steps ([\d.]+)",
                                       proc.stdout + proc.stderr).groups())
    assert last > first + 0.1, (first, last)
