"""``lightning-dta plan``: predict a step's memory and FLOPs before running it, and the engine options that fit.

    lightning-dta plan --model qwen3-8b --workload tau2-like --devices 8 --strategy dta_fsdp --memory 80GB

The model is a shape (a preset, or a local ``config.json`` / model directory: no weights are read); the step is a
rollout file or a bench workload. A hybrid (Gated DeltaNet, Mamba2 or short-convolution layers next to attention)
is priced per layer kind: its recurrent layers' FLOPs per token and the fixed-size states its path holds
(:mod:`lightning_dta.plan.mixers`). Activation rates are probed on the CPU on one- and two-layer clones of the
shape (20-45 s for an 8B shape on two cores), then the training walk's schedule runs dry (:mod:`lightning_dta.plan`).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from jsonargparse import ArgumentParser, Namespace

from lightning_dta.arguments import parse_args
from lightning_dta.cli import add_engine_options
from lightning_dta.core.balance import partition
from lightning_dta.core.errors import UsageError
from lightning_dta.core.rollout import RolloutError, read_rollouts, validate_rollouts
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.options import EngineOptions
from lightning_dta.plan.flops import ModelShape, tensor_parallel_config
from lightning_dta.plan.mixers import UnpricedModelError
from lightning_dta.plan.predict import HEADROOM, StepPlan, fitting_options, plan_step
from lightning_dta.plan.rates import probe_rates
from lightning_dta.plan.state import OPTIMIZER_STATES, PRECISIONS, TrainingState, parameter_count
from lightning_dta.shapes.models import HYBRID_PRESETS, PRESETS, hybrid_preset_config, model_config
from lightning_dta.shapes.modes import RECOMPUTE_CHUNK, planned_modes
from lightning_dta.shapes.workloads import WORKLOADS

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
         "gib": 2**30, "tib": 2**40}


class PlanError(UsageError, ValueError):
    """Bad input to ``lightning-dta plan``: the message says what and how to fix it."""


# what a rank of a tensor-parallel group runs of a hybrid's recurrent mixers (distributed/tensor_parallel.py)
MIXERS_PER_RANK = ("each rank runs every recurrent mixer whole (its convolution, its scan and the states it hands on "
                   "are not divided; its projections are split by output columns and gathered, so their outputs are "
                   "whole on every rank); only attention, the MLP and the vocabulary are divided")
PRESET_NAMES = ["bench", *sorted(PRESETS), *sorted(HYBRID_PRESETS)]
UNIT_NAMES = "B, kB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2)"
SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"512MiB"``, ``"1.5e9B"``, ``"1E3B"`` -> bytes. A number without a
    unit is refused: ``80`` meant as 80 GB would be read as 80 bytes."""
    match = SIZE.fullmatch(text)
    if match and not match.group(2):
        raise PlanError(f"--memory {text!r} has no unit. Fix: {text.strip()}GB or {text.strip()}GiB (the units: "
                        f"{UNIT_NAMES})")
    if not match or match.group(2).lower() not in UNITS:
        raise PlanError(f"--memory {text!r}: write a size such as 80GB, 80GiB or 512MiB (the units: {UNIT_NAMES})")
    value = float(match.group(1)) * UNITS[match.group(2).lower()]
    if value < 1:
        raise PlanError(f"--memory {text!r}: a size of at least one byte, such as 80GB")
    if not value < 2**63:
        raise PlanError(f"--memory {text!r} is more than any accelerator holds (at most 2**63 bytes). Fix: the "
                        "memory of one device, such as 80GB")
    return int(value)


def in_unit_of(nbytes: float, text: str) -> str:
    """``nbytes`` in the unit of the size ``text`` the user wrote (``"80GB"``: GB), so that what the planner
    made of ``--memory`` reads beside it."""
    unit = SIZE.fullmatch(text).group(2)
    value = nbytes / UNITS[unit.lower()]
    return f"{value:,.0f} {unit}" if unit.lower() == "b" else f"{value:,.4g} {unit}"


