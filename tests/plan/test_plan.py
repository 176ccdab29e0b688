"""``lightning-dta plan``: its predictions against what the engine really saves and computes.

The predicted peak of bytes saved for backward is checked against :class:`SavedTensorMeter` around the real
``tree_backward`` for every mode the planner predicts, on the three bench shapes (small sizes), for a Llama in
float32 and a Qwen3 with grouped-query attention in bfloat16. The issue asks for 15%; the model is exact per
forward (module docstring of ``lightning_dta.plan.rates``), so the tests hold it to 2%.
"""

from __future__ import annotations

import json
import re
import shlex
from types import SimpleNamespace

import pytest
import torch

from lightning_dta.bench.runner import path_buffer_bytes, saved_peak_bytes
from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.rollout import Rollout, write_rollouts
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine import EngineOptions
from lightning_dta.engine.activation_budget import measure_rates
from lightning_dta.engine.model_info import inspect_model
from lightning_dta.plan import ModelShape, TrainingState, plan_step, probe_rates
from lightning_dta.plan.cli import common_fits, gib, main, parse_bytes
from lightning_dta.plan.flops import speedup_limit
from lightning_dta.plan.predict import HEADROOM, fitting_options
from lightning_dta.shapes.models import build_model
from lightning_dta.shapes.modes import ModeSpec, planned_modes
from lightning_dta.shapes.workloads import AgentWorkload, GRPOWorkload, TreeSearchWorkload

VOCAB = 512
WORKLOADS = {
    "grpo": GRPOWorkload(2, 4, (90, 110), (24, 64)),
    "agent": AgentWorkload(2, 3, 200, (10, 30), (10, 40), (20, 50), (5, 15)),
    "tree-search": TreeSearchWorkload(64, (2, 2, 2), (12, 40)),
}
MODELS = {  # name -> (shape, Lightning precision)
    "llama-fp32": (dict(layers=3, hidden=64, heads=4, vocab=VOCAB, dtype=torch.float32), "32-true"),
    "qwen3-bf16": (dict(arch="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, vocab=VOCAB,
                        dtype=torch.bfloat16), "bf16-true"),
}
BOUND = 0.02


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_and_rates(request):
    shape, precision = MODELS[request.param]
    model = build_model(**shape)
    return model, probe_rates(model.config, shape["dtype"]), precision


def test_clone_probes_give_the_rates_the_engine_probes_on_the_whole_model(model_and_rates) -> None:
    model, rates, _ = model_and_rates
    info = inspect_model(model, uses_cache=True, prefix_attention=None, prefix_attention_backend=None)
    assert rates.packed
    whole = measure_rates(model, info, torch.float32, PolicyLoss())
    assert rates.budget_rates() == pytest.approx(whole, rel=1e-6)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_predicted_peak_of_saved_bytes_matches_the_engine(model_and_rates, workload: str) -> None:
    model, rates, precision = model_and_rates
    tree = PrefixTree.from_rollouts(WORKLOADS[workload].generate(VOCAB, 0))
    modes = planned_modes(EngineOptions(), recompute_chunk=32)
    keep = saved_peak_bytes(model, tree, modes["dfs"])
    modes["dfs-auto"] = ModeSpec(EngineOptions(activation="auto", activation_memory_budget=int(0.6 * keep)))
    modes["dfs-unbatched"] = ModeSpec(EngineOptions(sibling_batch_tokens=None))
    modes["dfs-chunked"] = ModeSpec(EngineOptions(chunk_size=48))
    plan = plan_step(tree, model.config, rates, TrainingState(1, precision=precision), modes)
    errors = {}
    for name, spec in modes.items():
        measured = saved_peak_bytes(model, tree, spec)
        errors[name] = plan.modes[name].saved / measured - 1
    worst = {n: f"{e:+.2%}" for n, e in errors.items() if abs(e) > BOUND}
    assert not worst, worst
    dtype = next(model.parameters()).dtype
    assert plan.modes["dfs"].path_buffers == path_buffer_bytes(model.config, tree.stats.max_depth_tokens, dtype)
    assert plan.modes["vanilla"].path_buffers == 0


