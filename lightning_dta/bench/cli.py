"""``lightning-dta bench``: every training mode on the same model and the same rollouts, side by side.

The default run (a 4-layer, 256-wide Llama on the CPU; GRPO, multi-turn agent and tree-search steps) takes
3.5-4 minutes on two cores (measured 2026-12-01: 3 min 28 s and 3 min 51 s) and prints a table; ``--out DIR``
also writes ``bench.json`` and the PNG plots. Timings are medians of round-robin repeats; each row carries its
gradient error against the per-rollout baseline so that a fast but wrong mode shows.

``--arch qwen3_5`` benches a hybrid (Gated DeltaNet layers, full attention every fourth); ``--also-arch`` runs the
same workloads on models of other families with the same sizes in the same run, one after the other, and ends with
the dfs rows of every model side by side.
"""

from __future__ import annotations

import datetime
import inspect
import platform
import sys
from argparse import Action
from collections.abc import Sequence
from pathlib import Path

import torch
from jsonargparse import ArgumentParser, DefaultHelpFormatter, Namespace

from lightning_dta.arguments import parse_args
from lightning_dta.bench import report
from lightning_dta.bench.runner import (
    LONG_ROLLOUT_MODES,
    MEMORY_SWEEP_MODES,
    BenchResults,
    has_recurrent_layers,
    run_bench,
    skip_reason,
    takes_tree_mask,
)
from lightning_dta.bench.work import BenchWork, bench_flops
from lightning_dta.cli import add_engine_options
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine import EngineOptions
from lightning_dta.engine.layer_kinds import is_recurrent, model_layer_kinds
from lightning_dta.plan.flops import ModelShape
from lightning_dta.shapes.models import ARCHITECTURES, PRESETS, build_model, model_config
from lightning_dta.shapes.modes import RECOMPUTE_CHUNK, ModeSpec, compared_modes
from lightning_dta.shapes.workloads import AgentWorkload, FileWorkload, GRPOWorkload, TreeSearchWorkload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _pair(text: str | tuple[int, int]) -> tuple[int, int]:
    """MIN,MAX"""
    if isinstance(text, tuple):  # jsonargparse checks the parsed value with the type again
        return text
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def _archs(text: str | tuple[str, ...]) -> tuple[str, ...]:
    """comma-separated model families"""
    if isinstance(text, tuple):
        return text
    names = tuple(a for a in text.split(",") if a)
    unknown = sorted(set(names) - set(ARCHITECTURES))
    if unknown:
        raise ValueError(f"unknown model famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; choose "
                         f"from {', '.join(sorted(ARCHITECTURES))}")
    return names


def _ints(text: str | tuple[int, ...]) -> tuple[int, ...]:
    """comma-separated ints"""
    if isinstance(text, tuple):
        return text
    return tuple(int(x) for x in text.split(",") if x)


