"""Rollouts: the unit of RL training data, their JSONL form, and validation at the boundary.

A rollout is one token sequence the policy produced (prompt, turns, response) plus the per-token data the
loss needs. Validation happens here, before any tree is built, so that a bad file fails with an error that
names the rollout and the field instead of training on something different from what was asked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from lightning_dta.core.errors import UsageError

PER_TOKEN_FIELDS = ("loss_mask", "old_logprobs", "prox_logprobs", "ref_logprobs", "returns", "old_values")
LOGPROB_FIELDS = ("old_logprobs", "prox_logprobs", "ref_logprobs")
VALUE_FIELDS = ("returns", "old_values")  # per token, index 0 ignored, any finite number


MAX_REPORTED = 20  # faults listed in one error; the rest are counted


class RolloutError(UsageError, ValueError):
    """A rollout is malformed. The message names where it is (``PATH:LINE`` for a file), the rollout index, the
    field, the value and the fix."""

    def __init__(self, index: int | None, field: str, problem: str, fix: str, location: str | None = None) -> None:
        self.index, self.field, self.problem, self.fix, self.location = index, field, problem, fix, location
        super().__init__(self.describe())

    def located(self, location: str | None) -> RolloutError:
        """The same fault, reported at ``location`` (``PATH:LINE``)."""
        return RolloutError(self.index, self.field, self.problem, self.fix, location)

    def describe(self) -> str:
        # "index", counted from 0 as the list of rollouts is: beside a file's line (counted from 1) a bare number
        # would read as another count of the same thing
        where = f"rollout index {self.index}" if self.index is not None else "rollout"
        at = f"{self.location}: " if self.location else ""
        return f"{at}{where}, field '{self.field}': {self.problem}. Fix: {self.fix}"


class RolloutFaults(RolloutError):
    """Several malformed rollouts, reported together (the first :data:`MAX_REPORTED`, then a count)."""

    def __init__(self, faults: Sequence[RolloutError], source: str | None = None) -> None:
        first = faults[0]
        self.faults = list(faults)
        self.index, self.field, self.problem, self.fix, self.location = (first.index, first.field, first.problem,
                                                                         first.fix, first.location)
        shown = "\n".join(f"  {fault.describe()}" for fault in faults[:MAX_REPORTED])
        rest = f"\n  ... and {len(faults) - MAX_REPORTED} more" if len(faults) > MAX_REPORTED else ""
        where = f" in {source}" if source else ""
        ValueError.__init__(self, f"{len(faults)} faulty rollouts{where}:\n{shown}{rest}")


def raise_faults(faults: Sequence[RolloutError], source: str | None = None) -> None:
    """Raise the one fault as it is, several as one :class:`RolloutFaults`; nothing if there are none."""
    if len(faults) == 1:
        raise faults[0]
    if faults:
        raise RolloutFaults(faults, source)


@dataclass
class Rollout:
    """One sequence to train on.

    Attributes:
        input_ids: the whole token sequence (prompt, turns, responses).
        loss_mask: 1 where the token's log-prob is trained, 0 elsewhere; ``None`` trains every token but
            the first (which has no context to be predicted from).
        advantages: one float for the whole rollout, or one value per token.
        old_logprobs: behaviour-policy log-prob of each token (index 0 ignored); ``None`` means on-policy.
        prox_logprobs: proximal-policy log-probs for decoupled PPO (index 0 ignored).
        ref_logprobs: reference-policy log-probs for the KL penalty (index 0 ignored).
        reward: scalar reward, used by advantage estimators.
        group_id: rollouts with the same id form a group (GRPO).
        returns: the critic's regression target of each token (index 0 ignored), e.g. from GAE.
        old_values: the critic's values when the rollout was generated (index 0 ignored): GAE's baseline and the
            value clip's anchor; ``PPOCritic`` keeps them when given and fills them when not.
    """

    input_ids: list[int]
    loss_mask: list[int] | None = None
    advantages: float | list[float] = 0.0
    old_logprobs: list[float] | None = None
    prox_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    reward: float | None = None
    group_id: str | int | None = None
    returns: list[float] | None = None
    old_values: list[float] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def mask(self) -> list[int]:
        """The effective loss mask (the default trains every token but the first)."""
        if self.loss_mask is None:
            return [0] + [1] * (len(self.input_ids) - 1)
        return [int(m) for m in self.loss_mask]

    def to_dict(self) -> dict:
        """A JSON-ready dict with the contract's field names; ``None`` fields are left out."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, data: dict, index: int | None = None) -> Rollout:
        """Build a rollout from a dict, refusing unknown fields (a typo must not be silently dropped)."""
        if not isinstance(data, dict):
            raise RolloutError(index, "<record>", f"expected a JSON object, got {type(data).__name__}",
                               "write one JSON object per line")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RolloutError(index, unknown[0], f"unknown field(s) {unknown}",
                               f"use only the fields {sorted(known)}")
        if "input_ids" not in data:
            raise RolloutError(index, "input_ids", "missing", "give the rollout's token ids")
        return cls(**data)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number_list(index: int, name: str, values: object, length: int) -> None:
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise RolloutError(index, name, f"expected a list of {length} numbers, got {type(values).__name__}",
                           "give one value per token of input_ids")
    if len(values) != length:
        raise RolloutError(index, name, f"has {len(values)} entries but input_ids has {length}",
                           "give exactly one value per token of input_ids")


