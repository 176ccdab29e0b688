"""Bad input is refused at the boundary with an error naming the rollout, the field and the fix."""

from __future__ import annotations

import json
import math

import pytest

import lightning_dta as dta
from tests.helpers.models import make_model


def good(**overrides) -> dict:
    record = dict(input_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], advantages=0.5,
                  old_logprobs=[0.0, -1.0, -2.0, -0.5])
    record.update(overrides)
    return record


def expect_error(records: list[dict], field: str, index: int, **limits) -> str:
    rollouts = [dta.Rollout(**r) for r in records]
    with pytest.raises(dta.RolloutError) as info:
        dta.validate_rollouts(rollouts, **limits)
    message = str(info.value)
    assert f"rollout index {index}," in message and f"'{field}'" in message and "Fix:" in message, message
    assert info.value.index == index and info.value.field == field
    return message


@pytest.mark.parametrize("ids", [[], [5]])
def test_too_short(ids):
    expect_error([good(), good(input_ids=ids, loss_mask=None, old_logprobs=None)], "input_ids", 1)


def test_per_token_length_mismatch():
    for field in ("loss_mask", "old_logprobs", "prox_logprobs", "ref_logprobs", "advantages"):
        message = expect_error([good(**{field: [0, 1, 1]})], field, 0)
        assert "3 entries but input_ids has 4" in message


def test_token_ids_out_of_range():
    expect_error([good(), good(), good(input_ids=[1, -2, 3, 4])], "input_ids", 2)
    message = expect_error([good(input_ids=[1, 2, 300, 4])], "input_ids", 0, vocab_size=256)
    assert "300" in message and "256" in message


def test_non_finite_advantages_and_logprobs():
    expect_error([good(advantages=math.nan)], "advantages", 0)
    expect_error([good(advantages=[0.0, 1.0, math.inf, 0.0])], "advantages", 0)
    expect_error([good(old_logprobs=[0.0, -1.0, math.nan, -1.0])], "old_logprobs", 0)
    expect_error([good(ref_logprobs=[0.0, -math.inf, -1.0, -1.0])], "ref_logprobs", 0)
    expect_error([good(prox_logprobs=[0.0, -1.0, 0.7, -1.0])], "prox_logprobs", 0)  # a probability, not log


def test_logprob_entry_zero_is_ignored():
    dta.validate_rollouts([dta.Rollout(**good(old_logprobs=[None, -1.0, -1.0, -1.0]))])


def test_too_long_for_the_model():
    expect_error([good(input_ids=list(range(10)), loss_mask=None, old_logprobs=None)], "input_ids", 0,
                 max_positions=8)


def test_loss_mask_values():
    message = expect_error([good(loss_mask=[0, 1, 2, 1])], "loss_mask", 0)
    assert "only 0 and 1" in message
    expect_error([good(loss_mask=[0, 0.5, 1, 1])], "loss_mask", 0)


def test_tree_backward_checks_the_model_limits():
    model = make_model("llama")
    tree = dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=[1, 2, 3]), dta.Rollout(input_ids=[1, 2, 99])])
    with pytest.raises(dta.RolloutError, match=r"rollout index 1, field 'input_ids'.*vocabulary"):
        dta.tree_backward(model, tree, dta.PolicyLoss())
    tree = dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=[1] * 300)])
    with pytest.raises(dta.RolloutError, match=r"rollout index 0.*maximum positions \(256\)"):
        dta.tree_logprobs(model, tree)


def test_jsonl_round_trip(tmp_path):
    rollouts = [dta.Rollout(**good()), dta.Rollout(input_ids=[7, 8], advantages=[0.0, 1.5], reward=1.0,
                                                   group_id="g1")]
    path = tmp_path / "r.jsonl"
    dta.write_rollouts(path, rollouts)
    assert dta.read_rollouts(path) == rollouts
    assert json.loads(path.read_text().splitlines()[1]) == {"input_ids": [7, 8], "advantages": [0.0, 1.5],
                                                             "reward": 1.0, "group_id": "g1"}