class _HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, with a converter function's type named by its docstring (``MIN,MAX``), not by the
    function's repr (``<function _pair at 0x...>``)."""

    def _get_type_str(self, action: Action) -> str | None:
        if inspect.isfunction(action.type):
            return action.type.__doc__
        return super()._get_type_str(action)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="lightning-dta bench", description=__doc__, default_meta=False, exit_on_error=False,
                            formatter_class=_HelpFormatter)
    what = parser.add_argument_group("what to run")
    what.add_argument("--workloads", default="grpo,agent,tree-search",
                      help="comma-separated: grpo, agent, tree-search (a --rollouts-file adds 'file')")
    what.add_argument("--rollouts-file", default=None, help="also benchmark the rollouts of this JSONL file")
    what.add_argument("--modes", default="vanilla,vanilla-ckpt,vanilla-batched,mask,dfs,dfs-recompute",
                      help="training modes to compare, from vanilla, vanilla-ckpt, vanilla-batched, mask, dfs, "
                      "dfs-recompute, dfs-model-attention (dfs with the model's attention over a KV cache instead of "
                      "prefix attention), prefix-grouper (the published one-level peer; GRPO workloads, CUDA with "
                      "flash-attn and the prefix_grouper package); vanilla is always run: it is the baseline")
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
    model.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES),
                       help="model family (qwen3_5: a hybrid, Gated DeltaNet layers with full attention every fourth "
                       "layer, its Gated DeltaNet heads sized like the attention heads)")
    model.add_argument("--also-arch", default="", type=_archs,
                       help="comma-separated: also bench models of these families with the same sizes, in the same "
                       "run after --arch, and print the dfs rows of all side by side (e.g. --arch qwen3_5 "
                       "--also-arch llama)")
    model.add_argument("--layers", default=4, type=int, help="decoder layers")
    model.add_argument("--hidden", default=256, type=int, help="hidden size")
    model.add_argument("--heads", default=4, type=int, help="attention heads")
    model.add_argument("--kv-heads", default=None, type=int, help="key/value heads (default: --heads)")
    model.add_argument("--intermediate", default=None, type=int, help="MLP width (default 8/3 x hidden)")
    model.add_argument("--vocab", default=2048, type=int,
                       help="vocabulary; 2048 puts the LM head at ~17% of the body's FLOPs, as in 2-8B models")
    model.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter dtype")
    model.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    model.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2)")
    add_engine_options(parser)
    compared = parser.add_argument_group("compared rows")
    compared.add_argument("--recompute-chunk", default=RECOMPUTE_CHUNK, type=int,
                          help="chunk_size of the dfs-recompute row and of the long-rollout memory check")
    sizes = parser.add_argument_group("workload sizes")
    sizes.add_argument("--grpo-prompts", default=2, type=int, help="GRPO groups (prompts) per step")
    sizes.add_argument("--grpo-group", default=8, type=int, help="responses per prompt")
    sizes.add_argument("--grpo-prompt-len", default=(380, 420), type=_pair, help="prompt tokens")
    sizes.add_argument("--grpo-response-len", default=(64, 192), type=_pair, help="response tokens")
    sizes.add_argument("--agent-episodes", default=2, type=int, help="agent episodes per step")
    sizes.add_argument("--agent-turns", default=5, type=int, help="LLM calls per episode")
    sizes.add_argument("--agent-system-len", default=1024, type=int, help="system prompt tokens")
    sizes.add_argument("--agent-thinking-len", default=(60, 200), type=_pair, help="thinking tokens per turn")
    sizes.add_argument("--tree-prompt-len", default=256, type=int, help="tree-search prompt tokens")
    sizes.add_argument("--tree-branching", default=(3, 3, 2), type=_ints, help="children per level")
    out = parser.add_argument_group("output")
    out.add_argument("--out", default=None, help="directory for bench.json and the PNG plots")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--results-jsonl", default=None,
                     help="append each part's results (a workload's rows, the memory sweep, the long rollout) to this "
                     "JSON-lines file as soon as it is measured, so that a run stopped midway keeps them")
    out.add_argument("--threads", default=None, type=int, help="torch.set_num_threads")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _workloads(args: Namespace) -> dict[str, object]:
    available = {
        "grpo": GRPOWorkload(args.grpo_prompts, args.grpo_group, args.grpo_prompt_len, args.grpo_response_len),
        "agent": AgentWorkload(args.agent_episodes, args.agent_turns, args.agent_system_len,
                               thinking_len=args.agent_thinking_len),
        "tree-search": TreeSearchWorkload(args.tree_prompt_len, args.tree_branching),
    }
    chosen = {}
    for name in [w for w in args.workloads.split(",") if w]:
        if name not in available:
            raise ConfigError(f"--workloads: unknown workload {name!r}. Fix: a comma-separated list from "
                              f"{', '.join(sorted(available))}")
        chosen[name] = available[name]
    if args.rollouts_file:
        chosen["file"] = FileWorkload(args.rollouts_file)
    return chosen


def _shape(args: Namespace, arch: str | None = None) -> dict:
    shape = dict(arch=arch or args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                 kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab)
    shape.update(PRESETS.get(args.preset, {}))
    return shape


def _model(args: Namespace, arch: str) -> torch.nn.Module:
    return build_model(**_shape(args, arch), dtype=DTYPES[args.dtype], device=args.device,
                       attn_implementation=args.attn, seed=args.seed)


