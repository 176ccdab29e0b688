"""`lightning-dta bench` end to end on a very small model and workload: table, JSON, plots, exact modes."""

from __future__ import annotations

import json

import lightning_dta as dta
from lightning_dta.bench.cli import build_parser, main


def test_bench_small_run_writes_json_and_plots(tmp_path, capsys):
    argv = ["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--repeats", "1",
            "--grpo-prompts", "1", "--grpo-group", "3", "--grpo-prompt-len", "24,30", "--grpo-response-len", "4,9",
            "--agent-episodes", "1", "--agent-turns", "2", "--agent-system-len", "32", "--agent-thinking-len", "4,8",
            "--tree-prompt-len", "16", "--tree-branching", "2,2", "--memory-leaves", "2,4", "--long-len", "64",
            "--recompute-chunk", "16", "--no-progress", "--out", str(tmp_path),
            "--results-jsonl", str(tmp_path / "parts.jsonl"),
            "--modes", "vanilla,vanilla-ckpt,vanilla-batched,mask,dfs,dfs-recompute,prefix-grouper"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "dfs-recompute" in printed and "vanilla-ckpt" in printed and "logprobs-tree" in printed
    # the GPU-only peer is skipped with its reason, never silently
    assert "skipped grpo: prefix-grouper: it runs through flash-attention 2's varlen kernels" in printed
    assert "skipped agent: prefix-grouper shares one level" in printed
    record = json.loads((tmp_path / "bench.json").read_text())
    assert len(record["meta"]["skipped"]) == 3
    rows = record["results"]
    assert {r["workload"] for r in rows} == {"grpo", "agent", "tree-search"}
    for row in rows:
        assert row["median_s"] > 0 and row["compression"] > 1.0
        limit = 1e-6 if row["mode"].startswith("logprobs") else 1e-5  # float32 model
        assert row["grad_rel_error"] < limit, row
        if not row["mode"].startswith("logprobs"):
            assert row["peak_saved_mib"] > 0
    dfs = {m["leaves"]: m["peak_saved_mib"] for m in record["memory_scaling"] if m["mode"] == "dfs"}
    mask = {m["leaves"]: m["peak_saved_mib"] for m in record["memory_scaling"] if m["mode"] == "mask"}
    assert mask[4] > mask[2] and set(dfs) == {2, 4}
    # each part was appended as it finished, with the same rows (a run stopped midway keeps what it measured)
    parts = [json.loads(line) for line in (tmp_path / "parts.jsonl").read_text().splitlines()]
    assert [p.get("workload", p["part"]) for p in parts] == ["grpo", "agent", "tree-search", "memory_scaling",
                                                              "long_sequence"]
    assert [r for p in parts[:3] for r in p["results"]] == rows
    assert parts[3]["memory_scaling"] == record["memory_scaling"] and parts[0]["meta"]["device"] == "cpu"
    assert (tmp_path / "speedup_vs_compression.png").stat().st_size > 1000
    assert (tmp_path / "memory_vs_leaves.png").stat().st_size > 1000


def test_bench_help_documents_every_option():
    text = build_parser().format_help()
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"
    assert "<function" not in text and "%%" not in text, text  # issue 32: types named, percent signs single


def test_flop_limit_of_known_shapes():
    from lightning_dta.plan.flops import ModelShape, speedup_limit

    model = ModelShape(layers=2, hidden=16, heads=2, kv_heads=2, head_dim=8, intermediate=40, vocab=64)

    def tree(*rollouts: list[int]) -> dta.PrefixTree:
        return dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=ids) for ids in rollouts])

    # two identical 10-token rollouts: one 10-token node; forward-only shares everything, so the limit is 2
    assert speedup_limit(model, tree(list(range(10)), list(range(10))), None) == 2.0
    # no sharing: 1 whatever the head does
    assert speedup_limit(model, tree(list(range(5)), list(range(10, 17))), 6) == 1.0
    # a shared 8-token prompt, two 4-token responses: linear-only compression is 24 / 16 = 1.5; training's head
    # on trained tokens and the responses' attention over the prompt are not shared, so the limit is lower
    shared = tree(list(range(8)) + [20, 21, 22, 23], list(range(8)) + [30, 31, 32, 33])
    training, forward = speedup_limit(model, shared, 6), speedup_limit(model, shared, None)
    assert 1.0 < training < forward < 1.5


def test_a_hybrid_beside_a_plain_model_in_one_run(tmp_path, capsys):
    """``--arch qwen3_5 --also-arch llama``: both models on the same workload, the tree mask skipped for the hybrid
    with its reason, the hybrid's FLOP limit from the hybrid's layers (three Gated DeltaNet layers attend no pairs),
    and the dfs rows side by side."""
    from lightning_dta.core.tree import PrefixTree
    from lightning_dta.plan.flops import ModelShape, speedup_limit
    from lightning_dta.shapes.models import model_config
    from lightning_dta.shapes.workloads import GRPOWorkload

    argv = ["--arch", "qwen3_5", "--also-arch", "llama", "--layers", "4", "--hidden", "32", "--heads", "2",
            "--vocab", "64", "--repeats", "1", "--workloads", "grpo", "--grpo-prompts", "1", "--grpo-group", "3",
            "--grpo-prompt-len", "24,30", "--grpo-response-len", "4,9", "--memory-leaves", "2", "--long-len", "0",
            "--modes", "vanilla,mask,dfs", "--no-progress", "--no-plots", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "model: qwen3_5 4 layers (1 attention)" in printed and "model: llama 4 layers," in printed, printed
    assert "skipped grpo: mask: a tree mask cannot reach a hybrid's recurrent layers" in printed, printed
    side = printed.split("side by side")[1]
    assert "qwen3_5" in side and "llama" in side, side
    rows = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert {(r["model"], r["mode"]) for r in rows if r["mode"] in ("mask", "dfs")} == {
        ("qwen3_5", "dfs"), ("llama", "dfs"), ("llama", "mask")}
    for row in rows:
        assert row["grad_rel_error"] < 1e-5, row
    tree = PrefixTree.from_rollouts(GRPOWorkload(1, 3, (24, 30), (4, 9)).generate(64, 0))
    trained = sum(sum(r.mask()[1:]) for r in tree.rollouts)
    config = model_config(arch="qwen3_5", layers=4, hidden=32, heads=2, vocab=64)
    hybrid = next(r for r in rows if (r["model"], r["mode"]) == ("qwen3_5", "dfs"))
    assert hybrid["flop_speedup_limit"] == speedup_limit(ModelShape.from_config(config), tree, trained)
    assert ModelShape.from_config(config).attention_layers == 1
