"""Parts: the classes that a config group's YAML names with ``_target_`` (docs/guide.md "Extending stepflow").

A part is one class and one YAML: the YAML's fields are the class's keyword arguments. The core builds every part
through :func:`build_part` and then asks it what it needs (capability flags); it never compares option names.
A user's part, in their own package and found through ``hydra.searchpath`` / ``--config-dir``, is built the same
way and has the same powers as a built-in.

A field that the chosen part does not take is an error naming it, unless another option of the same group takes it
(``sampler.schedule`` set by a model's recipe "when sampler=ddim_sde"): that one is logged once as left unused, so
a recipe can pin the settings of several options and none is ignored silently.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stepflow.errors import StepflowError

__all__ = ["CONF_DIR", "build_part", "check_fields", "from_option", "options", "option_node", "group_fields", "search_dirs"]

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
_log = logging.getLogger("stepflow.train")
_LOGGED: set[str] = set()


def search_dirs() -> list[Path]:
    """The config directories of this run: the package's conf/ and, under a Hydra entry point, every ``file://``
    directory on its search path (``hydra.searchpath``, ``--config-dir``)."""
    dirs = [CONF_DIR]
    try:
        from hydra.core.hydra_config import HydraConfig

        sources = HydraConfig.get().runtime.config_sources
    except (ImportError, ValueError):  # not under a Hydra entry point
        return dirs
    for src in sources:
        if src.get("schema") == "file" and src.get("path"):
            p = Path(src["path"]).resolve()
            if p.is_dir() and p not in dirs:
                dirs.append(p)
    return dirs


def options(group: str, dirs: Iterable[Path] | None = None) -> list[str]:
    """The option names of config group ``group`` in ``dirs`` (default :func:`search_dirs`): its
    ``<group>/**/*.yaml`` files, a sub-folder's as ``league/nft``, sorted and unique."""
    found = set()
    for d in dirs if dirs is not None else search_dirs():
        g = Path(d) / group
        found |= {p.relative_to(g).with_suffix("").as_posix() for p in g.rglob("*.yaml")}
    return sorted(found)


def option_node(group: str, name: str, dirs: Iterable[Path] | None = None) -> dict:
    """The fields of option ``name`` of ``group`` as written in its YAML (no Hydra composition)."""
    from omegaconf import OmegaConf

    for d in dirs if dirs is not None else search_dirs():
        f = Path(d) / group / f"{name}.yaml"
        if f.is_file():
            node = OmegaConf.to_container(OmegaConf.load(f), resolve=False) or {}
            node.pop("defaults", None)
            return node
    raise ValueError(f"{group}: must be one of {', '.join(options(group, dirs))}, got {name!r}")


def _import(target: str, field: str, option: str | None = None):
    mod, _, attr = str(target).rpartition(".")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as e:
        where = f"{field}={option}: " if option else ""
        raise StepflowError(f"{field}._target_: cannot import {target!r} ({where}{type(e).__name__}: "
                            f"{' '.join(str(e).split())[:160]}); check the class path and that its package is on "
                            "PYTHONPATH") from None