def estimate(argv: Sequence[str]) -> tuple[BenchWork, object]:
    """The FLOPs that ``lightning-dta bench ARGV`` will compute (:mod:`~lightning_dta.bench.work`; every model of
    ``--arch`` and ``--also-arch`` together) and the ``--arch`` model's config, without building a model or running
    anything."""
    parser = build_parser()
    args = parse_args(parser, list(argv), "bench")
    modes, _ = _modes(args, parser.instantiate(args).engine)
    device = torch.device(args.device)
    works, configs = [], []
    for arch in _archs_of(args):
        config = model_config(**_shape(args, arch), attn_implementation=args.attn)
        recurrent = has_recurrent_layers(config)
        workloads = {}
        for name, workload in _workloads(args).items():
            tree = PrefixTree.from_rollouts(workload.generate(config.vocab_size, args.seed))
            workloads[name] = (tree, {m: s for m, s in modes.items()
                                      if skip_reason(m, s, name, device, recurrent) is None})
        works.append(bench_flops(ModelShape.from_config(config), workloads, repeats=args.repeats, warmup=args.warmup,
                                 logprobs=not args.no_logprobs, memory_leaves=args.memory_leaves,
                                 long_len=args.long_len, recompute_chunk=args.recompute_chunk,
                                 vocab=config.vocab_size, seed=args.seed, mask_in_sweep=takes_tree_mask(config)))
        configs.append(config)
    total = BenchWork({name: sum(w.workloads[name] for w in works) for name in works[0].workloads},
                      sum(w.memory_sweep for w in works), sum(w.long_rollout for w in works))
    return total, configs[0]


def _archs_of(args: Namespace) -> list[str]:
    """The model families of the run: ``--arch``, then ``--also-arch`` (a preset: its own family only)."""
    if args.preset:
        return [args.arch]
    return list(dict.fromkeys([args.arch, *args.also_arch]))


def _modes(args: Namespace, engine: EngineOptions) -> tuple[dict[str, ModeSpec], ModeSpec | None]:
    """The modes to compare, and the one to profile (``None``: no profile)."""
    all_modes = compared_modes(engine, args.recompute_chunk)
    wanted = {"vanilla", *[m for m in args.modes.split(",") if m]}
    unknown = wanted - set(all_modes)
    if unknown:
        raise ConfigError(f"--modes: unknown mode{'s' if len(unknown) > 1 else ''} {', '.join(sorted(unknown))}. "
                          f"Fix: a comma-separated list from {', '.join(sorted(all_modes))}")
    if args.profile and args.profile not in all_modes:
        raise ConfigError(f"--profile {args.profile!r} is not a mode. Fix: one of {', '.join(sorted(all_modes))}")
    chosen = {name: spec for name, spec in all_modes.items() if name in wanted}
    return chosen, all_modes[args.profile] if args.profile else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv, "bench")
    engine = parser.instantiate(args).engine
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm import tqdm

    modes, profiled = _modes(args, engine)  # the settings are checked before the model is built
    workloads = _workloads(args)
    archs = _archs_of(args)
    if args.preset and args.also_arch:
        raise ConfigError("--also-arch builds models of --layers/--hidden/..., which --preset replaces. Fix: drop "
                          "--preset, or --also-arch")
    total = len(archs) * (
        len(workloads) * (len(modes) * (args.repeats + 1) + (0 if args.no_logprobs else 2 * args.repeats))
        + len(args.memory_leaves) * MEMORY_SWEEP_MODES + (LONG_ROLLOUT_MODES if args.long_len else 0))
    bar = tqdm(total=total, desc="bench", disable=args.no_progress, file=sys.stderr)

    def progress(message: str) -> None:
        bar.set_postfix_str(message)
        bar.update(1)

    meta = {"date": datetime.date.today().isoformat(), "argv": list(argv or sys.argv[1:]),
            "machine": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": args.device,
            "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None}

    everything = BenchResults()
    for arch in archs:
        model = _model(args, arch)
        name = args.preset or arch

        def finished(part: str, record: dict, name: str = name) -> None:
            if args.results_jsonl:
                report.append_jsonl(Path(args.results_jsonl), {"part": part, "meta": meta, **record})

        results = run_bench(model, workloads, modes, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                            logprobs=not args.no_logprobs, memory_leaves=args.memory_leaves, long_len=args.long_len,
                            recompute_chunk=args.recompute_chunk, engine=engine, profile=profiled,
                            progress=progress, finished=finished, model_name=name)
        config = model.config
        kinds = model_layer_kinds(config)
        layers = (f"{config.num_hidden_layers} layers ({kinds.count('full_attention')} attention)"
                  if is_recurrent(kinds) else f"{config.num_hidden_layers} layers")
        header = (f"model: {name} {layers}, hidden {config.hidden_size}, vocab {config.vocab_size}, "
                  f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {args.dtype} on "
                  f"{args.device}; torch {torch.__version__}; {torch.get_num_threads()} threads")
        bar.clear()
        print(report.render(results, header, args.profile) + "\n", flush=True)
        everything.merge(results, name)
        del model
    bar.close()
    if len(archs) > 1:
        print(report.side_by_side(everything.rows))
    if args.out:
        written = report.save(Path(args.out), meta, everything, plots=not args.no_plots)
        print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
