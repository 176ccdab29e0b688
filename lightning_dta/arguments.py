"""A command line the parser refuses, as one line: what, where and the fix.

jsonargparse (and argparse) answer a wrong key, a value outside a choice or a missing file with the whole usage
(over a hundred lines for ``fit``) and then the error. Every verb's parser is built with ``exit_on_error=False``
instead, and its refusal becomes a :class:`~lightning_dta.core.errors.ConfigError` here, which ``lightning-dta``
prints as one line and exit status 2 (:mod:`lightning_dta.cli`); the usage is shown only by ``--help``. The fix
is the nearest valid key ("did you mean --model.loss.clip_eps?") or the allowed values, written the way the user
wrote the setting: ``--key`` on the command line, ``key`` in a YAML file. For the same reason the engine's
refusals, written for Python (``Fix: mode='vanilla'``), reach a ``fit`` user as the option to type
(:func:`engine_flags`: ``--model.engine.mode=vanilla``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
from argparse import ArgumentError
from collections.abc import Iterable, Sequence

from jsonargparse import ArgumentParser, Namespace

from lightning_dta.core.errors import ConfigError
from lightning_dta.engine.options import EngineOptions

UNRECOGNIZED = "unrecognized arguments: "
REQUIRED = "the following arguments are required: "
NOT_ACCEPTED = re.compile(r"Subcommand '[^']*' does not accept option '([^']+)'")  # a key of a --config file
PARSER_KEY = re.compile(r'Parser key "([^"]+)":\s*(.*)', re.S)
CHOICE = re.compile(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)", re.S)
TYPES = re.compile(r"<class '([\w.]+)'>")
NOT_AN_ARGUMENT = re.compile(r"Option '([^']+)' is not accepted")
CLASS_PATH = re.compile(r"class_path[ =]'([\w.]+)'")
LITERAL = re.compile(r"Expected a typing\.Literal\[([^\]]*)\]\. Got value: ([^\n]*)")
NESTED = re.compile(r"NestedArg\(key='([^']+)'")  # a field of a dataclass option given as --KEY.FIELD


def parse_args(parser: ArgumentParser, argv: Sequence[str] | None, verb: str) -> Namespace:
    """``parser.parse_args(argv)``, its refusal a one-line :class:`ConfigError` (``parser``: built with
    ``exit_on_error=False``)."""
    try:
        return parser.parse_args(argv)
    except ArgumentError as error:
        raise refusal(str(error), option_keys(parser), verb) from None


def option_keys(parser: ArgumentParser) -> list[str]:
    """The options ``parser`` takes, as dotted keys (``model.loss.clip_eps``, ``memory``; positional arguments
    are not options)."""
    keys = []
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        keys += [o.lstrip("-") for o in action.option_strings if o.startswith("--")]
    return [k for k in keys if k not in ("help", "print_config") and not k.endswith(".help")]


def nearest(key: str, keys: Iterable[str]) -> str | None:
    """The valid key closest to a mistyped one (its siblings first: ``clip_epsilon`` -> ``clip_eps``)."""
    keys = list(keys)
    parent = key.rpartition(".")[0]
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    for pool in (siblings, keys):
        close = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
        if close:
            return close[0]
    return None


def refusal(message: str, keys: Sequence[str], verb: str) -> ConfigError:
    """The one-line :class:`ConfigError` for the parser's ``message``: what, where, the fix."""
    if message.startswith(UNRECOGNIZED):
        unknown = message[len(UNRECOGNIZED):].split()
        first = unknown[0]
        if not first.startswith("-"):
            return ConfigError(f"unexpected argument {first!r}. Fix: remove it (lightning-dta {verb} --help lists "
                               "the arguments)")
        key = first.lstrip("-").split("=", 1)[0]
        return ConfigError(f"--{key} is not a setting of lightning-dta {verb}"
                           f"{_others(unknown[1:])}. Fix: {_did_you_mean(key, keys, '--', verb)}")
    if message.startswith(REQUIRED):
        missing = [k.strip().removeprefix(f"{verb}.") for k in message[len(REQUIRED):].split(",")]
        if missing[0] not in keys:  # positional arguments
            return ConfigError(f"{', '.join(missing)} must be given. Fix: lightning-dta {verb} "
                               f"{' '.join(m.upper() for m in missing)} (lightning-dta {verb} --help)")
        return ConfigError(f"{', '.join(missing)} must be given. Fix: --{missing[0]} on the command line or "
                           f"{missing[0]}: in the --config file")
    if match := NOT_ACCEPTED.fullmatch(message.strip()):
        key = match.group(1)
        return ConfigError(f"{key} (in the --config file) is not a setting of lightning-dta {verb}. "
                           f"Fix: {_did_you_mean(key, keys, '', verb)}")
    if match := CHOICE.fullmatch(message.strip()):
        allowed = [a.strip().strip("'") for a in match.group(3).split(",")]
        return ConfigError(f"{match.group(1)} {match.group(2)!r} is not one of its values. "
                           f"Fix: {_one_of(match.group(2), allowed)}")
    if match := PARSER_KEY.match(message.strip()):
        key, detail = match.group(1), match.group(2)
        if literal := LITERAL.search(detail):
            allowed = [a.strip().strip("'\"") for a in literal.group(1).split(",")]
            given = literal.group(2).strip()
            if nested := NESTED.search(detail):
                key = f"{key}.{nested.group(1)}"
            return ConfigError(f"{key}={given!r} is not one of its values. Fix: {_one_of(given, allowed)}")
        if option := NOT_AN_ARGUMENT.search(detail):  # a class's init_args: the first class_path named
            return _not_an_argument(key, option.group(1), CLASS_PATH.search(detail), verb)
        if "Subtypes:" in detail and (values := _literal_values(detail)):  # a name or a number (precision)
            given = re.search(r"Given value: (.*)", detail)
            given = given.group(1).strip() if given else "?"
            return ConfigError(f"{key}={given!r} is not one of its values. Fix: {_one_of(given, values)}")
        if key == "config" and "does not exist" in detail:
            return ConfigError(f"--config: {' '.join(detail.split())}. Fix: the path of a YAML config file, such as "
                               "configs/tiny_cpu.yaml")
        expected = detail.split("Given value type:")[0]
        types = list(dict.fromkeys({"NoneType": "null"}.get(t, t) for t in TYPES.findall(expected)))
        given = re.search(r"(?:Got|Given) value: (.*)", detail)
        if types and given:
            return ConfigError(f"{key}={given.group(1).strip()!r} is not {_or(types)}. Fix: {_or(types)} value")
        return ConfigError(f"{key}: {_one_line(detail)}. Fix: a value of the type lightning-dta {verb} --help "
                           f"shows for --{key}")
    return ConfigError(f"{_one_line(message)}. Fix: lightning-dta {verb} --help lists the settings")


