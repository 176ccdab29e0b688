"""Environments and episodes: reward callables, the toy tasks, every LLM call as a rollout with its full context,
and the multi-turn tree: compression > 2 and DFS gradients equal to per-rollout gradients on it."""

from __future__ import annotations

import math

import pytest
import torch

import lightning_dta as dta
from lightning_dta.rl import (
    Action,
    CalculatorEnv,
    Environment,
    HFGenerator,
    OnlineRolloutSource,
    ReverseDigits,
    RewardError,
    StepResult,
    exact_match,
    position_match,
    run_episodes,
)
from lightning_dta.rl.envs.calculator import SYSTEM_PROMPT
from lightning_dta.rl.warmup import demonstration_rollout, sft_warm_start
from tests.helpers.reference import RTOL64, assert_grads_close, engine_grads, reference_grads
from tests.helpers.rl import ScriptedGenerator, tiny_policy


def test_reward_functions():
    assert exact_match(" 4042", "4042") == 1.0 and exact_match("404", "4042") == 0.0
    assert position_match("4321", "4321") == 1.0
    assert position_match("4301", "4321") == 0.75
    assert position_match("43", "4321") == 0.5  # missing characters cost like wrong ones
    assert position_match("432111", "4321") == pytest.approx(4 / 6)  # so do extra ones
    assert position_match("", "") == 1.0


def test_reverse_digits_prompts_rewards_and_demonstrations():
    env = ReverseDigits(min_digits=3, max_digits=5, seed=1)
    prompt = env.reset(7)
    assert prompt == env.clone().reset(7) and prompt != ReverseDigits(seed=2).reset(7)  # seeded per index
    digits = prompt[:-1]
    assert prompt.endswith(">") and 3 <= len(digits) <= 5 and digits.isdigit()
    assert env.step(Action(digits[::-1], [], "stop")) == StepResult(reward=1.0, done=True, info={"correct": True})
    assert env.step(Action("", [], "length")).reward == 0.0
    assert env.demonstration(7) == [(prompt, digits[::-1])]
    assert ReverseDigits(reward_fn=exact_match).reset(0)  # any callable (response, answer) -> float


