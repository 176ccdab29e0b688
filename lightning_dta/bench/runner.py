"""Side-by-side measurement of the training modes on one model and one step of rollouts.

Modes run round-robin within each repeat (vanilla, dfs, ... then again), so that drifts of a noisy machine
hit every mode alike; medians and spreads are reported. Beside every timing stands the mode's gradient
agreement with the per-rollout baseline, so that a fast wrong mode is visible.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.tree import PrefixTree, TreeStats
from lightning_dta.distributed.collectives import synchronize
from lightning_dta.engine import EngineOptions, tree_backward, tree_logprobs
from lightning_dta.engine.activation_budget import path_kv_bytes
from lightning_dta.engine.device import to_device
from lightning_dta.engine.layer_kinds import is_recurrent, model_layer_kinds
from lightning_dta.engine.memory import SavedTensorMeter, current_rss_bytes, peak_rss_bytes, reset_peak_rss
from lightning_dta.plan.flops import ModelShape, speedup_limit
from lightning_dta.shapes.modes import ModeSpec
from lightning_dta.shapes.workloads import GRPOWorkload, LongSequenceWorkload

BASELINE = "vanilla"


PEER_WORKLOADS = {"prefix-grouper": ("grpo",)}  # one-level sharing: the GRPO shape only


def skip_reason(name: str, spec: ModeSpec, workload: str, device: torch.device, recurrent: bool = False
                ) -> str | None:
    """Why mode ``name`` does not run on ``workload`` here (``None``: it runs). ``recurrent``: the model has
    recurrent layers (a hybrid), which a tree mask cannot reach (the engine refuses ``mask`` for them)."""
    if recurrent and spec.engine.mode == "mask":
        return f"{name}: a tree mask cannot reach a hybrid's recurrent layers (the engine refuses mode='mask')"
    if spec.peer is None:
        return None
    if workload not in PEER_WORKLOADS[spec.peer]:
        return f"{name} shares one level (the prompt): run on {', '.join(PEER_WORKLOADS[spec.peer])} only"
    from lightning_dta.bench.prefix_grouper import unavailable_reason

    reason = unavailable_reason(device)
    return f"{name}: {reason}" if reason else None


@dataclass
class ModeResult:
    name: str
    times: list[float] = field(default_factory=list)
    grad_rel_error: float | None = None  # ||g - g_vanilla|| / ||g_vanilla|| over all parameters
    peak_saved_bytes: int | None = None
    peak_rss_growth_bytes: int | None = None
    cuda_peak_bytes: int | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.times), max(self.times)


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double()
                      for p in model.parameters()])


def run_mode(model: nn.Module, tree: PrefixTree, loss_fn: PolicyLoss, spec: ModeSpec) -> None:
    """One ``tree_backward`` of a mode (or one step of its peer method)."""
    if spec.peer == "prefix-grouper":
        from lightning_dta.bench.prefix_grouper import prefix_grouper_backward

        prefix_grouper_backward(model, tree, loss_fn)
    elif spec.activation_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 renamed the methods
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            tree_backward(model, tree, loss_fn, engine=spec.engine)
        finally:
            (model.activation_checkpointing_disable if hasattr(model, "activation_checkpointing_disable")
             else model.gradient_checkpointing_disable)()
    else:
        tree_backward(model, tree, loss_fn, engine=spec.engine)


def saved_peak_bytes(model: nn.Module, tree: PrefixTree, spec: ModeSpec) -> int:
    """Peak bytes saved for backward by one ``tree_backward`` of a mode (gradients cleared before and after)."""
    model.zero_grad(set_to_none=True)
    with SavedTensorMeter(model) as meter:
        run_mode(model, tree, PolicyLoss(), spec)
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


def run_training_modes(model: nn.Module, tree: PrefixTree, loss_fn: PolicyLoss, modes: dict[str, ModeSpec],
                       repeats: int, warmup: int = 1, progress: Callable[[str], None] | None = None
                       ) -> dict[str, ModeResult]:
    """Time every mode ``repeats`` times (round-robin) and measure its memory and gradient agreement."""
    device = next(model.parameters()).device
    if BASELINE not in modes:
        raise ValueError(f"the modes must include the baseline {BASELINE!r}")
    modes = {BASELINE: modes[BASELINE], **{n: k for n, k in modes.items() if n != BASELINE}}
    results = {name: ModeResult(name) for name in modes}
    reference = None
    for name, spec in modes.items():  # one untimed pass each (baseline first): gradients, memory, warm-up
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rss_ok = reset_peak_rss()
        rss_before = current_rss_bytes()
        with SavedTensorMeter(model) as meter:  # the hooks only alias saved tensors: memory is unchanged
            run_mode(model, tree, loss_fn, spec)
        synchronize(device)
        results[name].peak_saved_bytes = meter.peak_bytes
        if device.type == "cuda":
            results[name].cuda_peak_bytes = torch.cuda.max_memory_allocated(device)
        peak = peak_rss_bytes()
        if rss_ok and peak is not None and rss_before is not None:
            results[name].peak_rss_growth_bytes = max(peak - rss_before, 0)
        grads = _flat_grads(model)
        reference = grads if reference is None else reference
        results[name].grad_rel_error = float((grads - reference).norm() / reference.norm().clamp(min=1e-30))
        model.zero_grad(set_to_none=True)
        if progress:
            progress(f"checked {name}")
    for _ in range(max(warmup - 1, 0)):
        for spec in modes.values():
            run_mode(model, tree, loss_fn, spec)
    for rep in range(repeats):
        for name, spec in modes.items():
            model.zero_grad(set_to_none=True)
            synchronize(device)
            start = time.perf_counter()
            run_mode(model, tree, loss_fn, spec)
            synchronize(device)
            results[name].times.append(time.perf_counter() - start)
            if progress:
                progress(f"repeat {rep + 1}/{repeats} {name}")
    model.zero_grad(set_to_none=True)
    return results


def _per_rollout_logprobs(model: nn.Module, tree: PrefixTree) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for tokens in tree.token_tensors:
            ids = to_device(tokens[None], device)
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def run_logprob_modes(model: nn.Module, tree: PrefixTree, repeats: int, engine: EngineOptions,
                      progress: Callable[[str], None] | None = None) -> dict[str, ModeResult]:
    """Forward-only scoring: ``tree_logprobs`` (with the dfs mode's ``engine``) against one plain forward per
    rollout."""
    device = next(model.parameters()).device
    modes = {"logprobs-vanilla": _per_rollout_logprobs,
             "logprobs-tree": functools.partial(tree_logprobs, engine=engine)}
    results = {name: ModeResult(name) for name in modes}
    reference = torch.cat(_per_rollout_logprobs(model, tree)).double()
    for name, fn in modes.items():
        values = torch.cat(fn(model, tree)).double()
        results[name].grad_rel_error = float((values - reference).abs().max())  # max abs log-prob difference
    for rep in range(repeats):
        for name, fn in modes.items():
            synchronize(device)
            start = time.perf_counter()
            fn(model, tree)
            synchronize(device)
            results[name].times.append(time.perf_counter() - start)
            if progress:
                progress(f"repeat {rep + 1}/{repeats} {name}")
    return results


@dataclass
class BenchResults:
    """Everything one ``lightning-dta bench`` run measured."""

    rows: list[dict] = field(default_factory=list)  # one per (workload, mode): see report.rows
    memory_scaling: list[dict] = field(default_factory=list)  # peak saved MiB per (mode, leaves)
    long_rows: list[dict] = field(default_factory=list)  # one long rollout: saved bytes + path buffers per mode
    profiles: dict[str, str] = field(default_factory=dict)  # workload -> profiler table
    skipped: list[str] = field(default_factory=list)  # modes that did not run, with the reason

    def merge(self, other: BenchResults, model: str) -> None:
        """Add ``other``'s measurements (of ``model``: its records carry the name, its notes get it here)."""
        self.rows += other.rows
        self.memory_scaling += other.memory_scaling
        self.long_rows += other.long_rows
        self.profiles |= {f"{model} {workload}": text for workload, text in other.profiles.items()}
        self.skipped += [f"{model} {note}" for note in other.skipped]


def path_buffer_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """The dfs path buffers: keys, values and their gradients, per layer, for ``tokens`` positions. They are
    allocated outside autograd, so the saved-tensor meter does not see them."""
    return 2 * path_kv_bytes(config, tokens, dtype)


def profile_step(model: nn.Module, tree: PrefixTree, loss_fn: PolicyLoss, spec: ModeSpec) -> str:
    """The top operators of one step (after a warm-up step), by self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    run_mode(model, tree, loss_fn, spec)
    with profile(activities=activities) as prof:
        run_mode(model, tree, loss_fn, spec)
    model.zero_grad(set_to_none=True)
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=48)


MEMORY_SWEEP_MODES = 4  # progress steps per leaf count of the memory sweep (at most: mask needs sdpa/eager)
LONG_ROLLOUT_MODES = 3


def memory_sweep_modes(sibling_batch_tokens: int | None, with_mask: bool) -> dict[str, ModeSpec]:
    """The modes of the memory sweep (``with_mask``: the model's attention takes a 4-D tree mask)."""
    modes = {"dfs": ModeSpec(EngineOptions(sibling_batch_tokens=sibling_batch_tokens)),
             "dfs-unbatched": ModeSpec(EngineOptions(sibling_batch_tokens=None)),
             "mask": ModeSpec(EngineOptions(mode="mask")), "vanilla": ModeSpec(EngineOptions(mode="vanilla"))}
    if not with_mask:
        del modes["mask"]
    return modes


def long_rollout_modes(chunk_size: int) -> dict[str, ModeSpec]:
    """The modes of the long-rollout memory check."""
    return {"vanilla": ModeSpec(EngineOptions(mode="vanilla")), "dfs": ModeSpec(EngineOptions()),
            "dfs-recompute": ModeSpec(EngineOptions(activation="recompute", chunk_size=chunk_size))}


def takes_tree_mask(config) -> bool:
    """Whether the model runs ``mode="mask"``: attention that takes a 4-D mask, and no recurrent layers."""
    return config._attn_implementation in ("sdpa", "eager") and not has_recurrent_layers(config)


def has_recurrent_layers(config) -> bool:
    return is_recurrent(model_layer_kinds(config.get_text_config()))


def memory_scaling(model: nn.Module, leaves: Sequence[int], vocab: int, seed: int, sibling_batch_tokens: int | None,
                   progress: Callable[[str], None] | None = None) -> list[dict]:
    """Peak bytes saved for backward as the number of responses per prompt grows (dfs flat, mask grows)."""
    # flash attention takes no 4-D tree mask, nor do recurrent layers
    modes = memory_sweep_modes(sibling_batch_tokens, takes_tree_mask(model.config))
    out = []
    for n in leaves:
        tree = PrefixTree.from_rollouts(GRPOWorkload(1, n, (400, 400), (128, 128)).generate(vocab, seed))
        for mode, spec in modes.items():
            out.append({"mode": mode, "leaves": n, "peak_saved_mib": saved_peak_bytes(model, tree, spec) / 2**20})
            if progress:
                progress(f"memory {mode} {n} leaves")
    return out


def long_rollout_memory(model: nn.Module, length: int, vocab: int, seed: int, chunk_size: int,
                        dtype: torch.dtype, progress: Callable[[str], None] | None = None) -> list[dict]:
    """One ``length``-token rollout: bytes saved for backward plus the dfs path buffers, per mode."""
    tree = PrefixTree.from_rollouts(LongSequenceWorkload(1, length).generate(vocab, seed))
    rows = []
    for mode, spec in long_rollout_modes(chunk_size).items():
        saved = saved_peak_bytes(model, tree, spec)
        path = path_buffer_bytes(model.config, length, dtype) if spec.engine.mode == "dfs" else 0
        rows.append({"mode": mode, "tokens": length, "peak_saved_mib": saved / 2**20,
                     "path_buffers_mib": path / 2**20, "total_mib": (saved + path) / 2**20})
        if progress:
            progress(f"memory {mode} {length} tokens")
    return rows


def result_rows(workload: str, stats: TreeStats, results: dict[str, ModeResult], flop_limit: float | None,
                baseline: str = BASELINE, model: str = "") -> list[dict]:
    """One record per mode of ``model``; speed-ups against ``baseline`` (forward-only log-prob rows pass their
    own)."""
    base = results[baseline].median if baseline in results else None
    checkpointed = results["vanilla-ckpt"].median if "vanilla-ckpt" in results else None
    out = []
    for name, r in results.items():
        speedup = base / r.median if base else None
        out.append({
            "model": model,
            "workload": workload,
            "mode": name,
            "compression": stats.compression_ratio,
            "rollouts": stats.num_rollouts,
            "logical_tokens": stats.logical_tokens,
            "tree_tokens": stats.tree_tokens,
            "median_s": r.median,
            "min_s": r.spread[0],
            "max_s": r.spread[1],
            "logical_tokens_per_s": stats.logical_tokens / r.median,
            "speedup": speedup,
            "speedup_vs_ckpt": checkpointed / r.median if checkpointed else None,
            "efficiency": speedup / stats.compression_ratio if speedup else None,
            "flop_speedup_limit": flop_limit,
            "fraction_of_flop_limit": speedup / flop_limit if speedup and flop_limit else None,
            "grad_rel_error": r.grad_rel_error,
            "peak_saved_mib": r.peak_saved_bytes / 2**20 if r.peak_saved_bytes is not None else None,
            "peak_rss_growth_mib": r.peak_rss_growth_bytes / 2**20 if r.peak_rss_growth_bytes is not None else None,
            "cuda_peak_mib": r.cuda_peak_bytes / 2**20 if r.cuda_peak_bytes is not None else None,
        })
    return out


def run_bench(model: nn.Module, workloads: dict[str, object], modes: dict[str, ModeSpec], *, repeats: int,
              warmup: int, seed: int, recompute_chunk: int, engine: EngineOptions, logprobs: bool = True,
              memory_leaves: Sequence[int] = (), long_len: int = 0, profile: ModeSpec | None = None,
              progress: Callable[[str], None] | None = None,
              finished: Callable[[str, dict], None] | None = None, model_name: str = "") -> BenchResults:
    """Every mode on every workload, then the memory sweeps (module docstring). ``finished(part, record)`` is
    called as each part ends (a workload's rows, the memory sweep, the long rollout), so that a run stopped
    midway keeps what it measured. Every record carries ``model_name`` as ``"model"``."""
    finished = finished or (lambda part, record: None)
    config = model.config
    shape = ModelShape.from_config(config)
    loss_fn = PolicyLoss()
    results = BenchResults()
    for name, workload in workloads.items():
        tree = PrefixTree.from_rollouts(workload.generate(config.vocab_size, seed), vocab_size=config.vocab_size,
                                        max_positions=config.max_position_embeddings)
        trained = sum(sum(r.mask()[1:]) for r in tree.rollouts)
        limit = speedup_limit(shape, tree, head_positions=trained)
        forward_limit = speedup_limit(shape, tree, head_positions=None)
        device = next(model.parameters()).device
        runnable = {}
        for mode, spec in modes.items():
            reason = skip_reason(mode, spec, name, device, has_recurrent_layers(config))
            if reason:
                results.skipped.append(f"{name}: {reason}")
            else:
                runnable[mode] = spec
        measured = run_training_modes(model, tree, loss_fn, runnable, repeats, warmup, progress)
        results.rows += result_rows(name, tree.stats, measured, limit, model=model_name)
        if logprobs:  # forward only: against the per-rollout forward, with its own FLOP limit
            dfs_engine = modes["dfs"].engine if "dfs" in modes else EngineOptions()
            measured = run_logprob_modes(model, tree, repeats, dfs_engine, progress)
            results.rows += result_rows(name, tree.stats, measured, forward_limit, baseline="logprobs-vanilla",
                                        model=model_name)
        if profile is not None:
            results.profiles[name] = profile_step(model, tree, loss_fn, profile)
        finished("workload", {"workload": name, "results": [r for r in results.rows if r["workload"] == name],
                              "skipped": [s for s in results.skipped if s.startswith(f"{name}: ")]})
    if memory_leaves:
        results.memory_scaling = [{"model": model_name, **m} for m in memory_scaling(
            model, memory_leaves, config.vocab_size, seed, engine.sibling_batch_tokens, progress)]
        finished("memory_scaling", {"memory_scaling": results.memory_scaling})
    if long_len:
        results.long_rows = [{"model": model_name, **r} for r in long_rollout_memory(
            model, long_len, config.vocab_size, seed, recompute_chunk, next(model.parameters()).dtype, progress)]
        finished("long_sequence", {"long_sequence": results.long_rows})
    return results