def _params(cls) -> tuple[set[str], bool]:
    """The keyword arguments ``cls`` takes and whether it takes any (a ``**kwargs`` that no base class's
    ``__init__`` resolves). A subclass whose ``__init__`` passes ``**fields`` on to its base's takes the base's too."""
    names: set[str] = set()
    for klass in getattr(cls, "__mro__", [cls]):
        init = klass.__dict__.get("__init__") if isinstance(klass, type) else klass
        if init is None:
            continue
        if klass is object:
            return names, False
        try:
            sig = inspect.signature(init)
        except (TypeError, ValueError):
            return names, True
        names |= {n for n, p in sig.parameters.items()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"}
        if not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            return names, False
    return names, True


def group_fields(group: str, dirs: Iterable[Path] | None = None) -> set[str]:
    """Every field some option of ``group`` takes (its YAML's keys and its class's keyword arguments)."""
    dirs = list(dirs) if dirs is not None else search_dirs()
    out: set[str] = set()
    for name in options(group, dirs):
        try:
            node = option_node(group, name, dirs)
        except Exception:  # noqa: BLE001 - an unreadable option file is that option's problem, not this one's
            continue
        out |= {k for k in node if not k.startswith("_")}
        target = node.get("_target_")
        if target:
            try:
                out |= _params(_import(target, group))[0]
            except StepflowError:
                continue
    return out


def _resolve(group: str, node: Any, option: str | None) -> tuple[Any, dict, str]:
    """The class of ``node`` and the fields it takes (the others checked: an unknown key is an error, another
    option's field is logged as unused)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    node = {k: v for k, v in dict(node or {}).items() if not (k.startswith("_") and k.endswith("_")) or k == "_target_"}
    target = node.pop("_target_", None)
    if not target:
        raise StepflowError(f"{group}: the option has no _target_; name the part's class in its YAML "
                            f"(_target_: my_package.module.Class)")
    cls = _import(target, group, option)
    takes, anything = _params(cls)
    option = option or (cls.name if isinstance(getattr(cls, "name", None), str) else None)
    what = f"{group}={option}" if option else f"{group} ({target})"
    kwargs = {k: v for k, v in node.items() if anything or k in takes}
    unused = sorted(set(node) - set(kwargs))
    if unused:
        others, given = group_fields(group), _command_line_keys()
        for key in unused:
            if key not in others:
                raise StepflowError(f"{group}.{key}: unknown key ({what} takes "
                                    f"{', '.join(sorted(takes)) or 'no field'}); check the spelling")
            if f"{group}.{key}" in given:  # asked for on the command line: not taken is an error, not a log
                raise StepflowError(f"{group}.{key}: {what} does not take it (other options of {group} do); drop "
                                    f"{group}.{key} or choose an option that takes it")
        msg = f"{group}: {', '.join(f'{k}={node[k]!r}' for k in unused)} left unused ({what} does not take them)"
        if msg not in _LOGGED:
            _LOGGED.add(msg)
            _log.info(msg)
    return cls, kwargs, what


def _command_line_keys() -> set[str]:
    """The keys the command line sets (under a Hydra entry point; else none)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = HydraConfig.get().overrides.task
    except (ImportError, ValueError):
        return set()
    return {str(o).partition("=")[0].lstrip("+~") for o in task}


def check_fields(group: str, node: Any, option: str | None = None) -> None:
    """:func:`build_part`'s checks of a node's class and fields, without building it (a reward whose weights take
    minutes to load is checked before anything loads)."""
    _resolve(group, node, option)


def build_part(group: str, node: Any, option: str | None = None, **context: Any):
    """The part of config group ``group`` from its node (a mapping: ``_target_`` + fields). ``context``: keyword
    arguments the core adds where the part takes them. Errors are one line naming ``<group>.<field>``."""
    cls, kwargs, _ = _resolve(group, node, option)
    takes, anything = _params(cls)
    kwargs.update({k: v for k, v in context.items() if anything or k in takes})
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        raise StepflowError(msg if msg.startswith(group + ".") else f"{group}.{msg}") from None


def from_option(group: str, name: str, dirs: Iterable[Path] | None = None, key: str | None = None, **fields: Any):
    """The part of option ``name`` of ``group``, its YAML read directly (no Hydra) and updated by ``fields``: code and
    tests that build a part by its option name. ``key``: the word for the option in messages (``name``, ``scheme``,
    ``kind``; default the group). A one-line ValueError for an unknown option or a field the class does not take
    (here every field is given on purpose, so none is left unused); the class checks its fields' values itself."""
    names = options(group, dirs)
    if name not in names:
        raise ValueError(f"{key or group}: must be one of {', '.join(names)}, got {name!r}")
    node = {**option_node(group, name, dirs), **fields}
    cls = _import(node.get("_target_") or "", group) if node.get("_target_") else None
    if cls is None:
        raise ValueError(f"{key or group}: conf/{group}/{name}.yaml names no _target_ (the class of the option)")
    takes, anything = _params(cls)
    for field in node:
        if field != "_target_" and not anything and field not in takes:
            raise ValueError(f"{field}: {group}={name} takes no field {field!r} (its fields: "
                             f"{', '.join(sorted(takes)) or 'none'})")
    try:
        return build_part(group, node, option=name)
    except StepflowError as e:
        raise ValueError(str(e).removeprefix(group + ".")) from None
