"""The tensor-parallel plan translation and every refusal, on one process (``lightning_dta.distributed.
tensor_parallel``: only ``tp_plan`` / ``translate`` / ``tensor_parallel``'s checks, no walk).

What is proved: the model's own transformers plan becomes one torch style per concrete module path with the
placements the walk relies on (q/k/v/gate/up column-parallel with local outputs, o/down row-parallel, the head
gathered, the embedding vocabulary-parallel); Qwen3's per-head norms get the per-backward gradient sum and no
torch style; and each layout the translation cannot run exactly is refused with the module, the reason and a fix.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_dta.distributed.tensor_parallel as TP
from lightning_dta.distributed.step import gradient_norm
from tests.helpers.models import make_model
from tests.helpers.tp import critic_from

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, vocab_size=48)
LAYER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj"]


def test_llama_plan_expanded_per_layer() -> None:
    model = make_model("llama")
    plan = TP.tp_plan(model, 2)
    layer = {k.split("model.layers.0.", 1)[1]: v for k, v in plan.items() if k.startswith("model.layers.0.")}
    assert sorted(layer) == sorted(LAYER)
    assert len(plan) == 2 * 7 + 2 and not any("*" in k for k in plan)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        style = layer[name]  # this rank's heads / columns, as a local tensor (the attention reshapes by head_dim)
        assert type(style) is ColwiseParallel and style.output_layouts == (Shard(-1),) and style.use_local_output
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert type(layer[name]) is RowwiseParallel and layer[name].input_layouts == (Shard(-1),)
        assert layer[name].output_layouts == (Replicate(),)
    head, embed = plan["lm_head"], plan["model.embed_tokens"]
    assert type(head) is ColwiseParallel and head.output_layouts == (Replicate(),)  # colwise_gather_output
    assert type(embed) is RowwiseParallel and embed.input_layouts == (Replicate(),)  # embedding_rowwise
    assert set(TP.tp_plan(model, 2, vocab_parallel=False)) == set(plan) - {"lm_head", "model.embed_tokens"}


def test_qwen3_norms_get_the_gradient_sum() -> None:
    plan = TP.translate(make_model("qwen3"), 2)
    assert sorted(plan.partial_gradients) == sorted(f"model.layers.{i}.self_attn.{n}" for i in (0, 1)
                                                    for n in ("q_norm", "k_norm"))
    assert not any("norm" in k for k in plan.styles)  # no torch style: a per-backward hook instead
    assert plan.source["model.layers.1.self_attn.k_norm"] == "replicated_with_grad_allreduce"


def test_the_critic_head_stays_replicated() -> None:
    plan = TP.tp_plan(critic_from(make_model("llama")), 2)
    assert "lm_head" not in plan and "model.embed_tokens" in plan  # a scalar head cannot split by vocabulary


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2kv"])
def test_more_families_translate(family: str) -> None:
    plan = TP.tp_plan(make_model(family), 2)
    assert len(plan) == 2 * 7 + 2


def test_every_transformers_style_is_translated_or_refused() -> None:
    """A style transformers registers but the table does not know would be refused as 'unknown' with a wrong fix."""
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    assert set(ALL_PARALLEL_STYLES) <= set(TP.STYLES), sorted(set(ALL_PARALLEL_STYLES) - set(TP.STYLES))


def test_heads_not_divisible_by_the_size() -> None:
    with pytest.raises(TP.TensorParallelError, match=r"num_key_value_heads=1 is not divisible.*Fix: a tensor"):
        TP.tp_plan(make_model("gemma"), 2)  # the helpers' Gemma: one key/value head
    with pytest.raises(TP.TensorParallelError, match="num_attention_heads=4 is not divisible"):
        TP.tp_plan(make_model("llama"), 8)


def test_hybrid_plans_keep_the_recurrent_mixers_whole() -> None:
    """Qwen3.5's own plan: attention split by heads, every Gated DeltaNet projection split with its output gathered
    (the mixer, its convolution window and scan state whole on every rank); its mixer's own per-head parameters
    (A_log, dt_bias) and its convolution get no style (replicated)."""
    model = make_model("qwen3_5")
    plan = TP.translate(model, 2)
    mixer = "model.layers.0.linear_attn"
    for leaf in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"):
        style = plan.styles[f"{mixer}.{leaf}"]
        assert isinstance(style, ColwiseParallel) and style.output_layouts == (Replicate(),), leaf
    assert f"{mixer}.conv1d" not in plan.styles
    assert isinstance(plan.styles["model.layers.1.self_attn.q_proj"], ColwiseParallel)
    assert plan.styles["model.layers.1.self_attn.q_proj"].output_layouts == (Shard(-1),)
    assert isinstance(plan.styles["model.layers.1.self_attn.o_proj"], RowwiseParallel)


@pytest.mark.parametrize("family,projection,style", [
    ("qwen3_5", "model.layers.0.linear_attn.in_proj_qkv", "colwise"),
    ("qwen3_5", "model.layers.0.linear_attn.out_proj", "rowwise"),
    ("lfm2", "model.layers.0.conv.in_proj", "colwise"),
])
def test_recurrent_mixers_are_not_split_by_heads(family: str, projection: str, style: str) -> None:
    """A head split of a recurrent mixer is refused with the reason (fused projections that do not split into
    contiguous per-head shards) and the fix (the projection gathered, as transformers' plan does), before any
    sharding. Without the refusal Qwen3.5's mixer would split 32 local features by its whole sizes [16, 16, 32]."""
    pair = {"colwise": "rowwise", "rowwise": "colwise"}[style]
    other = projection.rsplit(".", 1)[0] + (".out_proj" if style == "colwise" else
                                             (".in_proj_qkv" if family == "qwen3_5" else ".in_proj"))
    with pytest.raises(TP.TensorParallelError, match=r"recurrent mixer model\.layers\.0\.\w+ .*cannot be split by "
                                                     r"heads.*Fix: keep the projection whole per rank"):
        TP.translate(make_model(family), 2, plan_overrides={projection: style, other: pair})


def test_a_model_without_a_plan() -> None:
    with pytest.raises(TP.TensorParallelError, match="declares no tensor-parallel plan.*Fix: pass plan_overrides"):
        TP.tp_plan(make_model("gpt2"), 2)


def test_a_per_head_parameter_of_attention_itself() -> None:
    with pytest.raises(TP.TensorParallelError, match=r"self_attn holds parameters \['A'\].*Fix:"):
        TP.tp_plan(make_model("doge"), 2)


def test_a_fused_qkv_projection() -> None:
    from transformers import Phi3Config, Phi3ForCausalLM

    model = Phi3ForCausalLM(Phi3Config(**SMALL, pad_token_id=0))
    with pytest.raises(TP.TensorParallelError, match="qkv_proj .*fused projection.*Fix:"):
        TP.tp_plan(model, 2)


def test_mixture_of_experts() -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, moe_intermediate_size=16, num_experts=4,
                                               num_experts_per_tok=2, head_dim=8))
    with pytest.raises(TP.TensorParallelError, match="(packed_colwise|moe_tp_experts).*Fix:"):
        TP.tp_plan(model, 2)