def gib(nbytes: float) -> str:
    """A size in the unit that shows it: GiB, MiB, KiB or bytes."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}" if unit == "GiB" else f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


def load_config(model: str):
    """A preset name, ``bench`` (the bench's default model), a ``config.json`` or a directory holding one."""
    if model == "bench":
        return model_config()
    if model in PRESETS:
        return model_config(**PRESETS[model], max_positions=40960)
    if model in HYBRID_PRESETS:
        return hybrid_preset_config(model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"--model {model!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor a "
                        "config.json or a model directory with one")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as error:  # any refusal of the file (transformers validates configs with its own error classes)
        cause = " ".join(str(error.__cause__ or error).split())
        raise PlanError(f"--model {model!r}: {path} is not a Hugging Face model config transformers accepts ({cause}). "
                        "Fix: a config.json with a consistent shape (e.g. hidden_size a multiple of "
                        "num_attention_heads)") from error
    config._attn_implementation = "sdpa"
    return config


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="lightning-dta plan", description=__doc__, default_meta=False, exit_on_error=False)
    parser.add_argument("--model", default="bench",
                        help=f"a preset ({', '.join(PRESET_NAMES)}; the hybrids: transformers' config defaults of "
                        "the family), a config.json or a model directory (default: bench, the bench's 4-layer model)")
    parser.add_argument("--workload", default=None, choices=sorted(WORKLOADS),
                        help="a bench workload as the step (default: agent)")
    parser.add_argument("--rollouts", default=None, help="a rollout JSONL file as the step (instead of --workload)")
    parser.add_argument("--precision", default="bf16-true", choices=sorted(PRECISIONS),
                        help="Lightning precision: weights, gradients and optimizer state, and activations")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    parser.add_argument("--strategy", default="dta", choices=("dta", "dta_fsdp"),
                        help="dta: weights replicated; dta_fsdp: sharded over --devices (FSDP2)")
    parser.add_argument("--devices", default=1, type=int, help="data-parallel ranks the step is split over")
    parser.add_argument("--memory", default=None, help="accelerator memory per rank, with its unit (80GB, 80GiB, "
                        f"...): list the engine options that fit in it, less {HEADROOM:.0%} of it left to the "
                        "allocator's fragmentation and the runtime's context")
    parser.add_argument("--recompute-chunk", default=RECOMPUTE_CHUNK, type=int,
                        help="chunk_size of the dfs-recompute row")
    parser.add_argument("--tensor-parallel", default=1, type=int,
                        help="tensor-parallel size (dta_fsdp): --devices is all ranks, the step is split over "
                        "devices / tensor-parallel data-parallel ranks")
    parser.add_argument("--walk-gradient-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="dta_fsdp: the dtype of the gradient the walk accumulates (DTAFSDPStrategy's option)")
    add_engine_options(parser)
    parser.add_argument("--seed", default=0, type=int, help="seed of the bench workload")
    parser.add_argument("--json", action="store_true", help="print the prediction as JSON")
    return parser


def _rank_trees(args: Namespace, config) -> tuple[list[PrefixTree], str]:
    """The step's rollouts, validated against the model (the file's errors as ``PATH:LINE``), split over the ranks."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # optional config fields: not every model family has them
    vocab, positions = text.vocab_size, getattr(text, "max_position_embeddings", None)
    if args.rollouts and args.workload:
        raise PlanError("give --workload or --rollouts, not both")
    if args.devices < 1:
        raise PlanError(f"--devices {args.devices}: use 1 or more")
    if args.rollouts:
        rollouts, what = read_rollouts(args.rollouts, vocab_size=vocab, max_positions=positions), args.rollouts
    else:
        workload = args.workload or "agent"
        rollouts, what = WORKLOADS[workload].generate(vocab, args.seed), f"workload {workload}"
        try:
            validate_rollouts(rollouts, vocab_size=vocab, max_positions=positions, source=f"the {what}")
        except RolloutError as error:
            raise PlanError(f"the {what}{' (the default step)' if args.workload is None else ''} does not fit "
                            f"--model {args.model}: {error}\nFix: another workload (--workload "
                            f"{'|'.join(sorted(WORKLOADS))}) or your own step (--rollouts FILE)") from None
    if args.tensor_parallel < 1 or args.devices % args.tensor_parallel:
        raise PlanError(f"--tensor-parallel {args.tensor_parallel} must divide --devices {args.devices}")
    walkers = args.devices // args.tensor_parallel  # tensor-parallel peers walk one tree
    if walkers > len(rollouts):
        over = f"--devices {args.devices}" if args.tensor_parallel == 1 else f"{walkers} data-parallel ranks"
        print(f"lightning-dta plan: note: {len(rollouts)} rollouts over {over}: "
              f"{walkers - len(rollouts)} ranks have nothing to train in this step", file=sys.stderr)
    shares = partition(rollouts, walkers) if walkers > 1 else [list(range(len(rollouts)))]
    trees = [PrefixTree.from_rollouts([rollouts[i] for i in share], validate=False) for share in shares if share]
    return trees, what


def _worst(plans: list[StepPlan]) -> dict[str, dict]:
    """Per mode, the largest memory and FLOPs over the ranks (a step waits for its slowest rank)."""
    out = {}
    for name in plans[0].modes:
        preds = [p.modes[name] for p in plans]
        worst = max(preds, key=lambda m: m.activations)
        out[name] = {"saved_bytes": worst.saved, "path_buffer_bytes": worst.path_buffers,
                     "recomputed_layer_bytes": worst.recomputed_layer, "head_working_set_bytes": worst.head_working_set,
                     "activation_bytes": worst.activations, "peak_bytes": plans[0].state.total + worst.activations,
                     "tflops": max(m.flops for m in preds) / 1e12}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        return _run(parse_args(parser, argv, "plan"), parser)
    except (UsageError, OSError) as error:  # OSError: a rollout file that cannot be read
        print(f"lightning-dta plan: error: {error}", file=sys.stderr)
        return 2


def _progress(message: str) -> None:
    """What the planner does while it works (tens of seconds for an 8B shape), on stderr beside the notes."""
    print(f"lightning-dta plan: {message} ...", file=sys.stderr, flush=True)


def _run(args: Namespace, parser: ArgumentParser) -> int:
    memory = parse_bytes(args.memory) if args.memory is not None else None
    config = load_config(args.model)
    trees, what = _rank_trees(args, config)
    parameters = parameter_count(config)
    try:
        ModelShape.from_config(config)  # a hybrid's layers are priced, or refused by name, before the probes run
    except UnpricedModelError as error:
        raise PlanError(f"--model {args.model!r}: {error}") from error
    try:
        state = TrainingState(parameters, args.precision, args.optimizer, args.strategy, args.devices,
                              args.tensor_parallel, args.walk_gradient_dtype)
        config = tensor_parallel_config(config, args.tensor_parallel)  # what one rank computes
    except ValueError as error:
        raise PlanError(f"{error} (--tensor-parallel, --strategy, --precision, --walk-gradient-dtype)") from error
    engine = parser.instantiate(args).engine
    try:
        modes = planned_modes(engine, args.recompute_chunk)
    except ValueError as error:
        raise PlanError(f"{error} (--recompute-chunk)") from error
    _progress(f"probing activation rates on 1- and 2-layer clones of {args.model} on the CPU")
    rates = probe_rates(config, PRECISIONS[args.precision][1])
    _progress(f"running the step's schedule dry on {len(trees)} rank(s)"
              + (", and each engine option that may fit" if memory else ""))
    plans = [plan_step(tree, config, rates, state, modes) for tree in trees]
    worst = _worst(plans)
    logical = sum(t.stats.logical_tokens for t in trees)
    tree_tokens = sum(t.stats.tree_tokens for t in trees)
    fits = [fitting_options(tree, config, rates, state, memory, engine) for tree in trees] if memory else None
    if args.json:
        record = {"model": args.model, "step": what, "ranks": len(trees), "parameters": parameters,
                  "state_bytes": {"weights": state.weights, "gradients": state.gradients,
                                  "optimizer": state.optimizer_state, "unsharded_walk": state.gathered},
                  "logical_tokens": logical, "tree_tokens": tree_tokens, "modes": worst,
                  "forward_only": {"bytes": max(p.forward_only.activations for p in plans),
                                   "tflops": max(p.forward_only.flops for p in plans) / 1e12,
                                   "vanilla_tflops": max(p.vanilla_forward_flops for p in plans) / 1e12}}
        if plans[0].shape.layer_macs is not None:
            record["hybrid"] = _hybrid_record(plans[0])
        if fits is not None:
            record["fits"] = common_fits(fits)
        print(json.dumps(record, indent=2))
        return 0
    shape = plans[0].shape
    print(f"model: {args.model} ({shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}, "
          f"{parameters / 1e6:,.1f}M parameters), {args.precision}, {args.strategy} on {args.devices} rank(s)"
          + (f", tensor parallelism {args.tensor_parallel} (a rank: 1/{args.tensor_parallel} of the heads, the MLP "
             "and the vocabulary; the residual stream whole)" if args.tensor_parallel > 1 else ""))
    print(f"step: {what}: {sum(t.stats.num_rollouts for t in trees)} rollouts, {logical:,} logical tokens, "
          f"{tree_tokens:,} tree tokens (compression {logical / tree_tokens:.2f}), longest "
          f"{max(t.stats.max_depth_tokens for t in trees):,}")
    print(f"state per rank: weights {gib(state.weights)}, gradients {gib(state.gradients)}, optimizer "
          f"{gib(state.optimizer_state)}"
          + (f", unsharded weights + {args.walk_gradient_dtype} gradient during the walk {gib(state.gathered)}"
             if state.gathered else "")
          + f" = {gib(state.total)}")
    if shape.layer_macs is not None:
        hybrid = _hybrid_record(plans[0])
        print(f"hybrid: {hybrid['attention_layers']} of {shape.layers} layers attend; per token the layers cost "
              f"{2 * hybrid['layer_macs_per_token'] / 1e9:.3g} GFLOPs forward, of which the recurrent scans "
              f"{2 * hybrid['recurrent_core_macs_per_token'] / 1e9:.3g}; a chunk end hands "
              f"{gib(hybrid['state_bytes_per_node'])} of recurrent states to what lies below it (conv windows + "
              "scan states, whatever the path's length; 'path buf' holds it and its gradient per chunk end on the "
              "path)")
        if args.tensor_parallel > 1:
            print(f"hybrid under tensor parallelism {args.tensor_parallel}: {MIXERS_PER_RANK}")
    print("\nper rank, the largest over ranks (activations: saved for backward + dfs path buffers + "
          "checkpointing's recomputed layer + the head's working set)")
    print(f"{'mode':<16}{'saved':>12}{'path buf':>12}{'head+recomp':>12}{'activations':>14}{'peak':>12}"
          f"{'TFLOPs':>10}{'x vanilla':>11}")
    base = worst["vanilla"]["tflops"]
    for name, row in worst.items():
        mark = ""
        if memory:
            mark = "  fits" if row["peak_bytes"] <= memory * (1 - HEADROOM) else "  over"
        print(f"{name:<16}{gib(row['saved_bytes']):>12}{gib(row['path_buffer_bytes']):>12}"
              f"{gib(row['head_working_set_bytes'] + row['recomputed_layer_bytes']):>12}"
              f"{gib(row['activation_bytes']):>14}{gib(row['peak_bytes']):>12}{row['tflops']:>10.1f}"
              f"{row['tflops'] / base:>11.2f}{mark}")
    forward = max(p.forward_only.flops for p in plans) / 1e12
    vanilla_forward = max(p.vanilla_forward_flops for p in plans) / 1e12
    print(f"forward-only tree_logprobs: {gib(max(p.forward_only.activations for p in plans))} beside the state, "
          f"{forward:.3g} TFLOPs ({vanilla_forward / forward:.2f}x fewer than per-rollout forwards)")
    if fits is not None:
        _print_fits(common_fits(fits), memory, args.memory, args.strategy)
    return 0


def _hybrid_record(plan: StepPlan) -> dict:
    """A hybrid's layer costs and the states one chunk end hands on (one rank's under tensor parallelism)."""
    shape = plan.shape
    record = {"attention_layers": shape.attention_layers, "layer_macs_per_token": shape.layer_macs,
              "recurrent_core_macs_per_token": shape.recurrent_core_macs,
              "state_bytes_per_node": plan.state_bytes_per_node}
    if plan.state.tensor_parallel > 1:
        record["recurrent_mixers_per_rank"] = MIXERS_PER_RANK
    return record


def common_fits(fits: list[list]) -> list[dict]:
    """The options that fit on every rank, cheapest first (FLOPs of the slowest rank, then the peak)."""
    names = [f.prediction.name for f in fits[0]]
    out = []
    for name in names:
        on_ranks = [next((f for f in rank if f.prediction.name == name), None) for rank in fits]
        if any(f is None for f in on_ranks):
            continue
        engine = max(on_ranks, key=lambda f: f.peak).prediction.engine
        if engine.activation == "auto":  # one budget for every rank: the smallest
            budget = min(f.prediction.engine.activation_memory_budget for f in on_ranks)
            engine = EngineOptions.resolve(engine, activation_memory_budget=budget)
        out.append({"name": name, "engine": {k: v for k, v in engine.to_dict().items()
                                             if v != getattr(EngineOptions(), k)},
                    "peak_bytes": max(f.peak for f in on_ranks),
                    "tflops": max(f.prediction.flops for f in on_ranks) / 1e12})
    return sorted(out, key=lambda f: (f["tflops"], f["peak_bytes"]))  # at equal FLOPs the smaller peak


def _print_fits(fits: list[dict], memory: int, text: str, strategy: str) -> None:
    usable = memory * (1 - HEADROOM)
    print(f"\ndfs engine options that fit {in_unit_of(usable, text)} per rank: --memory {text} less {HEADROOM:.0%} "
          f"of it ({in_unit_of(memory - usable, text)}) left to the allocator's fragmentation and the runtime's "
          "context; cheapest first by FLOPs, then by peak (the vanilla rows above are the per-rollout baselines, "
          "never proposed):")
    if not fits:
        shard = "use more ranks" if strategy == "dta_fsdp" else "shard the state (--strategy dta_fsdp), use more ranks"
        print(f"  none: not even dfs recompute with 256-token chunks. {shard[0].upper() + shard[1:]}, or shorter "
              "rollouts.")
        return
    for fit in fits:
        options = ", ".join(f"{k}={v}" for k, v in fit["engine"].items()) or "defaults"
        print(f"  {fit['name']:<28} peak {in_unit_of(fit['peak_bytes'], text):>11}  {fit['tflops']:8.3g} TFLOPs  "
              f"({options})")
    best = fits[0]["engine"]
    print("\nin a config (model.engine):\n  model:\n    engine:")
    for key, value in (best or {"activation": "keep"}).items():
        print(f"      {key}: {value}")


if __name__ == "__main__":
    raise SystemExit(main())
