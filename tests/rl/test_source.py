"""OnlineRolloutSource: on-policy sync steps, the async staleness bound, decoupled-PPO log-probs, clean shutdown,
clear errors; and the RolloutDataModule detail it relies on (a sized source is not prefetched)."""

from __future__ import annotations

import functools
import math
import threading
import types

import lightning as L
import pytest
import torch

import lightning_dta as dta
from lightning_dta.lightning.data import RolloutDataModule
from lightning_dta.rl import (
    Action,
    Environment,
    HFGenerator,
    OnlineRLCallback,
    OnlineRolloutSource,
    ReverseDigits,
    StepResult,
)
from tests.helpers.rl import ScriptedGenerator, tiny_policy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice on workers and logging


class TwoTurnEnv(Environment):
    """Sample ``s`` of a prompt makes ``1 + s % 2`` calls; the reward is the prompt index plus the turn count."""

    max_turns = 2

    def reset(self, index: int) -> str:
        self.index, self.turns = index, 0
        return "12>"

    def step(self, action: Action) -> StepResult:
        self.turns += 1
        done = self.turns == 2 or action.token_ids[0] == 5
        return StepResult(observation="9", reward=float(self.index + self.turns) if done else 0.0, done=done)

    def default_tokenizer(self):
        return ReverseDigits().default_tokenizer()


def source(mode: str = "sync", generator=None, env=None, **kwargs) -> OnlineRolloutSource:
    generator = generator if generator is not None else ScriptedGenerator([[5, 2], [6, 7, 2]])
    return OnlineRolloutSource(env if env is not None else TwoTurnEnv(), generator, prompts_per_step=2,
                               samples_per_prompt=2, rollout_mode=mode, **kwargs)


def test_sync_step_structure_and_per_episode_advantages():
    src = source()
    src.attach(tiny_policy())
    rollouts = src.next_step()
    info = src.last_step
    assert info.index == 0 and info.policy_version == info.trained_version == 0 and info.staleness == 0
    assert len(info.rewards) == 4 and info.calls == len(rollouts) > 4  # some episodes made two calls
    for r in rollouts:
        trained = [t for t, m in zip(r.input_ids, r.loss_mask) if m]
        assert r.input_ids[0] == 1 and trained[-1] == 2  # BOS first; each call trains its own tokens, EOS included
        assert all(lp == -1.0 for lp, m in zip(r.old_logprobs, r.loss_mask) if m)
    # GRPO per episode: every call of an episode has its episode's advantage; each group is centred over
    # episodes (not over calls, where a two-call episode would count twice)
    by_episode = {}
    for r in rollouts:
        by_episode.setdefault((r.group_id, r.reward), set()).add(r.advantages)
    assert all(len(advantages) == 1 for advantages in by_episode.values())
    for group in (0, 1):
        assert sum(a for (g, _), (a,) in by_episode.items() if g == group) == pytest.approx(0.0, abs=1e-9)
    assert src.next_step() and src.last_step.index == 1 and len(src.history) == 2


