"""``DTAGRPOTrainer`` with a hybrid model (a tiny Qwen3.5: a Gated DeltaNet layer, then attention) against TRL's own
``GRPOTrainer`` (per-rollout training): the same generated batch, one optimizer step, the same gradient per
parameter in float64. Skipped without TRL (``pip install -e ".[trl]"``).

The Gated DeltaNet core runs in float32 even in a float64 model (transformers casts), so both trainers run it in
float64 here (tests/engine/test_hybrid.py's ``float64_recurrent_cores``, autouse in this module); TRL's log-probs
come from an exact float64 forward, as in tests/integrations/test_trl_trainer.py, whose harness this reuses.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[trl]'")

from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

from lightning_dta.integrations.trl import DTAGRPOTrainer  # noqa: E402
from tests.engine.test_hybrid import float64_recurrent_cores  # noqa: E402, F401 - autouse: the cores in float64
from tests.integrations.test_trl_trainer import run  # noqa: E402
from tests.parity.harness import VOCAB, save_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, max_position_embeddings=128, bos_token_id=2, eos_token_id=1, pad_token_id=0))
    return save_model_dir(str(tmp_path_factory.mktemp("trl") / "tiny-qwen3_5"), model.to(torch.float64).eval())


@pytest.mark.parametrize("settings", [dict(loss_type="grpo", gradient_accumulation_steps=2, beta=0.05),
                                      dict(importance_sampling_level="sequence", epsilon=0.05, temperature=0.8)],
                         ids=["grpo-KL-2-micro-batches", "gspo-temperature"])
def test_hybrid_one_step_gradient_equals_grpo_trainers(settings, hybrid_dir, tmp_path):
    _, theirs = run(trl.GRPOTrainer, hybrid_dir, tmp_path, **settings)
    ours_trainer, ours = run(DTAGRPOTrainer, hybrid_dir, tmp_path, **settings)
    assert len(ours) == len(theirs) == 1
    mine, expected = ours[0], theirs[0]
    assert set(mine) == set(expected)
    assert any("linear_attn" in name for name in expected)  # the recurrent layer is trained
    worst = 0.0
    for param, grad in expected.items():
        error = float((mine[param] - grad).norm()) / max(float(grad.norm()), 1e-30)
        worst = max(worst, error)
        assert error < 1e-9, f"{param}: relative gradient error {error:.2e}"
    print(f"worst relative error {worst:.1e}")
    assert ours_trainer.dta_last_step.metrics["compression_ratio"] > 1.0  # the group's prompt is shared