def _not_an_argument(key: str, name: str, class_path: re.Match | None, verb: str) -> ConfigError:
    """``--KEY.init_args.NAME`` where the class of ``KEY`` takes no argument ``NAME``: the nearest it takes."""
    if class_path is None:
        return ConfigError(f"{key}: the class takes no argument {name!r}. Fix: lightning-dta {verb} --{key}.help CLASS "
                           "lists its arguments")
    path = class_path.group(1)
    module, _, attribute = path.rpartition(".")
    try:
        parameters = list(inspect.signature(getattr(importlib.import_module(module), attribute)).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):  # a class the signature cannot be read of
        parameters = []
    close = difflib.get_close_matches(name, parameters, n=1, cutoff=0.6)
    fix = (f"did you mean {key}.init_args.{close[0]}?" if close
           else f"lightning-dta {verb} --{key}.help {path} lists them")
    return ConfigError(f"{key}.init_args.{name}: {path} takes no argument {name!r}. Fix: {fix}")


def _literal_values(detail: str) -> list[str]:
    """The values of the ``Literal`` members of a ``Union`` (``null`` for ``None``), as the parser lists them."""
    subtypes = detail.split("Subtypes:", 1)[1].split("\n", 1)[0]
    groups = re.findall(r"Literal\[([^\]]*)\]", subtypes)
    values = [v.strip().strip("'\"") for group in groups for v in group.split(",")]
    return list(dict.fromkeys(values + (["null"] if values and "NoneType" in subtypes else [])))


def _one_of(given: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(given.lower(), allowed, n=1, cutoff=0.5)
    return f"did you mean {close[0]}? (one of {', '.join(allowed)})" if close else f"one of {', '.join(allowed)}"


def _or(types: Sequence[str]) -> str:
    """``['int', 'null']`` -> ``"an int or null"``."""
    article = "an" if types[0][0] in "aeiou" else "a"
    return f"{article} {' or '.join(types)}"


def _did_you_mean(key: str, keys: Sequence[str], prefix: str, verb: str) -> str:
    close = nearest(key, keys)
    if close is not None:
        return f"did you mean {prefix}{close}?"
    return f"lightning-dta {verb} --help lists the settings"


def _others(rest: Sequence[str]) -> str:
    names = [r.split("=", 1)[0] for r in rest if r.startswith("-")]
    return f" (nor {', '.join(names)})" if names else ""


def _one_line(text: str) -> str:
    """A jsonargparse message on one line: a ``Union``'s list of each member's refusal is dropped."""
    given = re.search(r"Given value: (.*)", text)
    text = text.split("\n  Subtypes:")[0]
    return " ".join(text.split()).rstrip(".") + (f" (given: {given.group(1).strip()})" if given else "")


def engine_flags(message: str, prefix: str) -> str:
    """``message`` with the engine settings of its fix written as options of the command: the engine refuses in
    Python's form (``Fix: mode='vanilla'``), which a ``lightning-dta fit`` user types as ``--model.engine.mode=vanilla``
    (``prefix``: ``--model.engine.``). Only the fix is rewritten; other names (a model's ``attn_implementation``)
    stay."""
    what, sep, fix = message.partition("Fix:")
    if not sep:
        return message
    names = "|".join(sorted((f.name for f in dataclasses.fields(EngineOptions)), key=len, reverse=True))
    setting = re.compile(rf"(?<![\w.-])({names})=('[^']*'|\"[^\"]*\"|\.\.\.|\w+(?:\.\w+)*)")

    def flag(match: re.Match) -> str:
        value = match.group(2).strip("'\"")
        return f"{prefix}{match.group(1)}={ {'None': 'null', 'True': 'true', 'False': 'false'}.get(value, value)}"

    return what + sep + setting.sub(flag, fix)
