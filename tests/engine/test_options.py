"""EngineOptions: one definition of every engine option, checked in one place, flowing unchanged everywhere."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil

import pytest

import lightning_dta
import lightning_dta as dta
from lightning_dta.bench.cli import build_parser
from lightning_dta.engine.options import choices

OPTIONAL = {"lightning_dta.integrations.trl": "trl"}  # module -> the package its extra installs
ENGINE_FIELDS = {f.name for f in dataclasses.fields(dta.EngineOptions)}
LOSS_FIELDS = {f.name for f in dataclasses.fields(dta.PolicyLoss)}


def test_defaults_and_choices_come_from_the_dataclass():
    engine = dta.EngineOptions()
    assert engine.mode == "dfs" and engine.activation == "keep" and engine.sibling_batch_tokens == 4096
    assert choices("mode") == ("dfs", "vanilla", "mask")
    assert choices("activation") == ("keep", "recompute", "auto")
    assert choices("order") == ("leaves-first", "tree")


@pytest.mark.parametrize("field,value", [("mode", "fast"), ("activation", "drop"), ("order", "random"),
                                         ("chunk_size", 0), ("chunk_size", 2.5), ("chunk_size", True),
                                         ("sibling_batch_tokens", -1), ("mask_max_tokens", 0),
                                         ("vanilla_batch_tokens", "8"), ("prefix_attention", "yes")])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"EngineOptions.{field}"):
        dta.EngineOptions(**{field: value})


def test_resolve_applies_overrides_and_accepts_a_mapping():
    base = dta.EngineOptions(activation="recompute")
    assert dta.EngineOptions.resolve(base) is base
    assert dta.EngineOptions.resolve(None) == dta.EngineOptions()
    resolved = dta.EngineOptions.resolve(base, chunk_size=8)
    assert resolved.activation == "recompute" and resolved.chunk_size == 8 and base.chunk_size is None
    assert dta.EngineOptions.resolve(base.to_dict()) == base  # a checkpoint's plain dict
    with pytest.raises(TypeError, match="unknown engine option.*chunk_sise"):
        dta.EngineOptions.resolve(base, chunk_sise=8)
    with pytest.raises(TypeError, match="EngineOptions"):
        dta.EngineOptions.resolve("dfs")


def _package_callables():
    """Every function, method and class __init__ defined in the package."""
    for info in pkgutil.walk_packages(lightning_dta.__path__, "lightning_dta."):
        if info.name in OPTIONAL and importlib.util.find_spec(OPTIONAL[info.name]) is None:
            continue  # a module of an optional extra, without the extra installed
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module):
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                yield f"{module.__name__}.{obj.__name__}", obj
            elif inspect.isclass(obj) and not dataclasses.is_dataclass(obj):
                for name, member in vars(obj).items():
                    function = getattr(member, "__func__", member)
                    if inspect.isfunction(function):
                        yield f"{module.__name__}.{obj.__name__}.{name}", function


def test_no_signature_restates_an_option_default():
    """Each default of an engine option (and of a loss field) is written once, in its dataclass: no callable in
    the package declares a parameter of that name with a default. (``tree_backward(..., mode=None)`` is the
    contract's shorthand; ``None`` there means "take engine.mode".)"""
    found = []
    for where, function in _package_callables():
        for parameter in inspect.signature(function).parameters.values():
            if parameter.default is inspect.Parameter.empty:
                continue
            if parameter.name in ENGINE_FIELDS and not (where.endswith(".tree_backward") and parameter.name == "mode"
                                                        and parameter.default is None):
                found.append(f"{where}({parameter.name}={parameter.default!r})")
            if parameter.name in LOSS_FIELDS:
                found.append(f"{where}({parameter.name}={parameter.default!r})")
    assert not found, found
    assert len(list(_package_callables())) > 200  # the walk really covered the package


def test_bench_defaults_are_the_engine_defaults():
    parser = build_parser()
    engine = parser.instantiate(parser.parse_args([])).engine
    assert engine.sibling_batch_tokens == dta.EngineOptions().sibling_batch_tokens
    assert engine == dta.EngineOptions()


def test_tree_backward_keyword_overrides_equal_an_options_object(llama64):
    import random

    from tests.helpers.models import random_tree_rollouts

    tree = dta.PrefixTree.from_rollouts(random_tree_rollouts(random.Random(0), num_rollouts=6))
    by_keywords = dta.tree_backward(llama64, tree, dta.PolicyLoss(), mode="dfs", activation="recompute", chunk_size=3)
    llama64.zero_grad(set_to_none=True)
    by_object = dta.tree_backward(llama64, tree, dta.PolicyLoss(),
                                  engine=dta.EngineOptions(activation="recompute", chunk_size=3))
    llama64.zero_grad(set_to_none=True)
    assert by_keywords.loss == by_object.loss
    with pytest.raises(TypeError, match="unknown engine option"):
        dta.tree_backward(llama64, tree, dta.PolicyLoss(), activaton="recompute")