def validate_rollout(rollout: Rollout, index: int, vocab_size: int | None = None,
                     max_positions: int | None = None) -> None:
    """Raise :class:`RolloutError` if ``rollout`` cannot be trained on exactly as given."""
    ids = rollout.input_ids
    if not isinstance(ids, Sequence) or isinstance(ids, str):
        raise RolloutError(index, "input_ids", f"expected a list of token ids, got {type(ids).__name__}",
                           "give the tokenized sequence as a list of ints")
    if len(ids) < 2:
        raise RolloutError(index, "input_ids", f"has {len(ids)} token(s); at least 2 are needed",
                           "drop the rollout explicitly before training, or include its prompt")
    for pos, tok in enumerate(ids):
        if not _is_int(tok):
            raise RolloutError(index, "input_ids", f"token {pos} is {tok!r}, not an int", "tokenize to integer ids")
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab_size)"
            raise RolloutError(index, "input_ids", f"token {pos} is {tok}, outside the vocabulary {bound}",
                               "use the tokenizer that matches the model")
    if max_positions is not None and len(ids) > max_positions:
        raise RolloutError(index, "input_ids", f"has {len(ids)} tokens, more than the model's maximum positions "
                           f"({max_positions})", "truncate the rollout or use a model with a longer context")
    n = len(ids)
    if rollout.loss_mask is not None:
        _check_number_list(index, "loss_mask", rollout.loss_mask, n)
        for pos, m in enumerate(rollout.loss_mask):
            if m not in (0, 1):
                raise RolloutError(index, "loss_mask", f"entry {pos} is {m!r}; only 0 and 1 are allowed",
                                   "use 1 for trained tokens and 0 for the rest")
    adv = rollout.advantages
    if isinstance(adv, Sequence) and not isinstance(adv, str):
        _check_number_list(index, "advantages", adv, n)
        values = adv
    else:
        values = [adv]
    for pos, a in enumerate(values):
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a):
            raise RolloutError(index, "advantages", f"value {pos} is {a!r}, not a finite number",
                               "check the reward and advantage computation for NaN/inf")
    for name in LOGPROB_FIELDS:
        lp = getattr(rollout, name)
        if lp is None:
            continue
        _check_number_list(index, name, lp, n)
        for pos in range(1, n):  # index 0 is never used: token 0 has no context
            value = lp[pos]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise RolloutError(index, name, f"entry {pos} is {value!r}, not a finite number",
                                   "recompute the log-probs; entry 0 may be anything, the rest must be finite")
            if value > 1e-4:
                raise RolloutError(index, name, f"entry {pos} is {value}, a log-probability must be <= 0",
                                   "pass log-probs, not probabilities or logits")
    for name in VALUE_FIELDS:
        values = getattr(rollout, name)
        if values is None:
            continue
        _check_number_list(index, name, values, n)
        for pos in range(1, n):
            value = values[pos]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise RolloutError(index, name, f"entry {pos} is {value!r}, not a finite number",
                                   "entry 0 may be anything, the rest must be finite")
    reward = rollout.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise RolloutError(index, "reward", f"is {reward!r}, not a finite number", "check the reward function")
    group = rollout.group_id
    if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int))):
        raise RolloutError(index, "group_id", f"is {group!r}, not a string or an int",
                           "use the prompt's id (a string or an integer) as group_id")