def test_episode_calls_are_rollouts_with_full_context_and_own_loss_mask():
    class Echo(Environment):
        max_turns = 3

        def reset(self, index):
            self.turn = 0
            return [10 + index]  # token observations are taken as ids

        def step(self, action):
            self.turn += 1
            return StepResult(observation="7", reward=0.5, done=self.turn == 3)

    tok = ReverseDigits().default_tokenizer()
    generator = ScriptedGenerator([[5, 6, 2], [8, 2]])
    episodes = run_episodes(Echo(), generator, tok, [0, 1], samples_per_prompt=2, seed=0)
    assert [(e.prompt_index, e.sample) for e in episodes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    seven = tok.convert_tokens_to_ids("7")
    for episode in episodes:
        assert len(episode.calls) == 3 and episode.reward == 1.5 and episode.finish == "done"
        for k, (call, action) in enumerate(zip(episode.calls, episode.actions)):
            assert call.input_ids[:2] == [tok.bos_token_id, 10 + episode.prompt_index]
            assert call.reward == 1.5 and call.group_id == episode.prompt_index
            trained = [t for t, m in zip(call.input_ids, call.loss_mask) if m]
            assert trained == action.token_ids == call.input_ids[-len(action.token_ids):]  # only this call
            assert [lp for lp, m in zip(call.old_logprobs, call.loss_mask) if m] == [-1.0] * len(trained)
            if k:  # the previous call, its tokens and the observation are this call's context
                previous = episode.calls[k - 1]
                assert call.input_ids[:len(previous.input_ids) + 1] == previous.input_ids + [seven]
    tree = dta.PrefixTree.from_rollouts([c for e in episodes for c in e.calls])
    assert tree.stats.compression_ratio > 2


def test_context_limit_ends_an_episode_and_a_prompt_too_long_is_refused():
    env = CalculatorEnv(max_turns=3)
    tok = env.default_tokenizer()
    prompt_tokens = 1 + len(env.reset(0))
    generator = ScriptedGenerator([tok.encode("oops", add_special_tokens=False) + [2]], max_new_tokens=8)
    episodes = run_episodes(env, generator, tok, [0], 1, seed=0, max_context=prompt_tokens + 8 + 5 + 6 + 8)
    assert episodes[0].finish == "context_limit" and len(episodes[0].calls) == 2
    with pytest.raises(ValueError, match="prompt 0 has .* tokens"):
        run_episodes(env, generator, tok, [0], 1, seed=0, max_context=prompt_tokens + 7)


def test_a_nan_reward_names_the_prompt_and_the_fix():
    env = ReverseDigits(reward_fn=lambda response, answer: math.nan)
    with pytest.raises(RewardError, match=r"prompt 3 \(sample 0, call 0, action '5'\).*finite number.*Fix"):
        run_episodes(env, ScriptedGenerator([[9, 2]]), env.default_tokenizer(), [3], 2, seed=0)


def test_calculator_tool_calls_answers_and_errors():
    env = CalculatorEnv(max_turns=3, seed=0)
    prompt = env.reset(5)
    left, op, right = env.question
    assert prompt == f"{SYSTEM_PROMPT}q: {left}{op}{right}\n"
    assert env.step(Action("calc(12*34)", [], "stop")).observation == "= 408\n"
    assert env.step(Action("hello", [], "stop")) == StepResult(observation="error\n",
                                                               info={"correct": False, "tool_calls": 1})
    wrong = env.step(Action(f"ans({env.answer + 1})", [], "stop"))
    assert wrong.done and wrong.reward == 0.0 and not wrong.info["correct"]
    right_answer = env.step(Action(f" ans({env.answer}) ", [], "stop"))
    assert right_answer.done and right_answer.reward == 1.0 and right_answer.info["correct"]


def test_calculator_demonstration_replayed_by_the_policy_scores_one():
    """The demonstration format is exactly what run_episodes builds: replaying its actions earns the reward, and
    the SFT rollout is the last call's rollout with every action trained."""
    env = CalculatorEnv(max_turns=3)
    tok = env.default_tokenizer()
    (_, call), (_, answer) = env.demonstration(4)
    replies = [tok.encode(call, add_special_tokens=False) + [2], tok.encode(answer, add_special_tokens=False) + [2]]

    class Replay(ScriptedGenerator):
        def generate(self, prompts, seed):
            completions = super().generate(prompts, seed)
            return [type(c)(replies[len(self.calls) - 1], c.logprobs[:1] * len(replies[len(self.calls) - 1]), "stop")
                    for c in completions]

    (episode,) = run_episodes(env, Replay([[0]]), tok, [4], 1, seed=0)
    assert episode.reward == 1.0 and episode.info["correct"] and len(episode.calls) == 2
    sft = demonstration_rollout(env, tok, 4)
    assert sft.input_ids == episode.calls[-1].input_ids
    assert sum(sft.loss_mask) == sum(len(r) for r in replies)


def test_sft_warm_start_lowers_the_demonstration_nll():
    """From about uniform over the 16 tokens to better than uniform over the 11 an answer uses (digits, EOS)."""
    env = ReverseDigits()
    model = tiny_policy(vocab_size=16)
    result = sft_warm_start(model, env, env.default_tokenizer(), steps=30, lr=3e-3, batch_size=16)
    assert result.steps == 30 and result.nll_before > math.log(14) and result.nll_after < math.log(11)


def test_multi_turn_step_tree_compresses_and_dfs_gradients_are_exact():
    """One step of calculator episodes played by a float64 policy: 4 prompts x 4 samples, up to 3 calls each.
    Every call is a rollout with its whole context, so the tree shares the system prompt, each question and each
    episode's history: compression > 2. On that tree, DFS gradients equal the per-rollout gradients (vanilla
    mode, and the independent reference of tests/reference.py), per parameter, relative error <= 1e-12."""
    env = CalculatorEnv(max_turns=3)
    policy = tiny_policy(vocab_size=64, dtype=torch.float64, scale=2.0, max_positions=256)
    source = OnlineRolloutSource(env, HFGenerator(max_new_tokens=12), prompts_per_step=4, samples_per_prompt=4,
                                 seed=3)
    source.attach(policy)
    rollouts = source.next_step()
    info = source.last_step
    assert info.calls > len(info.rewards)  # multi-turn: more calls than episodes
    assert max(len(r) for r in rollouts) > len(SYSTEM_PROMPT) + 30
    tree = dta.PrefixTree.from_rollouts(rollouts, vocab_size=64, max_positions=256)
    assert tree.stats.compression_ratio > 2, tree
    assert info.compression_ratio == pytest.approx(tree.stats.compression_ratio)
    assert tree.stats.max_depth_tokens > 2 * (len(SYSTEM_PROMPT) // 2)
    # GRPO advantages: give the rollouts a spread (random episodes rarely earn a reward) so gradients are not 0
    rollouts = [dta.Rollout(**{**r.to_dict(), "advantages": float((i % 5) - 2)}) for i, r in enumerate(rollouts)]
    tree = dta.PrefixTree.from_rollouts(rollouts)
    loss_fn = dta.PolicyLoss(clip_eps=0.2)
    out_dfs, dfs = engine_grads(policy, tree, loss_fn, mode="dfs")
    out_vanilla, vanilla = engine_grads(policy, tree, loss_fn, mode="vanilla")
    assert out_dfs.loss == pytest.approx(out_vanilla.loss, rel=RTOL64)
    assert_grads_close(dfs, vanilla, RTOL64, what="dfs vs vanilla")
    _, reference = reference_grads(policy, rollouts, loss_fn)
    assert_grads_close(dfs, reference, RTOL64, what="dfs vs reference")
