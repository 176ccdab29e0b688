"""The small pieces of the walk: chunks, child order, sibling batching by budget, the path buffers, batch layouts."""

from __future__ import annotations

import torch

import lightning_dta as dta
from lightning_dta.engine.kv import KVRecorder, PathKV
from lightning_dta.engine.sibling_batch import SiblingBatch
from lightning_dta.engine.walk import MAX_PADDING, Chunk, batch_by_budget, order_children


def chunks_of(lengths: list[int]) -> list[Chunk]:
    """Leaf chunks of the given lengths, all starting at position 10."""
    tree = dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=[1] * 10 + [2 + i] * n) for i, n in enumerate(lengths)])
    return [Chunk.first(child, None) for child in tree.nodes[1].children]


def test_chunks_cut_a_node_front_to_back():
    tree = dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=list(range(2, 12)))])
    node = tree.nodes[1]
    first = Chunk.first(node, 4)
    assert (first.start, first.end, first.length, first.has_children) == (0, 4, 4, True)
    last = Chunk.at(node, 8, 4)
    assert (last.start, last.end, last.has_children) == (8, 10, False)  # a leaf's last chunk: nothing below
    assert Chunk.first(node, None) == Chunk(node, 0, 10)


def test_leaves_first_order():
    rollouts = [dta.Rollout(input_ids=[1, 2, 3, 4, 5]), dta.Rollout(input_ids=[1, 2, 3, 4, 6]),
                dta.Rollout(input_ids=[1, 7, 7, 7, 7, 7, 7]), dta.Rollout(input_ids=[1, 8])]
    root = dta.PrefixTree.from_rollouts(rollouts).nodes[1]  # token 1, then three children
    ordered = order_children(root, "leaves-first")
    assert [c.is_leaf for c in ordered] == [True, True, False]  # leaves first, the subtree last
    assert [c.length for c in ordered[:2]] == [1, 6]  # leaves from the shortest
    assert order_children(root, "tree") == root.children


def test_packed_batches_hold_at_most_the_budget():
    lengths = [3, 5, 7, 2, 9, 4]
    batches = batch_by_budget(chunks_of(lengths), budget=12, packed=True)
    assert [[c.length for c in b] for b in batches] == [[3, 5], [7, 2], [9], [4]]
    assert all(sum(c.length for c in b) <= 12 for b in batches)


def test_padded_batches_count_rows_times_longest_and_cap_padding():
    batches = batch_by_budget(chunks_of([4, 4, 5, 20]), budget=64, packed=False)
    assert [[c.length for c in b] for b in batches] == [[4, 4, 5], [20]]  # 4 x 20 > 64
    for b in batches:
        width = max(c.length for c in b)
        computed = len(b) * width
        assert computed <= 64 and computed - sum(c.length for c in b) <= MAX_PADDING * computed
    # 2 + 10 would pad 8 of 20 computed tokens (40% > 15%): a new batch although the budget allows it
    assert [[c.length for c in b] for b in batch_by_budget(chunks_of([2, 10]), budget=64, packed=False)] == [[2], [10]]


def test_no_budget_and_oversized_chunks():
    assert [len(b) for b in batch_by_budget(chunks_of([3, 3, 3]), budget=None, packed=True)] == [1, 1, 1]
    assert [[c.length for c in b] for b in batch_by_budget(chunks_of([50, 2]), budget=16, packed=True)] == [[50], [2]]


def test_path_buffers_write_read_and_collect_gradients():
    kv = PathKV(capacity=6)
    new = [(torch.arange(8.0).view(1, 1, 4, 2), -torch.arange(8.0).view(1, 1, 4, 2))]  # one layer, 4 positions
    kv.write(0, new)
    past, leaves = kv.past(3, requires_grad=True)
    assert torch.equal(past[0][0], new[0][0][:, :, :3]) and past[0][0].requires_grad and len(leaves) == 2
    assert past[0][0].data_ptr() == kv.keys[0].data_ptr()  # a view of the buffer, not a copy
    (past[0][0].sum() * 2 + past[0][1].sum()).backward()
    kv.collect(3, leaves)
    kv.collect(3, leaves)  # a second sibling batch adds its gradient on top
    key_grad, value_grad = kv.grads(0, 3)
    assert torch.equal(key_grad, torch.full((1, 1, 3, 2), 4.0))
    assert torch.equal(value_grad, torch.full((1, 1, 3, 2), 2.0))
    kv.write(1, [(new[0][0][:, :, :2], new[0][1][:, :, :2])])  # rewriting positions 1-2 clears their gradients
    assert torch.equal(kv.grads(0, 3)[0][0, 0, :, 0], torch.tensor([4.0, 0.0, 0.0]))
    assert kv.past(0, requires_grad=False) == (None, [])


