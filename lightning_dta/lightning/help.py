"""``lightning-dta fit --help``: the project's own options first, one line each; everything with ``--help-all``.

LightningCLI's help is every argument of every class in reach (over 1,300 lines: the Trainer's ~50 options, and
for ``--model.model`` the ~450 ``torch.nn`` module classes it could name), with the project's options in the
middle. The short help lists the settings a run of this package is made of (the module, its loss and engine, the
data module, the Trainer options the configs set), each with the first sentence of its own docstring and its
default, read from the parser so that it cannot drift; ``--help-all`` prints LightningCLI's full help, where
Lightning's own ``Default: "auto"`` of ``--trainer.strategy`` is replaced by this package's default.
"""

from __future__ import annotations

import re
from argparse import SUPPRESS, Action

from jsonargparse import ArgumentParser

DOCS = "docs/lightning.md"
"""where the options of ``fit`` are described at length (from the repository's root)."""
TRAINER = {
    "accelerator": "cpu, gpu or auto (the device found)",
    "devices": "processes (one device each) to train on: a number, a list of device indices, -1 or auto",
    "strategy": "dta (weights replicated on every rank) or dta_fsdp (sharded with FSDP2)",
    "precision": "32-true, bf16-true, bf16-mixed or another of Lightning's precisions",
    "max_steps": "stop after this many optimizer steps (-1: no limit)",
    "max_epochs": "stop after this many epochs",
    "log_every_n_steps": "how often metrics are logged",
    "logger": "where metrics go (a logger's class_path and init_args; false: none)",
    "callbacks": "a list of callbacks (class_path and init_args each)",
    "enable_progress_bar": "the step progress bar",
    "enable_checkpointing": "save checkpoints",
    "default_root_dir": "where logs and checkpoints go when no logger says",
}
"""the Trainer options the configs set, with their meaning (Lightning's own help is long and generic)."""
WIDTH = 44
"""the column the meanings start at."""
LINE = 118
"""the longest line of the short help."""


def first_sentence(text: str | None, room: int) -> str:
    """The meaning of an option: the first sentence of its help, without reST markup, cut to ``room`` characters
    at a word (``...``: the rest is in ``--help-all``)."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", " ".join((text or "").split())).replace("``", "")
    text = re.split(r"(?<!e\.g)(?<!i\.e)\.(?:\s|$)", text, maxsplit=1)[0]
    if len(text) <= room:
        return text
    return text[:room - 4].rsplit(" ", 1)[0].rstrip(",;:(") + " ..."


def _line(option: str, meaning: str | None, default: object = SUPPRESS, required: bool = False) -> str:
    """One option: its name, its meaning and its default, in at most :data:`LINE` characters."""
    shown = " (required)" if required else "" if default is SUPPRESS else f" (default: {_default(default)})"
    return f"  {option:<{WIDTH - 2}}{first_sentence(meaning, LINE - WIDTH - len(shown))}{shown}"


def _default(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict) and "class_path" in value:
        return value["class_path"]
    return str(value)


def _own(action: Action) -> bool:
    """An option of the project's that a person sets: documented, not a group's config loader or a class help."""
    return bool(action.help) and action.help != SUPPRESS and not action.dest.endswith(".help") \
        and type(action).__name__ != "_ActionConfigLoad"


def short_help(parser: ArgumentParser) -> str:
    """``fit``'s help: the project's options, one line each, then where the rest is."""
    actions = {a.dest: a for a in parser._actions}  # argparse keeps no public list of a parser's options
    sections = [("the module (lightning_dta.DTAModule)", lambda d: d.startswith("model.") and not
                 d.startswith(("model.loss.", "model.engine."))),
                ("its loss (lightning_dta.PolicyLoss)", lambda d: d.startswith("model.loss.")),
                ("its engine (lightning_dta.EngineOptions; plan and bench: --engine.*)",
                 lambda d: d.startswith("model.engine.")),
                ("the data (lightning_dta.RolloutDataModule)", lambda d: d.startswith("data."))]
    lines = ["usage: lightning-dta fit --config FILE [--KEY=VALUE ...]", "",
             "Train a causal LM on rollouts walked as a prefix tree (LightningCLI). A YAML config sets the options",
             "below (configs/tiny_cpu.yaml, configs/toy_rl_cpu.yaml); --KEY=VALUE on the command line overrides one.",
             "A mistake is one line with its fix and exit status 2.", "",
             _line("--config FILE", "a YAML config; several are merged in order"),
             _line("--print_config", "print the whole config the options make, and exit"),
             _line("--seed_everything", "the seed of every random generator (true: a random one)",
                   actions["seed_everything"].default),
             _line("--traceback", "print the traceback of bad input too")]
    for title, belongs in sections:
        lines += ["", f"{title}:"]
        lines += [_line(f"--{dest}", action.help, action.default, action.required)
                  for dest, action in actions.items() if belongs(dest) and _own(action)]
    lines += ["", "the Trainer (lightning.pytorch.Trainer), the options the configs set:"]
    lines += [_line(f"--trainer.{name}", meaning, actions[f"trainer.{name}"].default)
              for name, meaning in TRAINER.items() if f"trainer.{name}" in actions]
    lines += ["", "every option (the Trainer's ~50, each class's arguments, the classes a class_path may name):",
              "  lightning-dta fit --help-all", "a class's own options, such as the optimizer's:",
              "  lightning-dta fit --model.optimizer.help torch.optim.AdamW", f"the options at length: {DOCS}"]
    return "\n".join(lines) + "\n"


def fix_lightning_defaults(parser: ArgumentParser) -> None:
    """Drop Lightning's ``Default: "auto"`` from ``--trainer.strategy``'s help: this package's default (``dta``,
    shown by jsonargparse beside it) is the one that applies."""
    for action in parser._actions:
        if action.dest == "trainer.strategy" and action.help:
            action.help = re.sub(r'\s*Default: ``"auto"``\.', "", action.help)
