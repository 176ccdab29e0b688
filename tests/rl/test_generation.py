"""The toy tokenizer and HFGenerator: exact behaviour log-probs, stopping, seeded sampling, weight refresh."""

from __future__ import annotations

import collections

import pytest
import torch

import lightning_dta as dta
from lightning_dta.rl import HFGenerator, make_char_tokenizer
from lightning_dta.rl.generation import cut_at_stop
from tests.helpers.rl import tiny_policy

EOS = 2


def test_char_tokenizer_round_trip_and_special_ids():
    tok = make_char_tokenizer("0123456789> ")
    assert len(tok) == 16 and (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok.encode("31> 7", add_special_tokens=False)
    assert ids == [7, 5, 14, 15, 11]
    assert tok.decode(ids) == "31> 7"  # no spaces inserted between characters
    assert tok.decode([1] + ids + [2], skip_special_tokens=True) == "31> 7"
    assert tok.encode("3x", add_special_tokens=False) == [7, tok.unk_token_id]  # visible, not dropped
    with pytest.raises(ValueError, match="repeats"):
        make_char_tokenizer("0120")


def attached(model, **kwargs) -> HFGenerator:
    generator = HFGenerator(**kwargs)
    generator.attach(model, eos_token_id=EOS, pad_token_id=0, share_weights=True)
    return generator


def test_behaviour_logprobs_equal_the_policy_logprobs_with_left_padding():
    """Prompts of different lengths are left-padded in one batch; each generated token's recorded log-prob must be
    the policy's log-prob of that token given the unpadded context (what the loss recomputes)."""
    model = tiny_policy(dtype=torch.float64, scale=3.0)
    generator = attached(model, max_new_tokens=6, batch_size=4)  # two generate calls for 6 prompts
    prompts = [[1, 5, 6, 7, 14], [1, 8, 14], [1, 4, 9, 9, 9, 9, 14], [1, 14], [1, 6, 6, 14], [1, 13, 14]]
    completions = generator.generate(prompts, seed=7)
    assert len(completions) == len(prompts)
    rollouts = [dta.Rollout(input_ids=p + c.token_ids) for p, c in zip(prompts, completions)]
    expected = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts))
    for prompt, completion, logprobs in zip(prompts, completions, expected):
        assert len(completion.logprobs) == len(completion.token_ids) >= 1
        # generate casts logits to float32, hence 1e-5 and not 1e-12
        torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64),
                                   logprobs[len(prompt) - 1:], rtol=0, atol=1e-5)


def test_stop_token_ends_a_completion_and_is_kept():
    model = tiny_policy(scale=3.0)
    completions = attached(model, max_new_tokens=12).generate([[1, 5, 14]] * 64, seed=0)
    reasons = collections.Counter(c.finish_reason for c in completions)
    assert reasons["stop"] > 0 and reasons["length"] > 0, reasons  # the test data must exercise both
    for c in completions:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 12 and EOS not in c.token_ids
    extra = attached(model, max_new_tokens=12, stop_token_ids=[7]).generate([[1, 5, 14]] * 64, seed=0)
    assert all(c.token_ids[-1] in (EOS, 7) for c in extra if c.finish_reason == "stop")
    assert any(c.token_ids[-1] == 7 for c in extra)


def test_cut_at_stop():
    assert cut_at_stop([4, 5, 2, 0, 0], [-1, -2, -3, -4, -5], {2}).token_ids == [4, 5, 2]
    assert cut_at_stop([4, 5], [-1, -2], {2}).finish_reason == "length"


def test_sampling_is_seeded_and_independent_of_the_global_rng():
    model = tiny_policy(scale=2.0)
    generator = attached(model, max_new_tokens=6)
    prompts = [[1, 5, 14]] * 16
    torch.manual_seed(123)
    first = [c.token_ids for c in generator.generate(prompts, seed=4)]
    torch.manual_seed(999)
    again = [c.token_ids for c in generator.generate(prompts, seed=4)]
    other = [c.token_ids for c in generator.generate(prompts, seed=5)]
    assert first == again and first != other
    assert len({tuple(t) for t in first}) > 4  # samples, not one greedy answer repeated


def test_samples_follow_the_policy_distribution():
    """Gumbel-max sampling inside generate draws from softmax(logits): compare first-token frequencies with the
    model's probabilities over 4000 samples (tolerance 5 standard errors, so this is not flaky)."""
    model = tiny_policy(scale=2.0)
    generator = attached(model, max_new_tokens=1, batch_size=4000)
    prompt = [1, 5, 14]
    counts = collections.Counter(c.token_ids[0] for c in generator.generate([prompt] * 4000, seed=0))
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
    for token in range(16):
        p = float(probs[token])
        assert abs(counts[token] / 4000 - p) <= 5 * (p * (1 - p) / 4000) ** 0.5 + 1e-3, (token, counts[token], p)


def test_top_k_restricts_the_samples():
    model = tiny_policy(scale=2.0)
    prompt = [1, 5, 14]
    completions = attached(model, max_new_tokens=1, top_k=2, batch_size=512).generate([prompt] * 512, seed=0)
    with torch.no_grad():
        top2 = set(model(input_ids=torch.tensor([prompt])).logits[0, -1].topk(2).indices.tolist())
    assert {c.token_ids[0] for c in completions} == top2


def test_private_copy_follows_update_weights_and_shared_model_needs_none():
    policy = tiny_policy(scale=2.0)
    generator = HFGenerator(max_new_tokens=4)
    generator.attach(policy, eos_token_id=EOS, pad_token_id=0, share_weights=False)
    assert generator.model is not policy
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)
    stale = next(generator.model.parameters()).clone()
    assert not torch.equal(stale, next(policy.parameters()))  # the copy does not move with training
    generator.update_weights(policy, version=3)
    assert generator.version == 3
    for mine, theirs in zip(generator.model.parameters(), policy.parameters()):
        assert torch.equal(mine, theirs) and not mine.requires_grad
    shared = HFGenerator()
    shared.attach(policy, eos_token_id=EOS, pad_token_id=0, share_weights=True)
    assert shared.model is policy


def test_generator_refuses_bad_settings_with_the_fix():
    with pytest.raises(ValueError, match="no stop token"):
        HFGenerator().attach(tiny_policy(), eos_token_id=None, pad_token_id=0, share_weights=True)
    with pytest.raises(ValueError, match="temperature"):
        HFGenerator(temperature=0.0)
    with pytest.raises(RuntimeError, match="attach"):
        HFGenerator().generate([[1, 2]], seed=0)
    with pytest.raises(ValueError, match="empty"):
        attached(tiny_policy()).generate([[]], seed=0)