def _flops_by_definition(shape: ModelShape, pieces: list[tuple[int, int, int]]) -> float:
    """Forward + backward (3 forwards) of pieces (prefix, new tokens, scored positions)."""
    return sum(3 * shape.forward_flops(n, n * p + n * (n + 1) // 2, c) for p, n, c in pieces)


def test_flops_follow_the_definition() -> None:
    config = build_model(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=VOCAB).config
    shape = ModelShape.from_config(config)
    assert shape.linear_macs_per_token == 2 * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * config.intermediate_size)
    prompt = list(range(40))
    rollouts = [Rollout(input_ids=prompt + list(range(first, first + n)), loss_mask=[0] * 40 + [1] * n)
                for first, n in ((100, 10), (200, 20))]
    tree = PrefixTree.from_rollouts(rollouts)
    rates = probe_rates(config, torch.float32)
    plan = plan_step(tree, config, rates, TrainingState(1, precision="32-true"),
                     planned_modes(EngineOptions(sibling_batch_tokens=None), recompute_chunk=64))
    # position p predicts token p+1: the prompt's last position is scored, responses' last positions are not
    vanilla = _flops_by_definition(shape, [(0, 50, 10), (0, 60, 20)])
    dfs = _flops_by_definition(shape, [(0, 40, 1), (40, 10, 9), (40, 20, 19)])
    assert plan.modes["vanilla"].flops == pytest.approx(vanilla)
    assert plan.modes["dfs"].flops == pytest.approx(dfs)
    # recompute: the prompt's body forward once more; checkpointing: every rollout's body once more
    assert plan.modes["dfs-recompute"].flops == pytest.approx(dfs + shape.forward_flops(40, 40 * 41 // 2, 0))
    assert plan.modes["vanilla-ckpt"].flops == pytest.approx(
        vanilla + shape.forward_flops(110, 50 * 51 // 2 + 60 * 61 // 2, 0))


def test_flops_agree_with_the_bench_flop_limit() -> None:
    """Where no scored position is shared (the bench's limit counts the head per trained token in both), the ratio
    of the planner's vanilla and dfs FLOPs is the bench's FLOP limit."""
    model = build_model(layers=2, hidden=64, heads=4, vocab=VOCAB)
    rollouts = WORKLOADS["grpo"].generate(VOCAB, 0)
    for r in rollouts:  # the first response token untrained: the prompt's last position is scored by no rollout
        first = r.loss_mask.index(1)
        r.loss_mask[first] = 0
    tree = PrefixTree.from_rollouts(rollouts)
    plan = plan_step(tree, model.config, probe_rates(model.config, torch.float32), TrainingState(1))
    trained = sum(sum(r.mask()[1:]) for r in tree.rollouts)
    limit = speedup_limit(ModelShape.from_config(model.config), tree, head_positions=trained)
    assert plan.modes["vanilla"].flops / plan.modes["dfs"].flops == pytest.approx(limit, rel=1e-9)


def test_options_that_fit_do_fit_when_run() -> None:
    """A memory below dfs keep's need: keep is not offered; the cheapest option offered, run for real, saves no more
    than predicted, and the predicted peak is within the memory."""
    model = build_model(layers=3, hidden=64, heads=4, vocab=VOCAB)
    config = model.config
    tree = PrefixTree.from_rollouts(WORKLOADS["agent"].generate(VOCAB, 0))
    rates = probe_rates(config, torch.float32)
    state = TrainingState(sum(p.numel() for p in model.parameters()), precision="32-true")
    keep = plan_step(tree, config, rates, state).modes["dfs"]
    memory = (state.total + 0.6 * keep.activations) / (1 - HEADROOM)
    fits = fitting_options(tree, config, rates, state, memory)
    names = [f.prediction.name for f in fits]
    assert "dfs keep" not in names and names, names
    best = fits[0]
    assert best.peak <= memory * (1 - HEADROOM)
    assert best.prediction.flops < fits[-1].prediction.flops
    measured = saved_peak_bytes(model, tree, ModeSpec(best.prediction.engine))
    assert measured <= best.prediction.saved * (1 + BOUND)


def test_state_memory_replicated_and_sharded() -> None:
    replicated = TrainingState(1_000_000, precision="bf16-true", optimizer="adamw")
    assert (replicated.weights, replicated.gradients, replicated.optimizer_state) == (2e6, 2e6, 4e6)
    assert replicated.total == 8e6 and replicated.gathered == 0
    sharded = TrainingState(1_000_000, precision="bf16-mixed", strategy="dta_fsdp", ranks=8)
    # fp32 weights, gradients and two AdamW states over 8 ranks; during the walk the full weights in bf16 and the
    # full gradient in float32 (every unit unsharded, the reduce-scatter deferred to the end of the step)
    assert sharded.total == pytest.approx(4 * 4e6 / 8 + 1_000_000 * (2 + 4))
    with pytest.raises(ValueError, match="precision"):
        TrainingState(1, precision="fp8")
    with pytest.raises(ValueError, match="autocast"):
        TrainingState(1, precision="bf16-mixed", strategy="dta")


def test_parse_bytes() -> None:
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5e9B") == 1_500_000_000
    assert parse_bytes("1E3B") == parse_bytes("1e3 b") == parse_bytes("1e+3B") == 1000
    with pytest.raises(ValueError, match="80GB"):
        parse_bytes("80 parsecs")
    with pytest.raises(ValueError, match=r"'80' has no unit\. Fix: 80GB or 80GiB \(the units: B, kB, MB, GB"):
        parse_bytes("80")  # 80 bytes, never what was meant


def test_fits_are_listed_cheapest_first_then_by_peak() -> None:
    """Issue 32: at equal FLOPs the option with the smaller peak comes first."""
    def fit(name: str, tflops: float, peak: float) -> SimpleNamespace:
        return SimpleNamespace(prediction=SimpleNamespace(name=name, engine=EngineOptions(), flops=tflops * 1e12),
                               peak=peak)

    fits = common_fits([[fit("dfs keep", 7.1, 70e9), fit("dfs auto", 7.1, 60e9), fit("dfs recompute", 8.8, 50e9),
                          fit("dfs slow", 9.0, 10e9)]])
    assert [f["name"] for f in fits] == ["dfs auto", "dfs keep", "dfs recompute", "dfs slow"]


def test_cli_prints_every_mode_and_what_fits(capsys) -> None:
    assert main(["--workload", "tree-search", "--memory", "100MiB", "--precision", "32-true"]) == 0
    out, err = capsys.readouterr()
    assert "lightning-dta plan: probing activation rates" in err and "running the step's schedule dry" in err, err
    for mode in ("vanilla ", "vanilla-ckpt", "dfs ", "dfs-recompute", "tree_logprobs",
                 "fit 90 MiB per rank: --memory 100MiB less 10% of it (10 MiB) left to the allocator",
                 "activation:"):
        assert mode in out, out
    assert main(["--workload", "grpo", "--devices", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["ranks"] == 2 and set(record["modes"]) == {"vanilla", "vanilla-ckpt", "dfs", "dfs-recompute"}
    assert record["modes"]["dfs"]["tflops"] < record["modes"]["vanilla"]["tflops"]


def test_cli_reads_a_model_directory_and_a_rollout_file(tmp_path, capsys) -> None:
    build_model(layers=2, hidden=64, heads=4, vocab=VOCAB).config.save_pretrained(tmp_path / "model")
    rollouts = tmp_path / "step.jsonl"
    write_rollouts(rollouts, WORKLOADS["grpo"].generate(VOCAB, 0))
    assert main(["--model", str(tmp_path / "model"), "--rollouts", str(rollouts)]) == 0
    assert "8 rollouts" in capsys.readouterr().out


def test_cli_bad_input_exits_2_with_the_fix(tmp_path, capsys) -> None:
    assert main(["--model", str(tmp_path / "nowhere")]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["--memory", "lots"]) == 2
    assert "80GB" in capsys.readouterr().err
    assert main(["--memory", "0GB"]) == 2 and "at least one byte" in capsys.readouterr().err
    assert main(["--memory", "1e400GB"]) == 2 and "at most 2**63 bytes" in capsys.readouterr().err
    assert main(["--memory", "1e30B"]) == 2 and "more than any accelerator holds" in capsys.readouterr().err
    assert main(["--memory", "80"]) == 2 and "has no unit. Fix: 80GB or 80GiB" in capsys.readouterr().err
    assert main(["--rollouts", str(tmp_path)]) == 2 and str(tmp_path) in capsys.readouterr().err
    assert main(["--recompute-chunk", "0"]) == 2 and "--recompute-chunk" in capsys.readouterr().err
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert main(["--model", str(tmp_path / "broken")]) == 2 and "not a Hugging Face" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["--rollouts", str(tmp_path / "empty.jsonl")]) == 2 and "no rollouts" in capsys.readouterr().err
    assert main(["--precision", "bf16-mixed"]) == 2 and "autocast" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": "oops"}\n')
    assert main(["--rollouts", str(bad)]) == 2
    assert f"{bad}:2" in capsys.readouterr().err


def test_the_readme_plan_command_runs_as_printed(capsys) -> None:
    from tests.helpers import REPO

    commands = re.findall(r"^lightning-dta plan (.*)$", (REPO / "README.md").read_text(), flags=re.MULTILINE)
    assert commands, "the README lost its plan command"
    for command in commands:
        assert main(shlex.split(command)) == 0
        assert "engine options that fit" in capsys.readouterr().out


def test_sizes_print_in_a_unit_that_shows_them() -> None:
    assert (gib(1000), gib(2048), gib(3 * 2**20), gib(5 * 2**30)) == ("1000 B", "2.0 KiB", "3.0 MiB", "5.00 GiB")


def _small_model(tmp_path, **shape):
    config = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64) | shape
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "config.json")


def test_rollouts_a_model_cannot_take_are_named_by_line_before_the_split(tmp_path, capsys) -> None:
    from tests.helpers import REPO

    rollouts = REPO / "data" / "tiny_rollouts.jsonl"  # vocabulary 256: too large for a 100-token model
    assert main(["--model", _small_model(tmp_path), "--rollouts", str(rollouts), "--devices", "2"]) == 2
    err = capsys.readouterr().err
    assert f"faulty rollouts in {rollouts}:" in err and f"{rollouts}:1: rollout index 0, field 'input_ids'" in err, err


def test_the_default_workload_that_does_not_fit_says_so(tmp_path, capsys) -> None:
    assert main(["--model", _small_model(tmp_path)]) == 2  # 64 positions: the agent workload's rollouts are longer
    err = capsys.readouterr().err
    assert "the workload agent (the default step) does not fit" in err and "in the rollouts" not in err, err
    assert "Fix: another workload (--workload" in err and "--rollouts FILE" in err, err


def test_an_invalid_model_shape_is_exit_2(tmp_path, capsys) -> None:
    assert main(["--model", _small_model(tmp_path, hidden_size=63)]) == 2
    err = capsys.readouterr().err
    assert "hidden size (63) is not a multiple" in err and "Traceback" not in err, err


def test_more_ranks_than_rollouts_is_noted_and_the_advice_fits_the_strategy(capsys) -> None:
    assert main(["--workload", "grpo", "--devices", "100", "--memory", "1000B"]) == 0
    out, err = capsys.readouterr()
    assert "16 rollouts over --devices 100: 84 ranks have nothing to train" in err, err
    assert "fit 900 B per rank" in out and "Shard the state (--strategy dta_fsdp)" in out, out
    assert main(["--workload", "grpo", "--strategy", "dta_fsdp", "--devices", "2", "--memory", "1000B"]) == 0
    out = capsys.readouterr().out
    assert "none:" in out and "--strategy dta_fsdp" not in out.split("none:")[1], out
