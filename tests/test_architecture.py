"""The layout's contracts, checked on the source: who may import whom, and one configuration for every verb."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_dta as dta

PACKAGE = Path(dta.__file__).parent
CONCRETE_OBJECTIVES = {"PolicyLoss", "ValueLoss", "StepAggregation"}


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import statement in ``path`` (function-level imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("path", sorted((PACKAGE / "engine").glob("*.py")), ids=lambda p: p.name)
def test_the_engine_imports_no_framework_and_no_concrete_objective(path: Path) -> None:
    for module, names in imports(path):
        assert module.split(".")[0] not in ("lightning", "pytorch_lightning"), f"{path.name} imports {module}"
        assert module != "lightning_dta.core.losses", f"{path.name} imports {module}: use contracts.Objective"
        assert not CONCRETE_OBJECTIVES & set(names), f"{path.name} imports {CONCRETE_OBJECTIVES & set(names)}"
        assert not module.startswith(("lightning_dta.lightning", "lightning_dta.rl", "lightning_dta.plan",
                                      "lightning_dta.bench", "lightning_dta.distributed")), \
            f"{path.name} imports {module}: the engine depends on core/ and contracts only"


def test_contracts_import_nothing_of_the_package_at_run_time() -> None:
    """``contracts.py`` names the package's types only for annotations (under ``TYPE_CHECKING``)."""
    tree = ast.parse((PACKAGE / "contracts.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom):
                assert not (inner.module or "").startswith("lightning_dta"), inner.module


def test_plan_does_not_import_bench() -> None:
    for path in (PACKAGE / "plan").glob("*.py"):
        assert not [m for m, _ in imports(path) if m.startswith("lightning_dta.bench")], path.name


def _names_a_device(node: ast.expr) -> bool:
    """``device``, ``info.device``, ``t.device``, ...: an expression that names a device."""
    return (isinstance(node, ast.Name) and node.id == "device") or \
        (isinstance(node, ast.Attribute) and node.attr == "device")


@pytest.mark.parametrize("path", sorted((PACKAGE / "engine").glob("*.py")), ids=lambda p: p.name)
def test_the_engine_copies_to_the_device_only_through_to_device(path: Path) -> None:
    """A plain ``tensor.to(device)`` from pageable host memory makes the host wait for the copy (a sync per
    chunk, or per micro-batch in the baselines, which would flatter dfs's speed-up); ``engine/device.py``'s
    ``to_device`` stages through pinned memory and copies without blocking. CUDA's sync-debug mode proves it on a
    GPU (tests/gpu); this holds every engine module to it on any machine."""
    if path.name == "device.py":
        return
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("to", "cuda"):
            targets = list(node.args[:1]) + [k.value for k in node.keywords if k.arg == "device"]
            assert node.func.attr != "cuda" and not any(_names_a_device(t) for t in targets), \
                f"{path.name}:{node.lineno}: {ast.unparse(node)} copies to the device; use device.to_device"


HANDSHAKE = re.compile(r"getattr\((?P<obj>[^,]+),\s*\"(?P<name>\w+)\"")


def test_no_attribute_handshakes_between_the_parts() -> None:
    """What one part offers another is a typed contract (``contracts.py``), not a ``getattr`` probe: every
    ``getattr(obj, "name")`` left reads a user's object or an optional library feature and says so in a comment
    on its line or the line above."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            match = HANDSHAKE.search(line)
            above = lines[number - 2].strip() if number > 1 else ""
            if match and "#" not in line.split("getattr(")[-1] and not above.startswith("#"):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)


def _help(*verb: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "lightning_dta.cli", *verb, "--help"], capture_output=True,
                          text=True, timeout=300, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return re.sub(r"\s+", " ", proc.stdout)


@pytest.mark.slow
def test_every_verb_shows_the_same_engine_options_and_defaults() -> None:
    defaults = dta.EngineOptions().to_dict()
    top = _help()
    for name, value in defaults.items():
        assert f"{name}={'null' if value is None else value}" in top, name
    for verb, prefix in (("fit", "--model.engine."), ("plan", "--engine."), ("bench", "--engine.")):
        text = _help(verb)
        for field in dataclasses.fields(dta.EngineOptions):
            shown = "null" if defaults[field.name] is None else str(defaults[field.name])
            entries = [e for e in text.split(" --") if e.startswith(prefix[2:] + field.name + " ") and "default:" in e]
            assert len(entries) == 1, f"{verb} --help shows {prefix}{field.name} {len(entries)} times"
            default = re.search(r"default: ([^)]*)\)", entries[0]).group(1)
            assert default == shown, (verb, field.name, default, shown)