def test_jsonl_errors_name_the_file_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(good()) + "\n\n" + json.dumps(good(advantage=1.0)) + "\n")
    with pytest.raises(dta.RolloutError, match=rf"^{path}:3: rollout index 1, field 'advantage': unknown field"):
        dta.read_rollouts(path)  # the blank line 2 is counted in the line, not in the rollout index
    path.write_text(json.dumps(good()) + "\n{not json\n")
    with pytest.raises(dta.RolloutError, match=rf"^{path}:2: rollout index 1, field '<json>': not valid JSON"):
        dta.read_rollouts(path)
    path.write_text(json.dumps(good(loss_mask=[0, 1])) + "\n")
    with pytest.raises(dta.RolloutError, match=rf"^{path}:1: rollout index 0, field 'loss_mask'"):
        dta.read_rollouts(path)
    path.write_text(json.dumps({"loss_mask": [0, 1]}) + "\n")
    with pytest.raises(dta.RolloutError, match=r"rollout index 0, field 'input_ids': missing"):
        dta.read_rollouts(path)
    path.write_text("")
    with pytest.raises(dta.RolloutError, match="holds no rollouts"):
        dta.read_rollouts(path)


def test_every_fault_of_a_file_in_one_error(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [good(), good(input_ids=[1, -3, 3, 4]), good(), good(loss_mask=[0, 1, 1]), good(input_ids=[1, 2, 300, 4])]
    path.write_text("\n".join(json.dumps(r) for r in lines[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in lines[2:]))
    with pytest.raises(dta.RolloutFaults) as info:
        dta.read_rollouts(path, vocab_size=256)
    message = str(info.value)
    assert message.startswith(f"3 faulty rollouts in {path}:"), message
    assert f"{path}:2: rollout index 1, field 'input_ids': token 1 is -3, outside the vocabulary [0, 256)" in message
    assert f"{path}:5: rollout index 3, field 'loss_mask': has 3 entries but input_ids has 4" in message
    assert f"{path}:6: rollout index 4, field 'input_ids': token 2 is 300, outside the vocabulary [0, 256)" in message
    assert [f.index for f in info.value.faults] == [1, 3, 4] and info.value.field == "input_ids"


def test_many_faults_are_counted_beyond_the_first_twenty(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(good(loss_mask=[2, 1, 1, 1])) + "\n" for _ in range(25)))
    with pytest.raises(dta.RolloutFaults, match=r"25 faulty rollouts") as info:
        dta.read_rollouts(path)
    message = str(info.value)
    assert f"{path}:20:" in message and f"{path}:21:" not in message and message.endswith("... and 5 more")


@pytest.mark.parametrize("group_id", [1.5, [1, 2], True, {"id": 1}])
def test_a_group_id_is_a_string_or_an_int(group_id):
    with pytest.raises(dta.RolloutError, match="field 'group_id': is .*, not a string or an int"):
        dta.validate_rollouts([dta.Rollout(input_ids=[1, 2, 3], group_id=group_id)])
    dta.validate_rollouts([dta.Rollout(input_ids=[1, 2, 3], group_id=g) for g in ("prompt-7", 7)])


@pytest.mark.parametrize("reward", [True, "1", math.inf])
def test_a_reward_is_a_finite_number_not_a_bool(reward):
    with pytest.raises(dta.RolloutError, match="field 'reward': is .*, not a finite number"):
        dta.validate_rollouts([dta.Rollout(input_ids=[1, 2, 3], reward=reward)])


def test_a_utf8_bom_is_skipped_and_a_repeated_key_refused(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"input_ids": [1, 2, 3], "reward": 1.0}\n{"input_ids": [4, 5]}\n')
    assert [r.input_ids for r in dta.read_rollouts(path)] == [[1, 2, 3], [4, 5]]
    path.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5], "reward": 1.0, "reward": 0.0}\n')
    with pytest.raises(dta.RolloutError, match=rf"^{path}:2: rollout index 1, field 'reward': is given twice"):
        dta.read_rollouts(path)


def test_faults_without_a_source_are_not_said_to_be_in_the_rollouts():
    with pytest.raises(dta.RolloutFaults) as info:
        dta.validate_rollouts([dta.Rollout(input_ids=[1]), dta.Rollout(input_ids=[2])])
    assert str(info.value).startswith("2 faulty rollouts:\n"), str(info.value)
