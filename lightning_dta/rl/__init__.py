"""The online RL loop: generate with the current policy, score, estimate advantages, train with DFS, repeat.

- :class:`OnlineRolloutSource` (``source.py``): the ``RolloutDataModule`` source; synchronous or asynchronous
  (bounded staleness, decoupled PPO) generation.
- :class:`OnlineRLCallback` (``callback.py``): attaches the source to the policy, refreshes the generator's
  weights after every optimizer step, logs rewards and timings, saves the reward plot.
- Generators (``generation.py``, ``server.py``, ``vllm_colocated.py``): :class:`HFGenerator` (in-process
  ``model.generate``, the default), :class:`OpenAICompatibleGenerator` (a vLLM / SGLang server over HTTP) and
  :class:`VLLMGenerator` (vLLM in the training process, weights handed over in memory).
- Environments (``environment.py``, ``tasks.py``, ``envs/``): :class:`Environment`, :func:`run_episodes`, the
  single-turn toy task :class:`ReverseDigits` and the multi-turn :class:`CalculatorEnv`; reward callables.
- ``tokenizer.py``: a locally built character tokenizer; ``warmup.py``: the SFT warm start; ``plot.py``.

See docs/rl.md.
"""

from lightning_dta.rl.callback import OnlineRLCallback
from lightning_dta.rl.environment import Action, Environment, Episode, RewardError, StepResult, run_episodes
from lightning_dta.rl.envs.calculator import CalculatorEnv
from lightning_dta.rl.generation import Completion, Generator, HFGenerator
from lightning_dta.rl.server import OpenAICompatibleGenerator
from lightning_dta.rl.source import OnlineRolloutSource, StepInfo
from lightning_dta.rl.tasks import ReverseDigits, exact_match, position_match
from lightning_dta.rl.tokenizer import make_char_tokenizer
from lightning_dta.rl.vllm_colocated import VLLMGenerator
from lightning_dta.rl.warmup import sft_warm_start

__all__ = [
    "Action",
    "CalculatorEnv",
    "Completion",
    "Environment",
    "Episode",
    "Generator",
    "HFGenerator",
    "OnlineRLCallback",
    "OnlineRolloutSource",
    "OpenAICompatibleGenerator",
    "ReverseDigits",
    "RewardError",
    "StepInfo",
    "StepResult",
    "VLLMGenerator",
    "exact_match",
    "make_char_tokenizer",
    "position_match",
    "run_episodes",
    "sft_warm_start",
]
