"""An engine option set once in a YAML config reaches every engine call of a step: the DFS training walk, the
SFT warm start, and the RL source's forward-only walks (proximal and reference log-probs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_dta import cli
from lightning_dta.engine.dfs import DFSWalk
from lightning_dta.engine.logprobs import LogprobWalk
from lightning_dta.engine.walk import TreeWalk

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning_dta.rl.OnlineRLCallback
      init_args:
        sft_warmup_steps: 1
        sft_warmup_batch_size: 4
        print_every_n_steps: 0
        reward_plot: null
model:
  model:
    model_type: llama
    vocab_size: 16
    hidden_size: 32
    intermediate_size: 64
    num_hidden_layers: 2
    num_attention_heads: 4
    num_key_value_heads: 2
    max_position_embeddings: 64
  engine:
    chunk_size: 3
    sibling_batch_tokens: 7
    order: tree
data:
  source:
    class_path: lightning_dta.rl.OnlineRolloutSource
    init_args:
      env: lightning_dta.rl.ReverseDigits
      generator:
        class_path: lightning_dta.rl.HFGenerator
        init_args:
          max_new_tokens: 4
      prompts_per_step: 2
      samples_per_prompt: 2
      steps_per_epoch: 10
      rollout_mode: async
      ref_logprobs: true
"""


def test_yaml_engine_options_reach_every_walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    walks: list[TreeWalk] = []
    original = TreeWalk.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        walks.append(self)

    monkeypatch.setattr(TreeWalk, "__init__", recording_init)
    monkeypatch.setattr(sys, "argv", ["lightning-dta"])
    config = tmp_path / "flow.yaml"
    config.write_text(CONFIG)
    cli.cli_main(["fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path}"])
    configured = {walk.engine for walk in walks}
    assert len(configured) == 1, configured
    (engine,) = configured
    assert (engine.chunk_size, engine.sibling_batch_tokens, engine.order) == (3, 7, "tree")
    training = [w for w in walks if isinstance(w, DFSWalk)]
    forward_only = [w for w in walks if isinstance(w, LogprobWalk)]
    # warm start: 1 training step, the demonstration NLL before and after; RL: 2 steps, each with a proximal
    # and a reference walk (async, decoupled, ref_logprobs)
    assert len(training) == 1 + 2
    assert len(forward_only) == 2 + 2 * 2
