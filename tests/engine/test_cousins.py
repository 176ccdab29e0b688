"""The forward-only walk with cousins packed: exact against a plain forward per rollout, fewer forwards, and the
keys/values it holds released as it goes."""

from __future__ import annotations

import random

import pytest
import torch

import lightning_dta as dta
import lightning_dta.engine.logprobs as logprobs
from lightning_dta.engine.cousins import PendingChunks, successors
from lightning_dta.engine.walk import Chunk
from tests.engine.test_logprobs import per_rollout_logprobs
from tests.helpers.models import VOCAB, make_model, make_rollout, random_tree_rollouts


def branching_rollouts(rng: random.Random, widths: tuple[int, ...], segment: tuple[int, int]) -> list[dta.Rollout]:
    """A tree-search shape: a prompt, then ``widths[d]`` children per node at depth ``d`` (siblings start with
    different tokens, so the tree branches exactly there)."""
    paths = [[rng.randrange(VOCAB) for _ in range(6)]]
    for width in widths:
        paths = [p + [j] + [rng.randrange(VOCAB) for _ in range(rng.randint(*segment) - 1)]
                 for p in paths for j in range(width)]
    return [make_rollout(rng, p) for p in paths]


def count_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = logprobs.forward_cousins

    def counting(model, info, batch, levels):
        calls.append(len(batch.chunks))
        return original(model, info, batch, levels)

    monkeypatch.setattr(logprobs, "forward_cousins", counting)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("options", [dict(), dict(sibling_batch_tokens=9), dict(sibling_batch_tokens=20, chunk_size=3),
                                     dict(prefix_attention_backend="reference", sibling_batch_tokens=13, order="tree")])
@pytest.mark.parametrize("seed", [0, 1])
def test_cousin_batches_match_a_plain_forward_per_rollout(family, options, seed, monkeypatch) -> None:
    """Small budgets cut the stack at every place (cousins of different depths and parents in one batch, ancestors
    needed by some rows only); every log-prob equals the plain forward's in float64."""
    rng = random.Random(seed)
    rollouts = random_tree_rollouts(rng, num_rollouts=14) + branching_rollouts(rng, (2, 3, 2), (1, 5))
    model = make_model(family)
    calls = count_forwards(monkeypatch)
    got = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts), prefix_attention=True, **options)
    assert calls and max(calls) > 1  # cousins were packed
    for i, (rollout, logp) in enumerate(zip(rollouts, got)):
        torch.testing.assert_close(logp.double(), per_rollout_logprobs(model, rollout), rtol=1e-9, atol=1e-9,
                                   msg=f"rollout {i}")


def test_a_branching_tree_takes_one_forward_per_level(monkeypatch) -> None:
    rollouts = branching_rollouts(random.Random(3), (3, 3, 2), (4, 8))
    tree = dta.PrefixTree.from_rollouts(rollouts)
    model = make_model("llama")
    calls = count_forwards(monkeypatch)
    dta.tree_logprobs(model, tree)
    assert calls == [1, 3, 9, 18]  # the sibling walk takes 1 + 1 + 3 + 9 = 14
    calls.clear()
    dta.tree_logprobs(model, tree, prefix_attention=False)  # padded rows: the sibling walk, no cousins
    assert calls == []


def test_values_of_a_critic_with_cousins_match_the_sibling_walk(monkeypatch) -> None:
    critic = dta.value_model(make_model("llama"))
    tree = dta.PrefixTree.from_rollouts(branching_rollouts(random.Random(4), (2, 2, 2), (2, 6)))
    with_cousins = dta.tree_values(critic, tree)
    monkeypatch.setattr(logprobs.CousinLogprobWalk, "run", logprobs.LogprobWalk.run)
    siblings = dta.tree_values(critic, tree)
    for a, b in zip(with_cousins, siblings):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_pending_chunks_release_every_ancestor_and_keep_only_pending_ones() -> None:
    """Driven like the walk on a random tree with a tiny budget: keys/values are held only for chunks with
    something pending below, every ancestor is released at the end, and each chunk is taken exactly once."""
    tree = dta.PrefixTree.from_rollouts(random_tree_rollouts(random.Random(5), num_rollouts=20))
    pending = PendingChunks([Chunk.first(c, 2) for c in tree.root.children])
    taken = []
    while pending:
        batch = pending.take(5)
        taken += batch
        assert sum(c.length for c in batch) <= 5 or len(batch) == 1
        pending.finish(batch, lambda row: [(torch.zeros(1), torch.zeros(1))], lambda c: successors(c, 2, "tree"))
        for chunk in pending.kv:  # held only as an ancestor of something still to compute
            assert pending.pending_below[chunk] > 0
            assert any(chunk in pending.ancestry(c) for c in pending.stack)
    assert pending.kv == {} and pending.pending_below == {} and pending.parent == {}
    assert len(taken) == len(set(taken)) == sum(-(-n.length // 2) for n in tree.iter_nodes())


def test_cousin_attention_refuses_grad() -> None:
    model = make_model("llama")
    tree = dta.PrefixTree.from_rollouts(branching_rollouts(random.Random(6), (2, 2), (2, 4)))
    info = dta.engine.model_info.inspect_model(model, uses_cache=True, prefix_attention=True,
                                               prefix_attention_backend=None)
    walk = logprobs.CousinLogprobWalk(model, info, tree, dta.EngineOptions(), False)
    with torch.enable_grad(), pytest.raises(Exception, match="forward only"):
        walk.run()


def test_kept_keys_values_are_copies_of_the_rows_below_which_something_is_pending(monkeypatch) -> None:
    """A batch of many leaves and one inner chunk keeps only that chunk's keys/values, not the whole batch's
    (views would hold every row's storage alive)."""
    rng = random.Random(9)
    prompt = [rng.randrange(VOCAB) for _ in range(3)]
    rollouts = [make_rollout(rng, prompt + [j] + [rng.randrange(VOCAB) for _ in range(30)]) for j in range(1, 9)]
    rollouts += [make_rollout(rng, prompt + [0, 5, 6, 7] + more) for more in ([1, 2], [3, 4])]
    model = make_model("llama")
    held = []
    finish = PendingChunks.finish

    def checking(self, batch, kv_of, successors_of):
        finish(self, batch, kv_of, successors_of)
        stored = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for kv in self.kv.values() for pair in kv for t in pair}
        held.append((sum(stored.values()), sum(c.length for c in self.kv)))

    monkeypatch.setattr(PendingChunks, "finish", checking)
    dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts))
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size //
                                                                           config.num_attention_heads) * 8  # float64
    assert any(tokens for _, tokens in held)
    for total, tokens in held:
        assert total == tokens * per_token  # keys and values of every layer of the kept chunks, nothing more
