"""Every bad setting of ``lightning-dta fit`` is one message and exit status 2: what, where (the setting) and the fix,
without a traceback; ``--traceback`` (or ``LIGHTNING_DTA_TRACEBACK=1``) shows it. The table covers every setting of
finding 7 of issue 21 and the module's, engine's, data module's, source's and strategy's own checks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_dta import cli
from lightning_dta.rl import callback
from tests import helpers
from tests.helpers.lightning import clean_env
from tests.helpers.online import small_config
from tests.helpers.server import FakeServer

REPO = helpers.REPO
BASE = ["fit", "--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--trainer.logger=false",
        "--trainer.max_steps=1", "--trainer.enable_progress_bar=false"]
LINES = (REPO / "data" / "tiny_rollouts.jsonl").read_text().splitlines()


def rollout_file(tmp_path: Path, name: str, edit) -> str:
    """The tiny rollout file with ``edit(records)`` applied (records: one dict per line)."""
    records = [json.loads(line) for line in LINES]
    edit(records)
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def set_field(index: int, field: str, value):
    def edit(records):
        records[index][field] = value
    return edit


def swap(a: int, b: int):
    def edit(records):
        records[a], records[b] = records[b], records[a]
    return edit


# (id, overrides, what the message must name); a callable override gets tmp_path.
CASES = [
    ("data.path missing", ["--data.path=/nonexistent/rollouts.jsonl"], ["data.path", "does not exist"]),
    ("data.path a directory", [f"--data.path={REPO / 'data'}"], ["data.path", "is a directory"]),
    ("group_id a list", [lambda t: f"--data.path={rollout_file(t, 'list', set_field(3, 'group_id', [1, 2]))}"],
     ["list.jsonl:4", "group_id", "not a string or an int"]),
    ("group_id 1.5", [lambda t: f"--data.path={rollout_file(t, 'float', set_field(3, 'group_id', 1.5))}"],
     ["float.jsonl:4", "group_id"]),
    ("reward true", [lambda t: f"--data.path={rollout_file(t, 'bool', set_field(5, 'reward', True))}"],
     ["bool.jsonl:6", "reward", "not a finite number"]),
    ("a group in two steps", [lambda t: f"--data.path={rollout_file(t, 'swapped', swap(15, 16))}"],
     ["swapped.jsonl:17", "swapped.jsonl:13", "group_id", "in step 0", "in step 1"]),
    ("optimizer lr -1", ["--model.optimizer.init_args.lr=-1"], ["model.optimizer", "learning rate"]),
    ("devices 0", ["--trainer.devices=0"], ["trainer.devices=0"]),
    ("devices -3", ["--trainer.devices=-3"], ["trainer.devices=-3"]),
    ("chunk_size 0", ["--model.engine.chunk_size=0"], ["chunk_size=0"]),
    ("sibling_batch_tokens -5", ["--model.engine.sibling_batch_tokens=-5"], ["sibling_batch_tokens=-5"]),
    ("rollouts_per_step 0", ["--data.rollouts_per_step=0"], ["rollouts_per_step=0"]),
    ("advantage_estimator unknown", ["--data.advantage_estimator=nosuch"], ["advantage_estimator='nosuch'"]),
    ("partition_method unknown", ["--data.partition_method=nosuch"], ["partition_method='nosuch'"]),
    ("clip_eps -0.2", ["--model.loss.clip_eps=-0.2"], ["clip_eps=-0.2"]),
    ("bucket_mb -5", ["--trainer.strategy=lightning_dta.DTAStrategy", "--trainer.strategy.bucket_mb=-5"],
     ["bucket_mb=-5"]),
    ("signal_grace_sec 0", ["--trainer.strategy=lightning_dta.DTAStrategy", "--trainer.strategy.signal_grace_sec=0"],
     ["signal_grace_sec=0"]),
    ("strategy unknown", ["--trainer.strategy=nosuch"], ["trainer.strategy='nosuch'", "dta_fsdp"]),
    ("tensor_parallel_size 0", ["--trainer.strategy=lightning_dta.DTAFSDPStrategy",
                                "--trainer.strategy.tensor_parallel_size=0"], ["tensor_parallel_size=0"]),
    ("tensor_parallel_size 2 on 1 device", ["--trainer.strategy=lightning_dta.DTAFSDPStrategy",
                                            "--trainer.strategy.tensor_parallel_size=2"],
     ["tensor_parallel_size=2 does not divide the 1 ranks"]),
    ("walk_gradient_dtype bfloat16 under 32-true", ["--trainer.strategy=lightning_dta.DTAFSDPStrategy",
                                                     "--trainer.strategy.walk_gradient_dtype=bfloat16"],
     ["walk_gradient_dtype='bfloat16'", "precision"]),
    ("policy_temperature 0", ["--model.engine.policy_temperature=0"], ["policy_temperature=0"]),
    ("model_type unknown", ["--model.model.model_type=nosuch"], ["model.model.model_type='nosuch'"]),
    ("hidden 63 over 4 heads", ["--model.model.hidden_size=63"], ["model.model", "hidden size (63)"]),
    ("gradient_clip_val -1", ["--model.gradient_clip_val=-1"], ["gradient_clip_val=-1"]),
    ("gradient_clip_algorithm unknown", ["--model.gradient_clip_algorithm=nosuch"],
     ["gradient_clip_algorithm='nosuch'"]),
    ("max_nonfinite_skips 0", ["--model.max_nonfinite_skips=0"], ["max_nonfinite_skips=0"]),
    ("kl_coef without ref_logprobs", ["--model.loss.kl_coef=0.1"], ["kl_coef", "ref_logprobs"]),
    ("generation steps_per_generation 0", ["--data.generation.steps_per_generation=0"],
     ["generation.steps_per_generation=0"]),
    ("generation epochs 0", ["--data.generation.epochs=0"], ["generation.epochs=0"]),
    ("generation split unknown", ["--data.generation.split=nosuch"], ["data.generation.split='nosuch'", "shuffled"]),
]


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-dta"])
    monkeypatch.delenv(cli.TRACEBACK, raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_bad_setting_is_one_message_and_exit_2(case, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, overrides, named = case
    args = [o(tmp_path) if callable(o) else o for o in overrides]
    assert cli.main([*BASE, *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.startswith("lightning-dta fit: error: ") and "Fix: " in err, err
    for name in named:
        assert name in err, (name, err)


@pytest.mark.slow
def test_a_server_error_is_one_message_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with FakeServer(failures=10**6, failure_code=422) as server:  # HTTP 422: a request the server refuses
        status = cli.main(["fit", "--config", str(small_config(tmp_path)), "--trainer.devices=1",
                           "--trainer.max_steps=1", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
                           "--data.source.init_args.generator.class_path=lightning_dta.rl.OpenAICompatibleGenerator",
                           f"--data.source.init_args.generator.init_args.base_url={server.url}",
                           "--data.source.init_args.generator.init_args.model=toy",
                           "--data.source.init_args.generator.init_args.weight_sync=none"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    assert "lightning-dta fit: error: POST " in err and "HTTP 422: server overloaded" in err, err


def test_traceback_shows_the_traceback_of_bad_input(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--traceback", *BASE, "--model.engine.chunk_size=0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "engine/options.py" in err and "chunk_size=0" in err, err
    monkeypatch.setenv(cli.TRACEBACK, "1")
    assert cli.main([*BASE, "--data.rollouts_per_step=0"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "cli_main", broken)
    with pytest.raises(ZeroDivisionError):
        cli.main(BASE)


@pytest.mark.slow
def test_the_installed_command_exits_2_without_a_traceback(tmp_path: Path) -> None:
    """The console script itself (not ``main`` in this process): the exit status the shell sees."""
    proc = subprocess.run([str(Path(sys.executable).parent / "lightning-dta"), *BASE, "--trainer.devices=0"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "trainer.devices=0" in proc.stderr


def _misnamed_yaml(tmp_path: Path) -> str:
    path = tmp_path / "misnamed.yaml"
    path.write_text((REPO / "configs" / "tiny_cpu.yaml").read_text().replace("rollouts_per_step:", "rollout_per_step:"))
    return str(path)


TINY = ["fit", "--config", str(REPO / "configs" / "tiny_cpu.yaml")]
# (id, argv, what the one line must say); a callable argument gets tmp_path. Each is refused while parsing, before
# anything is built.
PARSE_CASES = [
    ("fit key misspelt", [*TINY, "--model.loss.clip_epsilon=0.2"],
     ["--model.loss.clip_epsilon", "did you mean --model.loss.clip_eps?"]),
    ("fit YAML key misspelt", ["fit", "--config", _misnamed_yaml],
     ["data.rollout_per_step", "did you mean data.rollouts_per_step?"]),
    ("fit value not allowed", [*TINY, "--model.engine.mode=DFS"],
     ["model.engine.mode='DFS'", "did you mean dfs?", "vanilla"]),
    ("fit value of the wrong type", [*TINY, "--model.engine.chunk_size=abc"],
     ["model.engine.chunk_size='abc'", "an int or null"]),
    ("fit class argument misspelt", [*TINY, "--model.optimizer.init_args.lrr=0.1"],
     ["torch.optim.AdamW takes no argument 'lrr'", "did you mean model.optimizer.init_args.lr?"]),
    ("fit value of a union not allowed", [*TINY, "--trainer.precision=16-truee"],
     ["trainer.precision='16-truee'", "did you mean 16-true?", "bf16-mixed"]),
    ("fit config file missing", ["fit", "--config", "/nonexistent/run.yaml"], ["/nonexistent/run.yaml"]),
    ("verb misspelt", ["fti", "--config", "x.yaml"], ["'fti' is not a verb", "did you mean fit?"]),
    ("plan key misspelt", ["plan", "--worklaod", "agent"], ["--worklaod", "did you mean --workload?"]),
    ("plan choice", ["plan", "--workload", "nosuch"], ["--workload 'nosuch'", "tau2-like"]),
    ("plan engine value", ["plan", "--engine.mode=DFS"], ["engine.mode='DFS'", "did you mean dfs?"]),
    ("plan not an int", ["plan", "--devices", "two"], ["devices='two'", "an int"]),
    ("bench unknown mode", ["bench", "--modes", "dfs,fast", "--no-progress"], ["--modes", "fast", "dfs-recompute"]),
    ("bench unknown workload", ["bench", "--workloads", "grpo,nosuch", "--no-progress"], ["'nosuch'", "tree-search"]),
    ("bench key misspelt", ["bench", "--modez", "dfs"], ["--modez", "did you mean --modes?"]),
    ("export no arguments", ["export"], ["checkpoint, out_dir must be given", "CHECKPOINT OUT_DIR"]),
    ("export no checkpoint", ["export", "/nonexistent/last.ckpt", "out"], ["/nonexistent/last.ckpt"]),
    ("convert unknown framework", ["convert", "trlx", "c.yaml"], ["framework 'trlx'", "did you mean trl?"]),
    ("convert no file", ["convert", "trl", "/nonexistent/c.yaml"], ["/nonexistent/c.yaml"]),
]


@pytest.mark.parametrize("case", PARSE_CASES, ids=[c[0] for c in PARSE_CASES])
def test_every_verb_refuses_bad_input_in_one_line_and_exit_2(case, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """No usage (it is for --help), no traceback: one line that names the setting and the fix."""
    _, argv, named = case
    argv = [a(tmp_path) if callable(a) else a for a in argv]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    verb = argv[0] if argv[0] in ("fit", *cli.COMMANDS) else None
    assert err.startswith(f"lightning-dta {verb}: error: " if verb else "lightning-dta: error: "), err
    assert err.count("\n") == 1 and "Fix: " in err and not out, (out, err)
    for name in named:
        assert name in err, (name, err)


@pytest.mark.slow
def test_a_refused_model_is_refused_before_anything_runs_and_its_fix_runs(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32: the toy RL job on a model the tree walk refuses (Jamba's Mamba mixers) is refused before
    the warm start and the first step, with the fix as the command's option; that option, added to the same
    command, runs the job (the warm start's forward-only walk included)."""
    config = yaml.safe_load((REPO / "configs" / "toy_rl_cpu.yaml").read_text())
    config["trainer"].update(max_steps=1, logger=False)
    config["trainer"]["callbacks"][0]["init_args"].update(sft_warmup_steps=2, reward_plot=None)
    config["model"]["model"].update(model_type="jamba", mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                    mamba_dt_rank=4, num_experts=1, attn_layer_period=2, attn_layer_offset=1)
    path = tmp_path / "hybrid.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["fit", "--config", str(path)]
    warm_start = callback.sft_warm_start

    def not_yet(*args, **kwargs):
        raise AssertionError("the warm start ran before the model was refused")

    monkeypatch.setattr(callback, "sft_warm_start", not_yet)
    assert cli.main(argv) == 2
    monkeypatch.setattr(callback, "sft_warm_start", warm_start)
    out, err = capsys.readouterr()
    assert "found 0 mixer modules" in err and "Epoch" not in out + err, err
    (fix,) = re.findall(r"Fix: (--\S+?)\.?$", err.strip())
    assert fix == "--model.engine.mode=vanilla", err
    assert cli.main([*argv, fix]) == 0, capsys.readouterr().err[-3000:]
    assert "SFT warm start: 2 steps" in capsys.readouterr().out


