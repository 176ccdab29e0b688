"""The converters against docs/losses.md: every mapping row converts to what the table says, every refused row
is refused naming its setting, and the converters import none of TRL, verl or AReaL (parity with the installed
packages is tests/parity)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import lightning_dta as dta
from lightning_dta.core.conversions import ConversionError, Converted

DOC = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
BASES = {"trl": {}, "verl": {"algorithm.adv_estimator": "grpo", "rollout.n": 8}, "areal": {"kl_ctl": 0}}
HEADINGS = {"### TRL `GRPOConfig`": "trl", "### verl": "verl", "### AReaL `PPOActorConfig`": "areal"}


def flow(cell: str) -> dict:
    """A table cell's YAML flow mapping (inside backticks)."""
    return yaml.safe_load(re.fullmatch(r"`(\{.*\})`", cell.strip()).group(1))


def nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def convert(framework: str, settings: dict) -> Converted:
    config = nested({**BASES[framework], **settings})
    if framework == "trl":
        return dta.PolicyLoss.from_trl(config)
    if framework == "verl":
        return dta.PolicyLoss.from_verl(config.get("actor", {}), config.get("algorithm", {}), config.get("rollout"),
                                        config.get("data"), config.get("trainer"))
    return dta.PolicyLoss.from_areal(config)


def rows(table_heading: str) -> list[list[str]]:
    text = DOC.read_text()
    section = text[text.index(table_heading):]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return table


MAPPING = [(framework, row) for heading, framework in HEADINGS.items() for row in rows(heading)]
REFUSED = rows("### Refused settings")


def plain(value):
    if dataclasses.is_dataclass(value):
        return {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


@pytest.mark.parametrize("framework, row", MAPPING, ids=[f"{f}: {r[0]}" for f, r in MAPPING])
def test_every_mapping_row_is_what_the_converter_gives(framework, row):
    converted = convert(framework, flow(row[0]))
    for key, expected in flow(row[1]).items():
        if key == "advantage_estimator":
            assert converted.advantage_estimator == expected
        elif key in ("advantage_options", "engine", "critic", "generation"):
            got = getattr(converted, key) or {}  # the Converted's own four dict fields
            assert {k: got.get(k) for k in expected} == expected, (key, got)
        elif key == "rejection":
            assert plain(converted.loss.rejection) == expected
        else:
            assert getattr(converted.loss, key) == expected, (key, getattr(converted.loss, key))


def test_the_tables_cover_every_converter():
    assert {f for f, _ in MAPPING} == {"trl", "verl", "areal"} and len(MAPPING) > 40
    assert {r[0] for r in REFUSED} == {"trl", "verl", "areal"} and len(REFUSED) > 40


@pytest.mark.parametrize("row", REFUSED, ids=[f"{r[0]}: {r[2]}" for r in REFUSED])
def test_every_refused_row_is_refused_with_its_setting(row):
    framework, settings, refused = row[0], flow(row[1]), row[2].strip("`")
    with pytest.raises(ConversionError) as caught:
        convert(framework, settings)
    assert caught.value.setting == refused, str(caught.value)
    assert refused in str(caught.value) and "Fix:" in str(caught.value)


def test_converters_import_none_of_the_packages():
    package = Path(dta.__file__).parent / "core" / "conversions"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in ("trl", "verl", "areal"), f"{path.name} imports {name}"


def test_a_config_object_is_read_by_attribute():
    """Their config objects (dataclasses) convert like their mappings."""
    @dataclasses.dataclass
    class FakeGRPOConfig:
        loss_type: str = "grpo"
        beta: float = 0.04
        use_bias_correction_kl: bool = False

    assert convert("trl", {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False}).loss == \
        dta.PolicyLoss.from_trl(FakeGRPOConfig()).loss


def test_to_config_gives_a_fit_fragment():
    fragment = dta.PolicyLoss.from_verl({"loss_agg_mode": "seq-mean-token-mean"},
                                        {"adv_estimator": "grpo"}, {"n": 8, "temperature": 0.6}).to_config()
    assert fragment["model"]["loss"]["agg"] == "seq-mean-token-mean"
    assert fragment["model"]["engine"] == {"policy_temperature": 0.6}
    assert fragment["data"] == {"advantage_estimator": "grpo",
                                "advantage_options": {"std_unbiased": True, "eps": 1e-6},
                                # verl's defaults: data.train_batch_size 1024 / actor.ppo_mini_batch_size 256
                                "generation": {"steps_per_generation": 4, "epochs": 1, "split": "groups"}}
    assert dta.PolicyLoss(**fragment["model"]["loss"]) == dta.PolicyLoss.from_verl(
        {"loss_agg_mode": "seq-mean-token-mean"}, {"adv_estimator": "grpo"}, {"n": 8}).loss


@pytest.mark.parametrize("framework, settings, expected", [
    ("trl", {}, None),
    ("trl", {"loss_type": "grpo", "steps_per_generation": 8, "gradient_accumulation_steps": 2},
     {"steps_per_generation": 4, "epochs": 1, "split": "shuffled"}),
    ("trl", {"num_iterations": 3}, {"steps_per_generation": 1, "epochs": 3, "split": "shuffled"}),
    ("verl", {"data.train_batch_size": 12, "actor.ppo_mini_batch_size": 12}, None),
    ("verl", {"data.train_batch_size": 12, "actor.ppo_mini_batch_size": 6, "actor.ppo_epochs": 2},
     {"steps_per_generation": 2, "epochs": 2, "split": "groups"}),
    ("verl", {"data.train_batch_size": 12, "actor.ppo_mini_batch_size": 12, "actor.ppo_epochs": 2,
              "actor.shuffle": True}, {"steps_per_generation": 1, "epochs": 2, "split": "groups"}),
    ("areal", {"ppo_n_minibatches": 1}, None),
    ("areal", {}, {"steps_per_generation": 4, "epochs": 1, "split": "groups"}),
])
def test_mini_batches_and_epochs_are_generation_batches(framework, settings, expected):
    """Their mini-batches and PPO epochs as our generation batches (one per their batch: the advantages over all of
    it), in ``to_config`` as ``data.generation``; one step and one pass set nothing."""
    converted = convert(framework, settings)
    assert converted.generation == expected
    assert converted.to_config()["data"].get("generation") == expected
    if expected is not None:
        dta.GenerationBatches(**expected)  # valid fields
        assert any(note.startswith("generation:") for note in converted.notes)