def test_reinforce_baseline_and_no_estimator():
    """REINFORCE with a mean baseline: each episode's return minus its prompt's mean return, over episodes."""
    src = source(advantage_estimator="reinforce-baseline")
    src.attach(tiny_policy())
    rollouts = src.next_step()
    episodes = {}
    for r in rollouts:
        episodes.setdefault((r.group_id, r.reward), r.advantages)
    raw = source(advantage_estimator=None)
    raw.attach(tiny_policy())
    assert all(r.advantages == 0.0 and r.reward is not None for r in raw.next_step())  # left to the data module
    info = src.last_step
    by_prompt = {}
    for index, reward in enumerate(info.rewards):
        by_prompt.setdefault(index // 2, []).append(reward)  # 2 samples per prompt, in prompt order
    expected = {(p, r): r - sum(rs) / len(rs) for p, rs in by_prompt.items() for r in rs}
    assert episodes == pytest.approx(expected)


def test_sized_source_is_not_prefetched_under_a_trainer(tmp_path):
    """Lightning prefetches one batch from a loader without a length. The online source has a length, so each
    step is generated after the previous optimizer step: sync mode is on-policy (staleness 0)."""
    requested_at = []

    class Unsized:
        def __call__(self):
            for _ in range(3):
                requested_at.append(module.trainer.global_step)
                yield [dta.Rollout(input_ids=[1, 2, 3], advantages=1.0)]

    class Sized(Unsized):
        def __len__(self) -> int:
            return 3

    for steps, expected in ((Sized(), [0, 1, 2]), (Unsized(), [0, 0, 1])):
        requested_at.clear()
        module = dta.DTAModule(tiny_policy(), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=1, max_steps=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)
        trainer.fit(module, RolloutDataModule(source=steps))
        assert requested_at[:3] == expected, (type(steps).__name__, requested_at)


def drive(src: OnlineRolloutSource, steps: int, run_ahead: int = 0, start_version: int = 0) -> list:
    """A minimal training loop: take a step, 'train' it until the background thread has generated ``run_ahead``
    steps ahead (or 10 s passed), publish the next policy version."""
    policy = src.policy
    infos = []
    for version in range(steps):
        src.next_step()
        infos.append(src.last_step)
        deadline = threading.Event()
        while src.steps_ahead < run_ahead and not deadline.wait(0.005):
            pass
        src.update_policy(policy, start_version + version + 1)
    return infos


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_async_staleness_bound_holds_and_is_used(max_staleness):
    """While a step trains, the producer generates as far ahead as the bound allows and no further: step i is
    generated with the weights of version max(0, i - max_staleness)."""
    src = source("async", max_staleness=max_staleness)
    src.attach(tiny_policy())
    try:
        infos = drive(src, steps=6, run_ahead=max_staleness)
        assert src.steps_ahead == max_staleness  # never more than the bound waiting
    finally:
        src.close()
    assert [i.index for i in infos] == list(range(6))
    assert [i.trained_version for i in infos] == list(range(6))
    assert [i.staleness for i in infos] == [min(i, max_staleness) for i in range(6)]
    used = src.generator.versions  # the weights' version at every generate call (one per turn)
    assert used == sorted(used) and {i.policy_version for i in infos} <= set(used)


def test_async_without_policy_updates_says_what_is_missing():
    src = source("async", max_staleness=1)
    src.attach(tiny_policy())
    try:
        src.next_step()
        src.next_step()
        with pytest.raises(RuntimeError, match=r"update_policy\(\) is not being called"):
            src.next_step()
    finally:
        src.close()


def test_async_generation_failure_reaches_the_trainer():
    class Broken(TwoTurnEnv):
        def step(self, action):
            raise ZeroDivisionError("tool crashed")

    src = source("async", env=Broken())
    src.attach(tiny_policy())
    try:
        with pytest.raises(RuntimeError, match="generation thread failed: tool crashed") as info:
            src.next_step()
        assert isinstance(info.value.__cause__, ZeroDivisionError)
    finally:
        src.close()


def test_close_stops_the_thread_and_counts_untrained_steps():
    src = source("async", max_staleness=2)
    src.attach(tiny_policy())
    drive(src, steps=2, run_ahead=2)
    thread = src._producer._thread
    src.close()
    assert not thread.is_alive() and src.discarded_steps == 2
    src.close()  # idempotent
    assert not any(t.name == "lightning-dta-rollouts" and t.is_alive() for t in threading.enumerate())
    src.attach(src.generator.policy, version=2)  # a second fit continues the step count
    try:
        infos = drive(src, steps=2, start_version=2)
        with pytest.raises(ValueError, match="must not go back"):
            src.update_policy(src.policy, 1)
    finally:
        src.close()
    assert [i.index for i in infos] == [2, 3] and [i.trained_version for i in infos] == [2, 3]
    assert all(i.policy_version >= 2 for i in infos)  # generated with the weights given at the new attach()


def stale_step(**kwargs) -> tuple[list[dta.Rollout], torch.nn.Module, torch.nn.Module]:
    """An async step generated with version 0 and handed out at version 1 (the policy changed in between);
    returns its rollouts, the current policy and a copy of the generating (stale) policy."""
    policy = tiny_policy(scale=2.0)
    stale_policy = tiny_policy(scale=2.0)
    src = OnlineRolloutSource(ReverseDigits(), HFGenerator(max_new_tokens=6), prompts_per_step=2, samples_per_prompt=3,
                              rollout_mode="async", max_staleness=1, **kwargs)
    src.attach(policy)
    try:
        src.next_step()  # step 0, generated and trained at version 0
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(1.1)  # "an optimizer step"
        src.update_policy(policy, 1)
        rollouts = src.next_step()  # step 1: generated with version 0 (staleness 1), handed out at version 1
        assert src.last_step.staleness == 1
    finally:
        src.close()
    return rollouts, policy, stale_policy


def trained(rollout: dta.Rollout) -> list[int]:
    return [t for t, m in enumerate(rollout.loss_mask) if m]


def test_async_rollouts_carry_behaviour_prox_and_ref_logprobs():
    """old = the (stale) generating weights, prox = the current weights via tree_logprobs, ref = frozen copy."""
    rollouts, policy, stale_policy = stale_step(ref_logprobs=True)
    tree = dta.PrefixTree.from_rollouts(rollouts)
    current = dta.tree_logprobs(policy, tree)
    stale = dta.tree_logprobs(stale_policy, tree)
    for r, now, then in zip(rollouts, current, stale):
        assert r.prox_logprobs == pytest.approx([0.0] + now.tolist(), abs=1e-6)
        assert r.ref_logprobs == pytest.approx([0.0] + then.tolist(), abs=1e-6)  # the copy at attach()
        assert [r.old_logprobs[t] for t in trained(r)] == pytest.approx([float(then[t - 1]) for t in trained(r)],
                                                                        abs=1e-5)
        assert max(abs(r.prox_logprobs[t] - r.old_logprobs[t]) for t in trained(r)) > 1e-3  # really off-policy


def test_the_losss_importance_cap_truncates_the_stale_steps_large_weights():
    """The async source hands out the behaviour log-probs as generated; PolicyLoss(importance_weight_cap=...)
    truncates w = exp(prox - old) in the loss: its mean weight is the mean of min(w, cap) over trained tokens."""
    rollouts, policy, _ = stale_step()
    weights = [math.exp(r.prox_logprobs[t] - r.old_logprobs[t]) for r in rollouts for t in trained(r)]
    assert max(weights) > 1.02 and min(weights) < 1.0  # the data exercises both sides of the cap
    out = dta.tree_backward(policy, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss(importance_weight_cap=1.02))
    assert out.metrics["importance_weight_mean"] == pytest.approx(
        sum(min(w, 1.02) for w in weights) / len(weights), rel=1e-5)
    assert out.metrics["capped_fraction"] == pytest.approx(sum(w > 1.02 for w in weights) / len(weights))


def test_attach_and_next_step_errors_name_the_fix():
    with pytest.raises(RuntimeError, match="OnlineRLCallback"):
        source().next_step()
    with pytest.raises(ValueError, match="vocab_size"):
        source().attach(tiny_policy(vocab_size=8))
    no_eos = ReverseDigits().default_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="no eos_token_id"):
        OnlineRolloutSource(ReverseDigits(), tokenizer=no_eos).attach(tiny_policy())
    with pytest.raises(ValueError, match="mode"):
        OnlineRolloutSource(ReverseDigits(), rollout_mode="fast")
    src = source()
    src.attach(tiny_policy())
    with pytest.raises(RuntimeError, match="twice"):
        src.attach(tiny_policy())


