"""An SFT warm start on an environment's demonstrations, trained with the same DFS engine as RL.

RL improves a policy that sometimes succeeds; a randomly initialised toy model almost never does, and a group
whose rewards are all equal gives GRPO no signal. A few supervised steps on correct episodes teach the format
(where the answer goes, when to stop), after which the reward has room to rise and a spread to learn from.
SFT is the policy loss with ``advantages = 1`` and no behaviour log-probs, so it runs through ``tree_backward``
like every other step (the demonstrations of a batch share their BOS prefix in the tree).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_dta.contracts import ParallelLayout
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.sharding import is_sharded, reduce_gradients, unsharded
from lightning_dta.engine import EngineOptions, tree_backward, tree_logprobs, tree_loss_normalizer
from lightning_dta.rl.environment import Environment, encode_observation

# Demonstrations are prompts DEMONSTRATION_OFFSET + k (training) and DEMONSTRATION_OFFSET - 1 - k (the NLL
# measurement), far from the RL prompts 0, 1, 2, ...
DEMONSTRATION_OFFSET = 10**9


def demonstration_rollout(env: Environment, tokenizer: PreTrainedTokenizerBase, index: int,
                          add_bos: bool = True) -> Rollout:
    """One correct episode as an SFT rollout: observations untrained, each action and its EOS trained."""
    ids = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    mask = [0] * len(ids)
    for observation, action in env.demonstration(index):
        observed = encode_observation(observation, tokenizer)
        acted = list(tokenizer.encode(action, add_special_tokens=False)) + [tokenizer.eos_token_id]
        ids += observed + acted
        mask += [0] * len(observed) + [1] * len(acted)
    return Rollout(input_ids=ids, loss_mask=mask, advantages=1.0)


def demonstration_nll(model: nn.Module, rollouts: list[Rollout], engine: EngineOptions | None = None) -> float:
    """Mean negative log-likelihood of the trained tokens of ``rollouts`` (one forward-only tree walk)."""
    with unsharded(model, training=False):
        logprobs = tree_logprobs(model, PrefixTree.from_rollouts(rollouts), engine=engine)
    total = count = 0.0
    for rollout, values in zip(rollouts, logprobs):
        mask = torch.as_tensor(rollout.mask()[1:], dtype=values.dtype, device=values.device)
        total -= float((values * mask).sum())
        count += float(mask.sum())
    return total / max(count, 1.0)


@dataclass
class WarmStartResult:
    """The warm start's effect: the demonstrations' mean NLL per trained token before and after (measured on one
    fixed batch of demonstrations), and the wall time."""

    steps: int
    nll_before: float
    nll_after: float
    seconds: float


def sft_warm_start(model: nn.Module, env: Environment, tokenizer: PreTrainedTokenizerBase, steps: int, *,
                   lr: float = 3e-3, batch_size: int = 32, add_bos: bool = True,
                   engine: EngineOptions | None = None, layout: ParallelLayout | None = None) -> WarmStartResult:
    """Train ``model`` for ``steps`` AdamW steps on batches of ``batch_size`` demonstrations.

    A private optimizer is used and dropped, so the RL optimizer starts with fresh state. Demonstrations come
    from prompt indices ``DEMONSTRATION_OFFSET + k``, not the RL prompts. On several ranks every rank trains on the
    same batches (the warm start is small): replicated weights stay identical without communication; sharded
    weights (``dta_fsdp``) sum every data-parallel rank's gradient (``layout``: the strategy's), so each rank divides
    by the number of data-parallel ranks. (The policy loss
    of an SFT step is always -1 - the advantage times a ratio of 1 - so progress is reported as the NLL instead.)
    ``engine``: the :class:`~lightning_dta.EngineOptions` of the training and forward-only walks.
    """
    if steps < 0 or batch_size < 1:
        raise ConfigError(f"steps={steps} must be >= 0 and batch_size={batch_size} >= 1")
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no eos_token_id; demonstrations must end with one so the policy learns "
                         "to stop")
    started = time.perf_counter()
    evaluation = [demonstration_rollout(env, tokenizer, DEMONSTRATION_OFFSET - 1 - k, add_bos)
                  for k in range(batch_size)]
    nll_before = demonstration_nll(model, evaluation, engine)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss_fn = PolicyLoss()
    copies = (layout or ParallelLayout()).data_parallel_size if is_sharded(model) else 1
    for step in range(steps):
        first = DEMONSTRATION_OFFSET + step * batch_size
        tree = PrefixTree.from_rollouts([demonstration_rollout(env, tokenizer, first + k, add_bos)
                                         for k in range(batch_size)])
        optimizer.zero_grad(set_to_none=True)
        with unsharded(model):
            tree_backward(model, tree, loss_fn, engine=engine,
                          normalizer=[n * copies for n in tree_loss_normalizer(tree, loss_fn)])
        reduce_gradients(model)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return WarmStartResult(steps, nll_before, demonstration_nll(model, evaluation, engine),
                           time.perf_counter() - started)
