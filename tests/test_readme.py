"""The README's Python code blocks run as printed, from the repository root, on the shipped data."""

from __future__ import annotations

import importlib.util
import re
import warnings

import pytest

from tests import helpers

README = helpers.REPO / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.DOTALL | re.MULTILINE)


def test_the_readme_has_a_python_snippet() -> None:
    assert python_blocks(), "the README lost its Python example"


@pytest.mark.parametrize("number", range(len(python_blocks())))
def test_a_readme_snippet_runs_and_trains(number: int, monkeypatch: pytest.MonkeyPatch) -> None:
    block = python_blocks()[number]
    if "from trl import" in block and importlib.util.find_spec("trl") is None:
        pytest.skip("the TRL snippet needs TRL: pip install -e '.[trl]'")
    monkeypatch.chdir(helpers.REPO)
    namespace: dict = {"__name__": "__readme__"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. "every advantage is 0": the snippet must train
        exec(compile(python_blocks()[number], f"README.md python block {number}", "exec"), namespace)
    out = namespace.get("out")
    if out is not None:  # the tree_backward example: a real step, not zeros
        assert out.loss != 0 and out.metrics["trained_tokens"] > 0, out