def fake_trainer(src, world_size=1):
    return types.SimpleNamespace(datamodule=RolloutDataModule(source=src), world_size=world_size)


def test_callback_refuses_inconsistent_set_ups():
    module = types.SimpleNamespace(loss_fn=dta.PolicyLoss())
    find = OnlineRLCallback._find_source
    assert find(fake_trainer(source()), module) is not None
    with pytest.raises(ValueError, match="estimated twice"):
        RolloutDataModule(source=source(), advantage_estimator="grpo")
    with pytest.raises(ValueError, match="ref_logprobs=True"):
        find(fake_trainer(source()), types.SimpleNamespace(loss_fn=dta.PolicyLoss(kl_coef=0.1)))
    assert find(fake_trainer(source(), world_size=2), module) is not None  # N ranks: every rank runs the source
    with pytest.raises(TypeError, match="OnlineRolloutSource"):
        find(fake_trainer([[dta.Rollout(input_ids=[1, 2])]]), module)


def test_advantage_options_reach_the_estimate_and_a_tempered_loss_is_refused():
    """The estimator's options apply per episode (unbiased std: a group of two gets +-0.707, not +-1); a tempered
    loss would compare the generator's temperature-1 log-probs with another policy: refused at attach."""
    src = source(advantage_options={"std_unbiased": True, "eps": 0.0})
    src.attach(tiny_policy())
    advantages = sorted({round(float(r.advantages), 6) for r in src.next_step()})
    assert advantages == [-0.707107, 0.707107], advantages
    src.close()
    with pytest.raises(ValueError, match="weighting='token'"):
        source(advantage_options={"weighting": "token"})
    with pytest.raises(ValueError, match="policy_temperature"):
        source().attach(tiny_policy(), engine=dta.EngineOptions(policy_temperature=0.7))
