"""``lightning-dta convert``: their settings as a fit config fragment that LightningCLI instantiates into the
converted loss and advantage settings; refusals and unreadable files exit with status 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

import lightning_dta as dta
from lightning_dta import cli
from tests import helpers

VERL = {"actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-mean", "clip_ratio_high": 0.28,
                                        "ppo_mini_batch_size": 8, "ppo_epochs": 2},
                              "rollout": {"n": 8, "temperature": 0.9}},
        "data": {"train_batch_size": 16}, "trainer": {"balance_batch": False},
        "algorithm": {"adv_estimator": "grpo", "rollout_correction": {
            "rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1,seq_mean_k3",
            "rollout_rs_threshold": "0.5_2.0,0.02"}}}


def test_the_fragment_instantiates_the_converted_settings(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-dta"])
    config = tmp_path / "verl.yaml"
    config.write_text(yaml.safe_dump(VERL))
    assert cli.main(["convert", "verl", str(config)]) == 0
    fragment = tmp_path / "fragment.yaml"
    fragment.write_text(capsys.readouterr().out)
    parsed = cli.cli_main(["--config", str(helpers.REPO / "configs" / "tiny_cpu.yaml"), "--config", str(fragment),
                           f"--trainer.default_root_dir={tmp_path}",
                           f"--trainer.logger.init_args.save_dir={tmp_path}"], run=False)
    converted = dta.PolicyLoss.from_verl(VERL["actor_rollout_ref"]["actor"], VERL["algorithm"],
                                         VERL["actor_rollout_ref"]["rollout"], VERL["data"], VERL["trainer"])
    assert parsed.model.loss_fn == converted.loss and parsed.model.loss_fn.rejection
    assert parsed.model.engine.policy_temperature == 0.9
    assert parsed.datamodule.source.advantage_options == {"std_unbiased": True, "eps": 1e-6}
    # verl's 16 prompts in mini-batches of 8, two epochs: two steps per generation batch, each trained twice
    assert parsed.datamodule.source.generation == dta.GenerationBatches(steps_per_generation=2, epochs=2)


@pytest.mark.parametrize("text, message", [
    ("loss_type: sapo\n", "loss_type='sapo'"),
    ("loss_type: grpo\nbeta: ${oc.env:BETA}\n", "unresolved interpolation"),
    ("- 1\n- 2\n", "no mapping"),
])
def test_refusals_exit_2_with_the_setting(text, message, tmp_path: Path, capsys) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    assert cli.main(["convert", "trl", str(config)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Fix:" in err and "Traceback" not in err