def test_gathered_attention_is_expressible() -> None:
    """OLMo2 normalises the whole q/k projection: its plan gathers q/k/v and splits o's input locally."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    plan = TP.translate(Olmo2ForCausalLM(Olmo2Config(**SMALL)), 2)
    q, o = plan.styles["model.layers.0.self_attn.q_proj"], plan.styles["model.layers.0.self_attn.o_proj"]
    assert q.output_layouts == (Replicate(),) and o.input_layouts == (Replicate(),)
    assert plan.source["model.layers.0.self_attn.q_proj"] == "colwise_gather_output"


REFUSED = sorted(name for name, spec in TP.STYLES.items() if isinstance(spec, str))


@pytest.mark.parametrize("style", [*REFUSED, "local_colwise", "no_such_style"])
def test_refused_styles(style: str) -> None:
    match = {"local_colwise": "earlier transformers release", "no_such_style": "unknown style"}.get(
        style, f"{style}' .*is refused: .*Fix:")
    with pytest.raises(TP.TensorParallelError, match=match):
        TP.tp_plan(make_model("llama"), 2, plan_overrides={"model.layers.*.input_layernorm": style})


def test_a_style_on_the_wrong_kind_of_module() -> None:
    with pytest.raises(TP.TensorParallelError, match=r"input_layernorm is a LlamaRMSNorm, but style 'colwise'.*Fix"):
        TP.tp_plan(make_model("llama"), 2, plan_overrides={"model.layers.*.input_layernorm": "colwise"})


def test_an_unpaired_column_shard() -> None:
    with pytest.raises(TP.TensorParallelError, match="must meet a row-parallel projection.*Fix:"):
        TP.tp_plan(make_model("llama"), 2, plan_overrides={"model.layers.*.self_attn.o_proj": "replicate"})


def test_an_undeclared_module_beside_split_heads() -> None:
    model = make_model("qwen3")
    model._tp_plan = {k: v for k, v in model._tp_plan.items() if "norm" not in k}
    with pytest.raises(TP.TensorParallelError, match=r"self_attn.q_norm \(Qwen3RMSNorm\) holds parameters.*Fix:"):
        TP.tp_plan(model, 2)


def test_uneven_shards() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "vocab_size": 49}))
    with pytest.raises(TP.TensorParallelError, match="49 (output features|vocabulary entries).*vocab_parallel=False"):
        TP.tp_plan(model, 2)
    assert TP.tp_plan(model, 2, vocab_parallel=False)
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "intermediate_size": 63}))
    with pytest.raises(TP.TensorParallelError, match="gate_proj .*63 output features.*Fix: a tensor-parallel size"):
        TP.tp_plan(model, 2)


def test_tied_embeddings_need_one_placement() -> None:
    model = make_model("gemma2kv")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head" in TP.tp_plan(model, 2)
    with pytest.raises(TP.TensorParallelError, match="share one weight.*Fix:"):
        TP.tp_plan(model, 2, plan_overrides={"model.embed_tokens": "replicate"})


def test_a_parameter_level_entry() -> None:
    with pytest.raises(TP.TensorParallelError, match="names a parameter.*Fix:"):
        TP.tp_plan(make_model("llama"), 2, plan_overrides={"model.layers.*.mlp.down_proj.weight": "rowwise"})


def test_a_plan_that_matches_no_module() -> None:
    """PEFT wraps the model: the plan's paths (``model.layers.*``) no longer name its modules."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(TP.TensorParallelError, match="matched no module to shard.*Fix:"):
        TP.tp_plan(model, 2)