def test_forward_only_buffers_keep_no_gradients():
    kv = PathKV(capacity=4, with_grads=False)
    kv.write(0, [(torch.ones(1, 2, 2, 3), torch.ones(1, 2, 2, 3))])
    assert kv.key_grads == [] and not kv.past(2, requires_grad=False)[0][0][0].requires_grad


def test_recorder_orders_layers():
    recorder = KVRecorder()
    for layer in (2, 0, 1):
        recorder.record(layer, torch.full((1,), float(layer)), torch.zeros(1))
    assert len(recorder) == 3 and 1 in recorder
    assert [float(k) for k, _ in recorder.kv()] == [0.0, 1.0, 2.0]


def test_packed_layout():
    batch = SiblingBatch([torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])], start=4, packed=True)
    assert batch.spans == ((0, 3), (3, 1), (4, 2))
    assert batch.input_ids().tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch.positions().tolist() == [[4, 5, 6, 4, 4, 5]]  # each chunk starts at the shared position
    keys = torch.arange(6.0).view(1, 1, 6, 1)
    assert batch.row(keys, 2).flatten().tolist() == [4.0, 5.0]
    columns = [torch.tensor([0, 2]), torch.tensor([0]), torch.tensor([1])]
    kept = batch.keep(columns)
    assert kept.tolist() == [0, 2, 3, 5]
    logits = torch.arange(4.0).view(1, 4, 1)
    assert [t.flatten().tolist() for t in batch.split_logits(logits, kept, columns)] == [[0.0, 1.0], [2.0], [3.0]]


def test_padded_layout():
    batch = SiblingBatch([torch.tensor([5, 6, 7]), torch.tensor([8])], start=2, packed=False)
    assert batch.input_ids().tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.positions().tolist() == [[2, 3, 4], [2, 3, 4]]
    keys = torch.arange(6.0).view(2, 1, 3, 1)
    assert batch.row(keys, 1).flatten().tolist() == [3.0]  # the padding is cut off
    columns = [torch.tensor([1, 2]), torch.tensor([0])]
    kept = batch.keep(columns)
    assert kept.tolist() == [0, 1, 2]  # the union over rows
    logits = torch.arange(6.0).view(2, 3, 1)
    assert [t.flatten().tolist() for t in batch.split_logits(logits, kept, columns)] == [[1.0, 2.0], [3.0]]


def test_a_long_path_of_small_chunks_is_walked_exactly():
    """Every chunk is one level of the walk's recursion: 600 one-token chunks on a path take more frames than
    Python's default limit (1000), as a long rollout in small chunks (or ``auto`` under a tight budget) does. The
    walk makes room for its own depth and computes the one-chunk gradient."""
    import random
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=1024)).double()
    rng = random.Random(0)
    shared = [rng.randrange(32) for _ in range(600)]
    rollouts = [dta.Rollout(input_ids=shared + [rng.randrange(32) for _ in range(8)], advantages=a)
                for a in (1.0, -0.5)]
    tree = dta.PrefixTree.from_rollouts(rollouts)
    limit = sys.getrecursionlimit()
    results = []
    for chunk_size in (None, 1):
        out = dta.tree_backward(model, tree, dta.PolicyLoss(), activation="recompute", chunk_size=chunk_size)
        results.append((out.loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad(set_to_none=True)
    assert sys.getrecursionlimit() == limit  # restored
    (whole, expected), (chunked, got) = results
    assert abs(chunked - whole) <= 1e-12 * abs(whole)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12, msg=name)
