"""Other trainers' settings as ours, by code: TRL's ``GRPOConfig``, verl's actor and algorithm configs, AReaL's
``PPOActorConfig``, each turned into a :class:`~lightning_dta.PolicyLoss`, the advantage settings and the engine's
temperature (a :class:`Converted`), or refused.

A converter never approximates in silence: a setting it cannot express exactly raises :class:`ConversionError`
naming the setting, why, and the nearest supported alternative. What is the same up to a numerical guard of theirs
(a clamp at ``exp(20)``, a float32 weight) is said in ``Converted.notes``. The converters read plain mappings or
the packages' own config objects by attribute and import none of them (``trl``, ``verl``, ``areal`` need not be
installed). The mapping tables and the refused settings are in ``docs/losses.md``; tests walk both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_dta.core.errors import UsageError
from lightning_dta.core.losses import PolicyLoss


class ConversionError(UsageError, ValueError):
    """A setting the converter cannot express: ``setting`` (its name in their config), ``value``, ``reason`` and
    ``nearest`` (the closest setting that converts)."""

    def __init__(self, source: str, setting: str, value: Any, reason: str, nearest: str) -> None:
        self.source, self.setting, self.value, self.reason, self.nearest = source, setting, value, reason, nearest
        super().__init__(f"{source} {setting}={value!r} has no exact equivalent here: {reason}. "
                         f"Fix: {nearest}")


@dataclass(frozen=True)
class Converted:
    """What a converter returns.

    Attributes:
        loss: the :class:`~lightning_dta.PolicyLoss` of their settings.
        advantage_estimator: the name in ``ADVANTAGE_ESTIMATORS`` (``"gae"``: a ``PPOCritic`` estimates them, with
            ``critic``), or ``None`` (the rollouts carry their own advantages).
        advantage_options: the estimator's keyword arguments (``RolloutDataModule(advantage_options=...)``,
            ``estimate_advantages(rollouts, name, options)``).
        engine: :class:`~lightning_dta.EngineOptions` fields their settings fix (the policy's temperature).
        critic: ``PPOCritic`` keyword arguments (``gamma``, ``lam``, ``whiten``) when GAE estimates the advantages.
        rollout_fields: which of their per-token tensors goes into which ``Rollout`` field.
        generation: :class:`~lightning_dta.core.generation.GenerationBatches` fields (``steps_per_generation``,
            ``epochs``, ``split``) for their mini-batches and PPO epochs: the optimizer steps one generation batch
            feeds, its advantages estimated once over all of it as theirs are; ``None``: one step per batch.
        notes: what is the same only up to their numerical guards, or lies on the data side.
    """

    loss: PolicyLoss
    advantage_estimator: str | None = None
    advantage_options: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    critic: dict[str, Any] | None = None
    rollout_fields: dict[str, str] = field(default_factory=dict)
    generation: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()

    def to_config(self) -> dict[str, Any]:
        """The settings as a LightningCLI config fragment (``model.loss``, ``model.engine``, ``model.critic``,
        ``data.advantage_estimator`` / ``advantage_options`` / ``generation``), only what differs from our defaults.
        ``data.generation`` is the file and iterable sources' place; the online source takes the same mapping as
        ``data.source.init_args.generation``."""
        loss = {f.name: _plain(getattr(self.loss, f.name)) for f in dataclasses.fields(self.loss)  # our dataclass
                if getattr(self.loss, f.name) != f.default}  # our dataclass's own fields
        model: dict[str, Any] = {"loss": loss}
        if self.engine:
            model["engine"] = dict(self.engine)
        if self.critic is not None:
            model["critic"] = dict(self.critic)
        data: dict[str, Any] = {"advantage_estimator": self.advantage_estimator}
        if self.advantage_options:
            data["advantage_options"] = dict(self.advantage_options)
        if self.generation is not None:
            data["generation"] = dict(self.generation)
        return {"model": model, "data": data}


def generation(steps_per_generation: int, epochs: int, split: str) -> dict[str, Any] | None:
    """Their mini-batches per generation batch and passes over it as our ``generation`` fields; ``None`` for one
    step and one pass (our default, nothing to set)."""
    if steps_per_generation == 1 and epochs == 1:
        return None
    return {"steps_per_generation": steps_per_generation, "epochs": epochs, "split": split}


def _plain(value: Any) -> Any:
    """Dataclasses (rejection rules) and tuples as plain YAML data."""
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}  # our dataclass's own fields
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


class Settings:
    """One section of their config, given as a mapping (missing keys take their package's ``defaults``) or as
    their own config object (read by attribute)."""

    def __init__(self, source: str, config: Any, defaults: Mapping[str, Any], prefix: str = "") -> None:
        self.source, self.config, self.defaults, self.prefix = source, config, defaults, prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def get(self, key: str) -> Any:
        """The setting ``key``: given, else their default."""
        if self.config is None:
            return self.defaults.get(key)
        if isinstance(self.config, Mapping):
            return self.config.get(key, self.defaults.get(key))
        # their config object (GRPOConfig, ActorConfig, PPOActorConfig): a user object read by attribute
        return getattr(self.config, key, self.defaults.get(key))

    def section(self, key: str, defaults: Mapping[str, Any]) -> Settings:
        """A nested section (``policy_loss``, ``rollout_correction``, ``adv_norm``); ``None`` stays ``None``."""
        return Settings(self.source, self.get(key), defaults, prefix=f"{self.name(key)}.")

    @property
    def given(self) -> bool:
        return self.config is not None

    def count(self, key: str, what: str) -> int:
        """The setting ``key``, which counts ``what``, as a whole number >= 1."""
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.refuse(key, f"it counts {what}", "a whole number >= 1")
        return value

    def refuse(self, key: str, reason: str, nearest: str) -> ConversionError:
        return ConversionError(self.source, self.name(key), self.get(key), reason, nearest)