def validate_rollouts(rollouts: Sequence[Rollout], vocab_size: int | None = None,
                      max_positions: int | None = None, locations: Sequence[str] | None = None,
                      source: str | None = None) -> None:
    """Validate every rollout and raise one :class:`RolloutError` naming every faulty one (its first fault each).

    ``locations`` (one per rollout, e.g. ``PATH:LINE``) prefix the faults; ``source`` names the whole.
    """
    if len(rollouts) == 0:
        raise RolloutError(None, "<rollouts>", "no rollouts were given", "pass at least one rollout")
    faults = []
    for index, rollout in enumerate(rollouts):
        try:
            if not isinstance(rollout, Rollout):
                raise RolloutError(index, "<record>", f"expected a Rollout, got {type(rollout).__name__}",
                                   "wrap each record with lightning_dta.Rollout(...) or Rollout.from_dict")
            validate_rollout(rollout, index, vocab_size, max_positions)
        except RolloutError as fault:
            location = locations[index] if locations is not None else None
            faults.append(fault.located(location))
    raise_faults(faults, source)


class _RepeatedKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's dict, refusing a key given twice (``json`` would silently keep the last value)."""
    record: dict = {}
    for key, value in pairs:
        if key in record:
            raise _RepeatedKey(key)
        record[key] = value
    return record


def read_rollout_lines(path: str | Path, vocab_size: int | None = None,
                       max_positions: int | None = None) -> tuple[list[Rollout], list[int]]:
    """Read a JSONL file (one rollout object per line) and validate it; returns the rollouts and their line numbers.

    Blank lines hold no rollout and are skipped, but counted: line numbers are the file's (1-based), and the
    rollout index counts rollouts. Every faulty line is reported in one :class:`RolloutError` as ``PATH:LINE``. A
    UTF-8 byte-order mark at the start of the file is skipped; a key given twice in one object is refused.
    """
    rollouts, lines, faults = [], [], []
    with open(path, encoding="utf-8-sig") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            index, location = len(rollouts) + len(faults), f"{path}:{line_number}"
            try:
                try:
                    record = json.loads(line, object_pairs_hook=_unique_keys)
                except json.JSONDecodeError as error:
                    raise RolloutError(index, "<json>", f"not valid JSON ({error.msg}, column {error.colno})",
                                       "write one JSON object per line") from error
                except _RepeatedKey as repeated:
                    raise RolloutError(index, repeated.key, "is given twice in the line's object (JSON keeps only the "
                                       "last value)", "write each field once") from None
                rollout = Rollout.from_dict(record, index)
                validate_rollout(rollout, index, vocab_size, max_positions)
            except RolloutError as fault:
                faults.append(fault.located(location))
                continue
            rollouts.append(rollout)
            lines.append(line_number)
    raise_faults(faults, str(path))
    if not rollouts:
        raise RolloutError(None, "<file>", f"{path} holds no rollouts", "point at a non-empty JSONL file")
    return rollouts, lines


def read_rollouts(path: str | Path, vocab_size: int | None = None, max_positions: int | None = None) -> list[Rollout]:
    """Read and validate a JSONL rollout file (see :func:`read_rollout_lines`)."""
    return read_rollout_lines(path, vocab_size, max_positions)[0]


def write_rollouts(path: str | Path, rollouts: Iterable[Rollout]) -> None:
    """Write rollouts as JSONL, one object per line, with the contract's field names."""
    with open(path, "w", encoding="utf-8") as handle:
        for rollout in rollouts:
            handle.write(json.dumps(rollout.to_dict(), allow_nan=False) + "\n")