def test_the_plan_from_the_config_when_the_instance_has_none() -> None:
    model = make_model("llama")
    expected = TP.model_plan(model)
    model._tp_plan = None
    assert TP.model_plan(model) == expected


def test_the_gradient_sum_only_where_heads_are_split() -> None:
    """Gathered q/k/v: the norms see every head; summing their gradient would count it twice."""
    gathered = {f"model.layers.*.self_attn.{p}_proj": "colwise_gather_output" for p in "qkv"}
    gathered["model.layers.*.self_attn.o_proj"] = "rowwise_split_input"
    with pytest.raises(TP.TensorParallelError, match="q_norm is 'replicated_with_grad_allreduce', but no projection"):
        TP.tp_plan(make_model("qwen3"), 2, plan_overrides=gathered)
    norms = {f"model.layers.*.self_attn.{n}": "replicate" for n in ("q_norm", "k_norm")}
    assert not TP.translate(make_model("qwen3"), 2, plan_overrides={**gathered, **norms}).partial_gradients


def test_the_mesh_must_be_the_named_tensor_parallel_dimension() -> None:
    """Checked before anything is sharded (the mesh is only asked its names)."""

    class FakeMesh:
        ndim, mesh_dim_names = 1, ("dp",)

        def size(self) -> int:
            return 2

    with pytest.raises(TP.TensorParallelError, match="1-D mesh named 'tensor_parallel'.*Fix:"):
        TP.tensor_parallel(make_model("llama"), FakeMesh())


def test_a_model_parallelized_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a one-rank group (the conftest fixture tears it down): the second call finds DTensor weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers.tp import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",))
    model = TP.tensor_parallel(make_model("llama"), mesh)
    with pytest.raises(TP.TensorParallelError, match="DTensors already.*Fix: call tensor_parallel once"):
        TP.tensor_parallel(model, mesh)


def test_gradient_norm_of_plain_float64_gradients() -> None:
    """The step's norm keeps float64 (vector_norm refuses to narrow to float32) and equals torch's."""
    model = make_model("llama")
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert gradient_norm(model.parameters()) == pytest.approx(float(expected), rel=1e-12)
