"""Tensor parallelism 2 equals one process, per parameter, over the engine matrix (gloo, float64, 2 processes).

Every rank builds the same float64 model, keeps a plain copy (the one-process walk, the same weights), makes the
other tensor-parallel over both ranks (``lightning_dta.distributed.tensor_parallel``) and walks the SAME tree with
it; the TP gradient (DTensor ``.grad.full_tensor()``) is compared with the copy's per parameter (worst relative
error, tests/helpers/reference.py's measure), and so are the loss, the gradient norm of the step
(``distributed.step.gradient_norm`` on the TP model against torch's on the copy) and the forward-only walks'
outputs. Rank 0 writes one JSON row per (family, case); a case that raises is a row with ``status: "BROKE"`` and the
error (both ranks raise alike: the same tree, the same code), and the run goes on.

``activation="auto"``: the budget's rates are measured on the model the walk runs (a TP rank saves less per token),
so the one-process walk is given the TP walk's budget inputs (rates, path bytes) and runs the same keep/recompute
schedule; the rows record both schedules' decisions (they must match and include both kinds).

Options: ``--partial-gradients transformers`` replaces the per-backward gradient sum of Qwen3's ``q_norm``/
``k_norm`` by transformers' own ``ReplicatedWithGradAllReduce`` (a post-accumulate hook: the negative control);
``--vocab-parallel-control [CASE ...]`` also walks a TP model whose embedding and head stay replicated
(``vocab_parallel=False``) in the given policy cases (none given: every policy case) and records its gradients'
distance to the vocabulary-parallel one; ``--control CASE ...`` also runs those cases on Qwen3 with transformers'
hook after the other families, in the same processes (the default suite's negative control costs no second launch).

Usage (from the repository root):
    python -m tests.distributed.tp_worker OUT.json --families llama qwen3 --cases 'policy/*' critic/dfs-keep
        [--partial-gradients per-backward|transformers] [--vocab-parallel-control [CASE ...]] [--control CASE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time

import torch
from torch.distributed.tensor import DTensor

import lightning_dta as dta
import lightning_dta.distributed.tensor_parallel as TP
from lightning_dta.distributed.step import gradient_norm
from lightning_dta.engine import dfs
from lightning_dta.engine.activation_budget import ActivationBudget
from tests.helpers import tp as H
from tests.helpers.models import make_model
from tests.helpers.reference import reference_grads

POLICY = dta.PolicyLoss(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.1, entropy_coef=0.01)
NEAR = dta.PolicyLoss(clip_eps=0.1, kl_coef=0.1, entropy_coef=0.01)  # ratios near 1: part of the tokens clip
GSPO = dta.PolicyLoss(loss_mode="gspo", clip_eps=0.01, clip_eps_high=0.012, kl_coef=0.1)
VALUE = dta.ValueLoss(clip_eps=0.05)
BUDGET = 200_000  # activation="auto": small enough that the walks keep some batches and recompute others

ENGINE = {
    "dfs-keep": dict(mode="dfs"),
    "dfs-keep-prefix-attention": dict(mode="dfs", prefix_attention=True),
    "dfs-keep-model-attention": dict(mode="dfs", prefix_attention=False),
    "dfs-keep-unbatched": dict(mode="dfs", sibling_batch_tokens=None),
    "dfs-keep-unbatched-model-attention": dict(mode="dfs", sibling_batch_tokens=None, prefix_attention=False),
    "dfs-keep-batch4096-model-attention": dict(mode="dfs", sibling_batch_tokens=4096, prefix_attention=False),
    "dfs-keep-chunk3": dict(mode="dfs", chunk_size=3),
    "dfs-recompute": dict(mode="dfs", activation="recompute"),
    "dfs-recompute-chunk3": dict(mode="dfs", activation="recompute", chunk_size=3),
    "dfs-recompute-chunk3-model-attention": dict(mode="dfs", activation="recompute", chunk_size=3,
                                                 prefix_attention=False),
    "dfs-recompute-chunk1-batch16": dict(mode="dfs", activation="recompute", chunk_size=1, sibling_batch_tokens=16),
    "dfs-auto": dict(mode="dfs", activation="auto", activation_memory_budget=BUDGET),
    "dfs-auto-chunk4": dict(mode="dfs", activation="auto", activation_memory_budget=BUDGET, chunk_size=4),
    "dfs-auto-model-attention": dict(mode="dfs", activation="auto", activation_memory_budget=BUDGET,
                                     prefix_attention=False),
    "vanilla": dict(mode="vanilla"),
    "vanilla-batched": dict(mode="vanilla", vanilla_batch_tokens=64),
    "mask": dict(mode="mask"),
}
# case -> (what runs, which rollouts, the objective, the engine options)
CASES: dict[str, tuple] = {f"policy/{k}": ("policy", "tree", POLICY, v) for k, v in ENGINE.items()}
CASES.update({
    # the TP walk against the per-rollout reference written from the definition (not only against one process)
    "reference/dfs-keep": ("reference", "tree", POLICY, dict(mode="dfs")),
    # prompts and a shared tool turn never trained: pops seeded by key/value gradients alone
    "untrained-prefix/dfs-keep": ("policy", "untrained", POLICY, dict(mode="dfs")),
    "untrained-prefix/dfs-keep-model-attention": ("policy", "untrained", POLICY, dict(mode="dfs",
                                                                                     prefix_attention=False)),
    "untrained-prefix/dfs-recompute-chunk2": ("policy", "untrained", POLICY, dict(mode="dfs", activation="recompute",
                                                                                 chunk_size=2)),
    # a smaller tree: at BUDGET every batch is kept (measured 4 kept, 0 recomputed); at half, 3 and 3
    "untrained-prefix/dfs-auto": ("policy", "untrained", POLICY, dict(mode="dfs", activation="auto",
                                                                      activation_memory_budget=BUDGET // 2)),
    "near-policy/dfs-keep": ("policy", "near", NEAR, dict(mode="dfs")),
    "near-policy/dfs-keep-model-attention": ("policy", "near", NEAR, dict(mode="dfs", prefix_attention=False)),
    "near-policy/dfs-recompute-chunk3": ("policy", "near", NEAR, dict(mode="dfs", activation="recompute",
                                                                      chunk_size=3)),
    "near-policy/dfs-auto": ("policy", "near", NEAR, dict(mode="dfs", activation="auto",
                                                          activation_memory_budget=BUDGET)),
    "near-policy/mask": ("policy", "near", NEAR, dict(mode="mask")),
    "gspo/dfs-keep": ("policy", "gspo", GSPO, dict(mode="dfs")),
    "gspo/dfs-recompute-chunk3": ("policy", "gspo", GSPO, dict(mode="dfs", activation="recompute", chunk_size=3)),
    "gspo/dfs-keep-model-attention": ("policy", "gspo", GSPO, dict(mode="dfs", prefix_attention=False)),
    "gspo/mask": ("policy", "gspo", GSPO, dict(mode="mask")),
    "critic/dfs-keep": ("critic", "tree", VALUE, dict(mode="dfs")),
    "critic/dfs-keep-model-attention": ("critic", "tree", VALUE, dict(mode="dfs", prefix_attention=False)),
    "critic/dfs-recompute-chunk3": ("critic", "tree", VALUE, dict(mode="dfs", activation="recompute", chunk_size=3)),
    "critic/dfs-auto": ("critic", "tree", VALUE, dict(mode="dfs", activation="auto", activation_memory_budget=BUDGET)),
    "critic/mask": ("critic", "tree", VALUE, dict(mode="mask")),
    "critic/vanilla": ("critic", "tree", VALUE, dict(mode="vanilla")),
    "logprobs/default": ("logprobs", "tree", None, dict()),
    "logprobs/model-attention": ("logprobs", "tree", None, dict(prefix_attention=False)),
    "logprobs/unbatched-chunk3": ("logprobs", "tree", None, dict(sibling_batch_tokens=None, chunk_size=3)),
    "values/default": ("values", "tree", None, dict()),
    "values/model-attention": ("values", "tree", None, dict(prefix_attention=False)),
})


# Plans beside the model's own. LFM2's own plan splits only the vocabulary; this one splits its attention by heads
# (the per-head q/k norms' gradients summed per backward), its MLP by columns, and keeps the short convolutions'
# projections whole per rank with gathered outputs (the recurrent mixers run whole on every rank).
PLAN_OVERRIDES: dict[str, dict[str, str]] = {
    "lfm2": {**{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
             "model.layers.*.self_attn.out_proj": "rowwise",
             "model.layers.*.self_attn.q_layernorm": "replicated_with_grad_allreduce",
             "model.layers.*.self_attn.k_layernorm": "replicated_with_grad_allreduce",
             "model.layers.*.feed_forward.w1": "colwise", "model.layers.*.feed_forward.w3": "colwise",
             "model.layers.*.feed_forward.w2": "rowwise",
             "model.layers.*.conv.in_proj": "colwise_gather_output",
             "model.layers.*.conv.out_proj": "colwise_gather_output"},
}


class BudgetRecorder:
    """Wraps the engine's ``activation_budget``: records each walk's budget inputs and keep/recompute decisions,
    or replays recorded inputs (the one-process walk then runs the TP walk's schedule)."""

    def __init__(self) -> None:
        self.inputs: tuple | None = None
        self.replay: tuple | None = None
        self.kept = self.recomputed = 0

    @contextlib.contextmanager
    def installed(self):
        original = dfs.activation_budget

        def budget(model, info, tree, engine, dtype, loss_fn):
            made = original(model, info, tree, engine, dtype, loss_fn)
            if made is None:
                return None
            if self.replay is not None:
                rates, path_bytes = self.replay
                made = ActivationBudget.for_tree(tree, engine, rates, path_bytes)
            self.inputs = ((made.body_per_token, made.head_per_position, made.per_grid_entry), made.fixed)
            keep = made.try_keep

            def try_keep(predicted: int, room: int) -> bool:
                ok = keep(predicted, room)
                self.kept += ok
                self.recomputed += not ok
                return ok

            made.try_keep = try_keep
            return made

        dfs.activation_budget = budget
        try:
            yield self
        finally:
            dfs.activation_budget = original

    def take(self) -> list[int]:
        out = [self.kept, self.recomputed]
        self.kept = self.recomputed = 0
        return out


def run(kind: str, loss_fn, options: dict, tree: dta.PrefixTree, model: torch.nn.Module):
    """One engine call; ``(output, gradients)`` for training walks, ``(None, per-rollout outputs)`` otherwise."""
    model.zero_grad(set_to_none=True)
    if kind in ("policy", "critic", "reference"):
        out = dta.tree_backward(model, tree, loss_fn, **options)
        return out, H.full_grads(model)
    if kind == "logprobs":
        return None, dta.tree_logprobs(model, tree, **options)
    return None, dta.tree_values(model, tree, **options)


def parallelized(model: torch.nn.Module, mesh, partial_gradients: str, vocab_parallel: bool,
                 overrides: dict[str, str] | None = None) -> torch.nn.Module:
    """``model`` made tensor-parallel; ``partial_gradients="transformers"``: the per-head norms kept out of our plan
    and given transformers' own post-accumulate-grad all-reduce instead."""
    if partial_gradients == "per-backward":
        return TP.tensor_parallel(model, mesh, vocab_parallel=vocab_parallel, plan_overrides=overrides)
    from transformers.distributed.tensor_parallel import ReplicatedWithGradAllReduce

    partial = TP.translate(model, mesh.size()).partial_gradients  # Qwen3's q_norm / k_norm modules
    TP.tensor_parallel(model, mesh, vocab_parallel=vocab_parallel, plan_overrides={
        key: "replicate" for key, style in TP.model_plan(model).items() if style == "replicated_with_grad_allreduce"})
    for name in partial:
        ReplicatedWithGradAllReduce().install_forward(model.get_submodule(name), mesh)
    return model


def build(family: str, role: str, mesh, partial_gradients: str, vocab_parallel: bool) -> tuple:
    """(TP model, its one-process copy) of ``family`` for ``role`` ("policy" or "critic")."""
    model = make_model(family)
    if role == "critic":
        model = H.critic_from(model)
    reference = copy.deepcopy(model)
    parallelized(model, mesh, partial_gradients, vocab_parallel, PLAN_OVERRIDES.get(family))
    head = model.get_output_embeddings().weight
    # what vocab_parallel decides: the LM head split by vocabulary, or whole (a critic's scalar head always whole)
    assert isinstance(head, DTensor) == (vocab_parallel and role == "policy"), (family, role, type(head))
    return model, reference


def main(rank: int, world: int, out: str, families: list[str], cases: list[str], partial_gradients: str,
         vocab_parallel_control: list[str] | None, control: list[str]) -> None:
    mesh = H.tp_mesh(world)["tensor_parallel"]
    recorder = BudgetRecorder()
    rows = []
    runs = [(family, partial_gradients, cases, vocab_parallel_control) for family in families]
    if control:  # the negative control in the same processes: Qwen3 with transformers' post-accumulate hook
        runs.append(("qwen3", "transformers", control, None))
    with recorder.installed():
        for family, partial_gradients, cases, vocab_parallel_control in runs:
            models = {role: build(family, role, mesh, partial_gradients, True) for role in ("policy", "critic")}
            replicated_head = build(family, "policy", mesh, partial_gradients, False)[0] \
                if vocab_parallel_control is not None else None
            plain = models["policy"][1]
            rollouts = {"tree": H.tree_rollouts(), "untrained": H.untrained_prefix_rollouts(),
                        "gspo": H.near_policy_rollouts(plain, H.tree_rollouts(seed=6), noise=0.1, seed=7),
                        "near": H.near_policy_rollouts(plain, H.tree_rollouts(seed=8), noise=0.15, seed=9)}
            for case in cases:
                kind, data, loss_fn, options = CASES[case]
                critic = kind in ("critic", "values")
                model, reference = models["critic" if critic else "policy"]
                tree = dta.PrefixTree.from_rollouts(H.critic_rollouts(rollouts[data]) if critic else rollouts[data])
                row = dict(family=family, case=case, partial_gradients=partial_gradients)
                start = time.perf_counter()
                try:
                    found, got = compare(kind, loss_fn, options, tree, model, reference, recorder, rollouts[data])
                    row.update(found)
                    if replicated_head is not None and kind == "policy" and case in (vocab_parallel_control or [case]):
                        _, replicated = run(kind, loss_fn, options, tree, replicated_head)
                        row["vocab_parallel_vs_replicated_head"] = H.worst_relative_error(got, replicated)[0]
                        recorder.take()  # its own auto decisions: not the next case's
                    row["status"] = "ok"
                except Exception as error:  # noqa: BLE001 - recorded in the row, the run goes on
                    text = str(error).strip()
                    row.update(status="BROKE", error=f"{type(error).__name__}: {text.splitlines()[-1] if text else ''}")
                    recorder.take()
                row["seconds"] = round(time.perf_counter() - start, 2)
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def compare(kind: str, loss_fn, options: dict, tree: dta.PrefixTree, model, reference, recorder: BudgetRecorder,
            rollouts: list[dta.Rollout]) -> tuple[dict, object]:
    """The TP walk against the one-process walk (or the per-rollout reference) of the same tree: the row's
    figures, and the TP walk's gradients (or outputs)."""
    auto = options.get("activation") == "auto"
    out, got = run(kind, loss_fn, options, tree, model)
    row: dict = {}
    if auto:
        row["auto_tp"] = recorder.take()
        recorder.replay = recorder.inputs
    try:
        if kind == "reference":
            ref_loss, ref = reference_grads(reference, rollouts, loss_fn)
        else:
            ref_out, ref = run(kind, loss_fn, options, tree, reference)
            ref_loss = None if ref_out is None else ref_out.loss
    finally:
        recorder.replay = None
    if auto:
        row["auto_one_process"] = recorder.take()
    if out is None:
        row["max_rel_err"] = H.worst_list_error(got, ref)
        return row, got
    worst, where = H.worst_relative_error(got, ref)
    norm = gradient_norm(model.parameters())
    true_norm = float(torch.nn.utils.get_total_norm(list(ref.values())))
    clipped = "value_clip_fraction" if isinstance(loss_fn, dta.ValueLoss) else "clip_fraction"
    row.update(max_rel_err=worst, worst_param=where, loss_rel_err=abs(out.loss - ref_loss) / max(abs(ref_loss), 1e-300),
               grad_norm=norm, grad_norm_rel_err=abs(norm - true_norm) / true_norm, clip_fraction=out.metrics[clipped])
    return row, got


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3", "qwen2"])
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="names, or prefixes ending in '*'")
    parser.add_argument("--partial-gradients", default="per-backward", choices=["per-backward", "transformers"])
    parser.add_argument("--vocab-parallel-control", nargs="*", default=None, metavar="CASE")
    parser.add_argument("--control", nargs="*", default=[], metavar="CASE",
                        help="also run these cases on Qwen3 with --partial-gradients transformers")
    args = parser.parse_args()

    def chosen(patterns: list[str]) -> list[str]:
        return [c for c in CASES if any(c == p or (p.endswith("*") and c.startswith(p[:-1])) for p in patterns)]

    H.launch(main, 2, args.out, args.families, chosen(args.cases), args.partial_gradients, args.vocab_parallel_control,
             chosen(args.control))
