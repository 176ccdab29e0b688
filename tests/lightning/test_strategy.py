"""DTAStrategy: registered on import, no wrapper, refuses set-ups whose gradients it would not sum correctly."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dta as dta
from lightning_dta.core.errors import ConfigError
from lightning_dta.distributed.step import batch_tree, step_totals
from lightning_dta.lightning.step import check_dfs_setup
from tests.helpers.lightning import StepBatchData, grpo_rollouts, rank_batch, tiny_llama


def test_import_registers_the_strategy_names() -> None:
    for name, start_method in (("dta", "popen"), ("dta_spawn", "spawn"), ("dta_fork", "fork")):
        assert name in StrategyRegistry
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, dta.DTAStrategy) and strategy._start_method == start_method
    dta.DTAStrategy.register_strategies(StrategyRegistry)  # importing twice (reload) must not raise


def test_trainer_resolves_the_name_and_keeps_the_module_unwrapped(tmp_path: Path) -> None:
    module = dta.DTAModule(tiny_llama())
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    assert isinstance(trainer.strategy, dta.DTAStrategy)
    trainer.fit(module, StepBatchData(lambda t: [rank_batch(grpo_rollouts(), 0, 1)]))
    assert trainer.strategy.model is module  # no DistributedDataParallel around it


def test_bucket_size_must_be_positive() -> None:
    assert dta.DTAStrategy(bucket_mb=8).bucket_mb == 8.0
    with pytest.raises(ValueError, match="bucket_mb"):
        dta.DTAStrategy(bucket_mb=0)


class AutomaticModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_automatic_optimization_is_refused(tmp_path: Path) -> None:
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match="automatic_optimization = False"):
        trainer.fit(AutomaticModule(), torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2))


def test_step_refuses_a_wrapped_module_and_loss_scaling() -> None:
    module = SimpleNamespace(automatic_optimization=False)
    wrapped = SimpleNamespace(model=torch.nn.Identity(), lightning_module=module,
                              precision_plugin=SimpleNamespace(precision="32-true"))
    with pytest.raises(ConfigError, match="strategy='dta'"):
        check_dfs_setup(wrapped)
    scaled = SimpleNamespace(model=module, lightning_module=module,
                             precision_plugin=SimpleNamespace(precision="bf16-mixed", scaler=object()))
    with pytest.raises(ConfigError, match="16-mixed"):
        check_dfs_setup(scaled)
    check_dfs_setup(SimpleNamespace(model=module, lightning_module=module,
                                    precision_plugin=SimpleNamespace(precision="32-true", scaler=None)))


def test_batch_tree_and_normalizer() -> None:
    rollouts = grpo_rollouts()
    batch = rank_batch(rollouts, 0, 1)
    assert batch_tree(batch) is batch.tree and batch_tree(batch.tree) is batch.tree and batch_tree(None) is None
    with pytest.raises(TypeError, match="StepBatch"):
        batch_tree([1, 2])
    trained = sum(sum(r.loss_mask[1:]) for r in rollouts)
    # (trained tokens, rollouts with a trained token, rollouts): counts, whatever agg, so they add over ranks
    assert step_totals(batch.tree, dta.PolicyLoss())[0] == (trained, len(rollouts), len(rollouts))
    assert step_totals(None, dta.PolicyLoss())[0] == (0.0, 0.0, 0.0)  # an empty rank adds nothing to the sum
    assert step_totals(batch.tree, dta.PolicyLoss(agg="sum"))[0] == (trained, len(rollouts), len(rollouts))


def test_a_step_that_asks_for_kl_without_any_reference_logprobs_is_refused() -> None:
    """kl_coef > 0 and no ref_logprobs anywhere in the step used to train without the KL term, in silence."""
    import dataclasses

    from lightning_dta.distributed.step import tree_step_backward

    model, rollouts = tiny_llama(), grpo_rollouts()
    without = [dataclasses.replace(r, ref_logprobs=None) for r in rollouts]
    for agg in ("token-mean", "sum"):
        with pytest.raises(ConfigError, match="no rollout of this step carries ref_logprobs.*kl_coef"):
            tree_step_backward(model, dta.PrefixTree.from_rollouts(without), dta.PolicyLoss(kl_coef=0.1, agg=agg))
    model.zero_grad()
    tree_step_backward(model, dta.PrefixTree.from_rollouts(without), dta.PolicyLoss())  # no KL asked: fine
    partly = without[:-1] + rollouts[-1:]  # the KL applies where reference log-probs are given
    out = tree_step_backward(model, dta.PrefixTree.from_rollouts(partly), dta.PolicyLoss(kl_coef=0.1))
    assert out.metrics["ref_kl"] > 0