def applied(argv: list[str], err: str) -> list[str]:
    """``argv`` with the refusal's "did you mean X?" applied where the user wrote the mistake: the option or value
    on the command line, or the key in the --config file."""
    what = err.removeprefix("lightning-dta fit: error: ").split()[0].rstrip(":")
    (right,) = re.findall(r"did you mean (\S+)\?", err)
    if "=" in what:  # a value: KEY='VALUE'
        key, value = what.split("=", 1)
        return [f"--{key}={right}" if a == f"--{key}={value.strip(chr(39))}" else a for a in argv]
    if what.startswith("--") or ".init_args." in what:  # an option of the command line
        return [a.replace(what.lstrip("-"), right.lstrip("-"), 1) for a in argv]
    config = Path(argv[argv.index("--config") + 1])  # a key of the --config file
    config.write_text(config.read_text().replace(f"{what.rpartition('.')[2]}:", f"{right.rpartition('.')[2]}:"))
    return argv


FIXABLE = [c for c in PARSE_CASES if c[0].startswith("fit") and any("did you mean" in n for n in c[2])]


@pytest.mark.parametrize("case", FIXABLE, ids=[c[0] for c in FIXABLE])
def test_the_fix_of_every_refused_fit_setting_parses(case, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 32: the fix a refusal names, applied, is a config the parser takes (checked with --print_config)."""
    _, argv, _ = case
    argv = [a(tmp_path) if callable(a) else a for a in argv]
    assert cli.main(argv) == 2
    fixed = applied(argv, capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*fixed, "--print_config"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err
