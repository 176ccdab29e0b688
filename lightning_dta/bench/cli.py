"""``lightning-dta bench``: every training mode on the same model and the same rollouts, side by side.

The default run (a 4-layer, 256-wide Llama on the CPU; GRPO, multi-turn agent and tree-search steps) takes
about two minutes on two cores and prints a table; ``--out DIR`` also writes ``bench.json`` and the PNG
plots. Timings are medians of round-robin repeats; each row carries its gradient error against the
per-rollout baseline so that a fast but wrong mode shows.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_dta.bench import report
from lightning_dta.bench.model import ARCHITECTURES, PRESETS, build_model
from lightning_dta.bench.runner import (
    run_logprob_modes,
    run_mode,
    run_training_modes,
    saved_peak_bytes,
    training_modes,
)
from lightning_dta.bench.workloads import (
    AgentWorkload,
    FileWorkload,
    GRPOWorkload,
    LongSequenceWorkload,
    TreeSearchWorkload,
)
from lightning_dta.losses import PolicyLoss
from lightning_dta.tree import PrefixTree

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-dta bench", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    what = parser.add_argument_group("what to run")
    what.add_argument("--workloads", default="grpo,agent,tree-search",
                      help="comma-separated: grpo, agent, tree-search (a --rollouts-file adds 'file')")
    what.add_argument("--rollouts-file", default=None, help="also benchmark the rollouts of this JSONL file")
    what.add_argument("--modes", default="vanilla,vanilla-ckpt,vanilla-batched,mask,dfs,dfs-recompute",
                      help="training modes to compare, from vanilla, vanilla-ckpt, vanilla-batched, mask, dfs, "
                      "dfs-recompute, dfs-model-attention (dfs with the model's attention over a KV cache instead of "
                      "prefix attention); vanilla is always run: it is the baseline")
    what.add_argument("--no-logprobs", action="store_true", help="skip forward-only tree_logprobs vs per-rollout")
    what.add_argument("--memory-leaves", default="4,8,16,32,64", type=_ints,
                      help="leaf counts for the peak-memory-vs-leaves sweep (empty string: skip)")
    what.add_argument("--long-len", default=3072, type=int,
                      help="rollout length for the chunked-recompute memory check (0: skip)")
    what.add_argument("--profile", default=None, metavar="MODE",
                      help="also print a torch.profiler table (top ops) of one step of MODE on each workload")
    what.add_argument("--repeats", default=3, type=int, help="timed repeats per mode (round-robin)")
    what.add_argument("--warmup", default=1, type=int, help="untimed passes per mode before timing")
    what.add_argument("--seed", default=0, type=int, help="seed of the workload generators and the model")
    model = parser.add_argument_group("model (built from a config; random weights)")
    model.add_argument("--preset", default=None, choices=sorted(PRESETS),
                       help="shape of a real checkpoint (overrides --arch/--layers/--hidden/... )")
    model.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES), help="model family")
    model.add_argument("--layers", default=4, type=int, help="decoder layers")
    model.add_argument("--hidden", default=256, type=int, help="hidden size")
    model.add_argument("--heads", default=4, type=int, help="attention heads")
    model.add_argument("--kv-heads", default=None, type=int, help="key/value heads (default: --heads)")
    model.add_argument("--intermediate", default=None, type=int, help="MLP width (default 8/3 x hidden)")
    model.add_argument("--vocab", default=2048, type=int,
                       help="vocabulary; 2048 puts the LM head at ~17%% of the body's FLOPs, as in 2-8B models")
    model.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter dtype")
    model.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    model.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2)")
    engine = parser.add_argument_group("engine options")
    engine.add_argument("--chunk-size", default=256, type=int, help="chunk size of dfs-recompute")
    engine.add_argument("--sibling-batch-tokens", default=4096, type=int, help="dfs sibling batch budget (0: off)")
    engine.add_argument("--vanilla-batch-tokens", default=4096, type=int, help="token budget of vanilla-batched")
    sizes = parser.add_argument_group("workload sizes")
    sizes.add_argument("--grpo-prompts", default=2, type=int, help="GRPO groups (prompts) per step")
    sizes.add_argument("--grpo-group", default=8, type=int, help="responses per prompt")
    sizes.add_argument("--grpo-prompt-len", default=(380, 420), type=_pair, help="min,max")
    sizes.add_argument("--grpo-response-len", default=(64, 192), type=_pair, help="min,max")
    sizes.add_argument("--agent-episodes", default=2, type=int, help="agent episodes per step")
    sizes.add_argument("--agent-turns", default=5, type=int, help="LLM calls per episode")
    sizes.add_argument("--agent-system-len", default=1024, type=int, help="system prompt tokens")
    sizes.add_argument("--agent-thinking-len", default=(60, 200), type=_pair, help="min,max")
    sizes.add_argument("--tree-prompt-len", default=256, type=int, help="tree-search prompt tokens")
    sizes.add_argument("--tree-branching", default=(3, 3, 2), type=_ints, help="children per level")
    out = parser.add_argument_group("output")
    out.add_argument("--out", default=None, help="directory for bench.json and the PNG plots")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--threads", default=None, type=int, help="torch.set_num_threads")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _workloads(args: argparse.Namespace) -> dict[str, object]:
    available = {
        "grpo": GRPOWorkload(args.grpo_prompts, args.grpo_group, args.grpo_prompt_len, args.grpo_response_len),
        "agent": AgentWorkload(args.agent_episodes, args.agent_turns, args.agent_system_len,
                               thinking_len=args.agent_thinking_len),
        "tree-search": TreeSearchWorkload(args.tree_prompt_len, args.tree_branching),
    }
    chosen = {}
    for name in [w for w in args.workloads.split(",") if w]:
        if name not in available:
            raise SystemExit(f"unknown workload {name!r}; choose from {sorted(available)}")
        chosen[name] = available[name]
    if args.rollouts_file:
        chosen["file"] = FileWorkload(args.rollouts_file)
    return chosen


def _memory_scaling(model, leaves: Sequence[int], vocab: int, seed: int, sibling_batch_tokens: int | None
                    ) -> list[dict]:
    """Peak bytes saved for backward as the number of responses per prompt grows (dfs flat, mask grows)."""
    modes = {"dfs": dict(mode="dfs", sibling_batch_tokens=sibling_batch_tokens),
             "dfs-unbatched": dict(mode="dfs", sibling_batch_tokens=None),
             "mask": dict(mode="mask"), "vanilla": dict(mode="vanilla")}
    if model.config._attn_implementation not in ("sdpa", "eager"):
        del modes["mask"]  # flash attention takes no 4-D tree mask
    out = []
    for n in leaves:
        tree = PrefixTree.from_rollouts(GRPOWorkload(1, n, (400, 400), (128, 128)).generate(vocab, seed))
        for mode, kwargs in modes.items():
            out.append({"mode": mode, "leaves": n, "peak_saved_mib": saved_peak_bytes(model, tree, kwargs) / 2**20})
    return out


def _path_buffer_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """The dfs path buffers: keys, values and their gradients, per layer, for ``tokens`` positions. They are
    allocated outside autograd, so the saved-tensor meter does not see them."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 4 * config.num_hidden_layers * tokens * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _profile(model, tree: PrefixTree, loss_fn: PolicyLoss, kwargs: dict) -> str:
    """The top operators of one step (after a warm-up step), by self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    run_mode(model, tree, loss_fn, kwargs)
    with profile(activities=activities) as prof:
        run_mode(model, tree, loss_fn, kwargs)
    model.zero_grad(set_to_none=True)
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=48)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm import tqdm

    shape = dict(arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                 intermediate=args.intermediate, vocab=args.vocab)
    shape.update(PRESETS.get(args.preset, {}))
    model = build_model(**shape, dtype=DTYPES[args.dtype], device=args.device, attn_implementation=args.attn,
                        seed=args.seed)
    config = model.config
    sibling_budget = args.sibling_batch_tokens or None
    all_modes = training_modes(args.chunk_size, sibling_budget, args.vanilla_batch_tokens)
    wanted = {"vanilla", *[m for m in args.modes.split(",") if m]}
    unknown = wanted - set(all_modes)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {sorted(all_modes)}")
    modes = {name: kwargs for name, kwargs in all_modes.items() if name in wanted}
    loss_fn = PolicyLoss()
    workloads = _workloads(args)
    total = len(workloads) * (len(modes) * (args.repeats + 1) + (0 if args.no_logprobs else 2 * args.repeats))
    bar = tqdm(total=total, desc="bench", disable=args.no_progress, file=sys.stderr)

    def progress(message: str) -> None:
        bar.set_postfix_str(message)
        bar.update(1)

    all_rows = []
    profiles: dict[str, str] = {}
    if args.profile and args.profile not in all_modes:
        raise SystemExit(f"--profile {args.profile!r}: choose from {sorted(all_modes)}")
    for name, workload in workloads.items():
        tree = PrefixTree.from_rollouts(workload.generate(config.vocab_size, args.seed), vocab_size=config.vocab_size,
                                        max_positions=config.max_position_embeddings)
        trained = sum(sum(r.mask()[1:]) for r in tree.rollouts)
        shape_args = ([(n.start, n.length) for n in tree.iter_nodes()], [len(t) for t in tree.token_tensors])
        model_args = (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size)
        limit = report.flop_speedup_limit(*shape_args, trained, *model_args)
        forward_limit = report.flop_speedup_limit(*shape_args, None, *model_args)
        bar.set_description(f"bench {name}")
        results = run_training_modes(model, tree, loss_fn, modes, args.repeats, args.warmup, progress)
        rows = report.rows(name, tree.stats, results, limit)
        if not args.no_logprobs:  # forward only: against the per-rollout forward, with its own FLOP limit
            rows += report.rows(name, tree.stats, run_logprob_modes(model, tree, args.repeats, progress),
                                forward_limit, baseline="logprobs-vanilla")
        if args.profile:
            profiles[name] = _profile(model, tree, loss_fn, all_modes[args.profile])
        all_rows += rows
    memory_scaling = _memory_scaling(model, args.memory_leaves, config.vocab_size, args.seed, sibling_budget) \
        if args.memory_leaves else []
    long_rows = []
    if args.long_len:
        long_tree = PrefixTree.from_rollouts(LongSequenceWorkload(1, args.long_len).generate(config.vocab_size,
                                                                                            args.seed))
        for mode, kwargs in {"vanilla": dict(mode="vanilla"), "dfs": dict(mode="dfs"),
                             "dfs-recompute": dict(mode="dfs", activation="recompute", chunk_size=args.chunk_size)
                             }.items():
            saved = saved_peak_bytes(model, long_tree, kwargs)
            path = _path_buffer_bytes(config, args.long_len, DTYPES[args.dtype]) if kwargs["mode"] == "dfs" else 0
            long_rows.append({"mode": mode, "tokens": args.long_len, "peak_saved_mib": saved / 2**20,
                              "path_buffers_mib": path / 2**20, "total_mib": (saved + path) / 2**20})
    bar.close()

    print(f"model: {shape['arch']} {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}, {args.dtype} on {args.device}; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads")
    print(report.table(all_rows))
    for name, text in profiles.items():
        print(f"\ntorch.profiler, one {args.profile} step of {name}:\n{text}")
    if memory_scaling:
        print("\npeak bytes saved for backward (MiB) vs leaves per prompt (400-token prompt, 128-token responses):")
        for mode in ("dfs", "dfs-unbatched", "mask", "vanilla"):
            values = [f"{m['leaves']}: {m['peak_saved_mib']:.1f}" for m in memory_scaling if m["mode"] == mode]
            print(f"  {mode:<8} " + "  ".join(values))
    if long_rows:
        base = long_rows[0]["total_mib"]
        print(f"\none {args.long_len}-token rollout, peak bytes saved for backward + dfs path key/value buffers:")
        for row in long_rows:
            print(f"  {row['mode']:<14} {row['peak_saved_mib']:8.1f} + {row['path_buffers_mib']:5.1f} = "
                  f"{row['total_mib']:8.1f} MiB  ({row['total_mib'] / base:.2f} of per-rollout)")
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        meta = {"date": datetime.date.today().isoformat(), "argv": list(argv or sys.argv[1:]),
                "machine": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "device": args.device, "long_sequence": long_rows}
        report.write_json(out_dir / "bench.json", meta, all_rows, memory_scaling)
        written = [out_dir / "bench.json"]
        if not args.no_plots:
            written += report.plot(out_dir, all_rows, memory_scaling)
        print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
