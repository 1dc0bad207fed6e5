"""The extension points (stepflow.core.parts, stepflow.core.requirements): every built-in part is a class named by
its YAML's ``_target_`` that lists every field the class takes (so any can be overridden on the command line), a
field no option of the group takes is one line naming it, another option's field is logged as unused (not ignored
silently), and the core dispatches on no built-in option's name and has no function over 80 lines."""

from __future__ import annotations

import ast
import inspect
import logging
import re
from pathlib import Path

import pytest

from stepflow.core.parts import CONF_DIR, _import, build_part, check_fields, from_option, option_node, options
from stepflow.errors import StepflowError

PKG = Path(__file__).resolve().parent.parent / "stepflow"
GROUPS = ("sampler", "advantage", "objective", "window")


def _fields(cls) -> dict:
    """Every keyword argument ``cls`` takes along its ``__init__`` chain (``**fields`` passed on to the base), with
    its default (written independently of stepflow.core.parts._params)."""
    out = {}
    for klass in cls.__mro__:
        if klass is object:
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        out.update({n: p.default for n, p in params.items() if n not in ("self", "train") and n not in out
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)})
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            break
    return out


@pytest.mark.parametrize("group", GROUPS)
def test_every_builtin_option_names_its_class_and_lists_its_fields(group):
    names = options(group, [CONF_DIR])
    assert names
    for name in names:
        node = option_node(group, name, [CONF_DIR])
        assert "_target_" in node, f"{group}/{name}.yaml names no _target_"
        cls = _import(node["_target_"], group)
        missing = sorted(set(_fields(cls)) - set(node))
        assert not missing, f"{group}/{name}.yaml does not list {missing} (not overridable without +)"
        part = build_part(group, node, option=name)
        assert isinstance(part, cls)


def test_an_unknown_field_is_one_line_naming_it_and_another_options_field_is_logged(caplog):
    with pytest.raises(StepflowError, match=r"^advantage\.epss: unknown key \(advantage=gain takes .*eps"):
        build_part("advantage", {**option_node("advantage", "gain"), "epss": 0.1}, option="gain")
    with caplog.at_level(logging.INFO, logger="stepflow.train"):
        credit = build_part("advantage", {**option_node("advantage", "uniform"), "ema_alpha": 0.5, "over": "trained"},
                            option="uniform")
    assert not hasattr(credit, "ema_alpha")
    assert any("ema_alpha=0.5" in r.getMessage() and "left unused" in r.getMessage() and "advantage=uniform" in
               r.getMessage() for r in caplog.records)
    with pytest.raises(StepflowError, match=r"^objective\.beta: must be > 0"):
        build_part("objective", {**option_node("objective", "nft"), "beta": 0.0}, option="nft")


def test_a_target_that_does_not_import_and_a_missing_target_are_one_line():
    with pytest.raises(StepflowError, match=r"^sampler\._target_: cannot import 'nosuch\.Sampler'"):
        build_part("sampler", {"_target_": "nosuch.Sampler"})
    with pytest.raises(StepflowError, match=r"^window: the option has no _target_"):
        build_part("window", {"size": 3})
    with pytest.raises(StepflowError, match=r"^reward\._target_: cannot import"):
        check_fields("reward", {"_target_": "stepflow.rewards.nosuch.Reward"})
    with pytest.raises(StepflowError, match=r"^reward\.nosuch: unknown key"):
        check_fields("reward", {**option_node("reward", "shapes_geneval"), "nosuch": 1})


def test_from_option_builds_the_option_as_its_yaml_defines_it():
    credit = from_option("advantage", "gain_trained")
    assert credit.over == "trained" and credit.needs_stepwise_rewards
    assert not from_option("advantage", "uniform").needs_stepwise_rewards
    with pytest.raises(ValueError, match="^advantage: must be one of .*gain.*got 'ppo'"):
        from_option("advantage", "ppo")
    with pytest.raises(ValueError, match=r"^ema_alpha: advantage=gain takes no field 'ema_alpha' \(its fields: "):
        from_option("advantage", "gain", ema_alpha=0.5)  # a field given on purpose is never left unused


# ---------------------------------------------------------------------------------------------------- structure
def _quoted_dispatch() -> list[str]:
    """The acceptance check's count: a quoted option name of the part groups compared, tested for membership or
    used as a key anywhere in stepflow/ (stepflow/testing aside)."""
    names = sorted({p.stem for g in (*GROUPS, "credit", "rollout") for p in (CONF_DIR / g).glob("*.yaml")} - {"none"})
    q = r"[\"'](?:" + "|".join(map(re.escape, names)) + r")[\"']"
    rx = re.compile("|".join([r"(?:==|!=)\s*" + q, q + r"\s*(?:==|!=)", r"\bin\s*[\(\[\{][^\)\]\}]*" + q,
                              q + r"\s*:(?!=)"]))
    hits = []
    for f in sorted(PKG.rglob("*.py")):
        if "testing" in f.parts:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if rx.search(line.split("#")[0]):
                hits.append(f"{f.relative_to(PKG.parent)}:{i}: {line.strip()}")
    return hits


def test_the_package_dispatches_on_no_builtin_option_name():
    assert _quoted_dispatch() == []


def test_no_function_in_the_package_is_over_80_lines():
    long = []
    for f in sorted(PKG.rglob("*.py")):
        if "testing" in f.parts:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{f.relative_to(PKG.parent)}:{node.lineno} {node.name} {node.end_lineno - node.lineno + 1}")
    assert long == []


def test_a_field_given_on_the_command_line_that_the_chosen_part_does_not_take_is_one_line(tmp_path):
    """The shapes recipe sets sampler.schedule for ddim_sde (logged as unused under flow_sde); asked for on the command
    line under a sampler that does not take it, it is refused, not ignored."""
    from stepflow.testing.harness import one_line_error, run_cli

    r = run_cli("stepflow.train", "sampler=flow_sde", "sampler.schedule=eta_s",  # model=shapes: its recipe sets it
                f"hydra.run.dir={tmp_path}")
    line = one_line_error(r, "sampler.schedule: sampler=flow_sde does not take it")
    assert "choose an option that takes it" in line
