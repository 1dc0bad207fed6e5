"""Shared plumbing of the Hydra entry points (train, evaluate, pretrain, serve_reward): one-line errors for bad
overrides, bad values, missing files and models, and every other failure (``HYDRA_FULL_ERROR=1`` shows the
traceback)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from stepflow.config import CONF_DIR, register_configs
from stepflow.errors import RewardError, StepflowError

# the structured configs (``train_schema``) that ``conf/train.yaml`` composes: every composition of the configs goes
# through this module (``CONF_DIR``), so importing it is enough
register_configs()


def debugging() -> bool:
    """``HYDRA_FULL_ERROR=1`` (or ``STEPFLOW_TRACEBACK=1``): show tracebacks instead of one-line errors."""
    return any(os.environ.get(k, "") not in ("", "0") for k in ("HYDRA_FULL_ERROR", "STEPFLOW_TRACEBACK"))


def fail(msg: str, code: int = 2) -> NoReturn:
    """Exit with a one-line error ``stepflow: error: <msg>`` (exit status ``code``), also written to the run's log
    file when there is one (``<run>/train.log``: what explains a run that stopped)."""
    first = " ".join(str(msg).split()) if str(msg).strip() else "error"
    print(f"stepflow: error: {first}", file=sys.stderr, flush=True)
    to_log_file(f"stepflow: error: {first}", error=True)
    raise SystemExit(code)


def to_log_file(line: str, error: bool = False) -> None:
    """Write ``line`` to the run's log files only (Hydra's file handlers: ``<run>/<command>.log``), not the console
    (where it is printed already): the summary line and a fatal error end up in train.log too."""
    import logging

    record = logging.LogRecord("stepflow", logging.ERROR if error else logging.INFO, __file__, 0, line, None, None)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)


def _no_advert(record) -> bool:
    """A logging filter: False for Lightning's product adverts (``💡 Tip: ... try installing litlogger``)."""
    return not str(record.msg).startswith("💡")


def quiet_libraries() -> None:
    """A run prints each library line once and no adverts or deprecations the user cannot act on (stepflow's own
    warnings are never filtered):

    - Lightning's console handler goes (its lines reach the console and the run's log through Hydra's handlers, as
      everything else does: each once), and its "💡 Tip" adverts are dropped;
    - the deprecation Lightning's own code triggers in torch (``isinstance(treespec, LeafSpec)``) is ignored where it
      is raised (Lightning's ``utilities/_pytree.py``);
    - Lightning's "module(s) in eval mode at the start of training" is ignored: the frozen parts (VAE, text encoders,
      reference copies, reward nets) are in eval mode on purpose, and the policy's trained modules are not.
    """
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401 - its loggers and their handlers exist from its import on

    if logging.getLogger().handlers:  # under Hydra's logging: its handlers print Lightning's lines
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            lg = logging.getLogger(name)
            for h in [h for h in lg.handlers if type(h) is logging.StreamHandler]:
                lg.removeHandler(h)
            lg.propagate = True
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if _no_advert not in rank_zero.filters:
        rank_zero.addFilter(_no_advert)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            module=r"lightning\.pytorch\.utilities\._pytree")
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training",
                            module=r"lightning\.pytorch\.loops\.fit_loop")


def message(e: BaseException) -> tuple[str, int]:
    """The one line and exit status for an exception that reached an entry point: its own message for the errors
    stepflow raises and for bad values / missing files, the exception type and message (plus how to see the
    traceback) otherwise."""
    if isinstance(e, StepflowError):
        return str(e) or type(e).__name__, e.exit_code
    if isinstance(e, (RewardError, ValueError, FileNotFoundError, KeyError)):
        return str(e) or type(e).__name__, 2
    if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
        return (f"out of memory ({type(e).__name__}); lower loop.prompts_per_iter, train.micro_batch_size, "
                "loop.estimate_chunk or loop.decode_chunk"), 2
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]} (set HYDRA_FULL_ERROR=1 for the traceback)", 2


def report(e: BaseException) -> NoReturn:
    """Exit with the one line of :func:`message`."""
    fail(*message(e))


def first_non_finite(node, prefix: str = "") -> tuple[str, float] | None:
    """The first float of a config container (dicts and lists, depth-first) that is inf or nan, as ``(key, value)``
    (``train.betas[1]``); None when every float is finite."""
    import math

    if isinstance(node, dict):
        items = ((f"{prefix}{k}", v) for k, v in node.items())
    elif isinstance(node, (list, tuple)):
        items = ((f"{prefix[:-1]}[{i}]", v) for i, v in enumerate(node))
    else:
        return (prefix[:-1], node) if isinstance(node, float) and not math.isfinite(node) else None
    for key, v in items:
        bad = first_non_finite(v, f"{key}.") if isinstance(v, (dict, list, tuple)) else (
            (key, v) if isinstance(v, float) and not math.isfinite(v) else None)
        if bad:
            return bad
    return None


def check_finite(cfg) -> None:
    """Every float of the composed config is finite: ``inf`` and ``nan`` pass every ``>=`` / ``<`` bound check of one
    side (``train.lr=inf`` is > 0) and train a model of non-finite weights, so they are refused for every field of
    every entry point, typed or not (``model.*``, ``reward.*``, ``trainer.*``), before anything is built."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        except Exception:  # noqa: BLE001 - an interpolation that does not resolve yet: check the literal values
            cfg = OmegaConf.to_container(cfg, resolve=False)
    bad = first_non_finite(cfg)
    if bad:
        raise StepflowError(f"{bad[0]}: must be a finite number, got {bad[1]}; give {bad[0]}=<a finite value> "
                            "(inf and nan are no setting)")


def instantiate(node, field: str, **kwargs):
    """``hydra.utils.instantiate(node)`` with the target's own one-line error instead of Hydra's wrapper
    (``InstantiationException``): a :class:`StepflowError` / ``ValueError`` / missing file of the constructor keeps
    its message (whole: its fix is often at the end), anything else is named by ``field`` (``model``)."""
    import hydra.utils
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, (ValueError, OSError)):
            raise StepflowError(" ".join(str(cause).split()) or f"{field}: {type(cause).__name__}") from None
        unimportable = import_error(e, field)
        if unimportable is not None:
            raise unimportable from None
        why = " ".join(str(cause if cause is not None else e).split())
        what = f"{type(cause).__name__}: " if cause is not None else ""
        raise StepflowError(f"{field}: {what}{why[:300]}") from None


def _locate_failure(e: BaseException) -> tuple[str, BaseException] | None:
    """``(target, root cause)`` when ``e`` (or what caused it) is Hydra's "Error locating target '<target>'" (a
    ``_target_`` that does not import); None otherwise."""
    import re

    from hydra.errors import InstantiationException

    x, seen = e, 0
    while x is not None and seen < 8:
        found = re.match(r"Error locating target '(.+?)'", str(x)) if isinstance(x, InstantiationException) else None
        if found:
            root = x
            while root.__cause__ is not None or root.__context__ is not None:
                root = root.__cause__ or root.__context__
            return found.group(1), root
        x, seen = x.__cause__ or x.__context__, seen + 1
    return None


def _target_field(node, target: str, prefix: str = "") -> str | None:
    """The dotted key of the first node of a config whose ``_target_`` is ``target`` (``reward``), depth-first."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(node, (dict, DictConfig)):
        try:
            if node.get("_target_") == target:
                return prefix[:-1] or "_target_"
            items = list(node.items())
        except Exception:  # noqa: BLE001 - a node that does not resolve: not this one
            return None
        for k, v in items:
            if isinstance(v, (dict, DictConfig, list, ListConfig)):
                hit = _target_field(v, target, f"{prefix}{k}.")
                if hit:
                    return hit
    elif isinstance(node, (list, ListConfig)):
        for i, v in enumerate(node):
            hit = _target_field(v, target, f"{prefix[:-1]}[{i}].")
            if hit:
                return hit
    return None


def import_error(e: BaseException, field: str | None = None, cfg=None) -> StepflowError | None:
    """The one line for a ``_target_`` that does not import (a class of the user's own package that is not on
    ``PYTHONPATH``, a typo in the class path): ``<field>._target_: cannot import '<target>' (<group>=<option>: <why>);
    <fix>``. ``field``: the config key of the node (``model``), else found in ``cfg`` (the composed config); the
    option is the group's choice of this run (``reward=bright``), when Hydra knows it. None for any other error."""
    failure = _locate_failure(e)
    if failure is None:
        return None
    target, root = failure
    if field is None and cfg is not None:
        field = _target_field(cfg, target)
    field = field or "_target_"
    parent, _, attr = target.rpartition(".")
    if isinstance(root, ModuleNotFoundError) and root.name == target and parent:
        why = f"module {parent!r} has no attribute {attr!r}"
    else:
        why = f"{type(root).__name__}: {' '.join(str(root).split())[:200]}"
    group = field.split(".")[0].split("[")[0]
    option = ""
    try:
        from hydra.core.hydra_config import HydraConfig

        choice = HydraConfig.get().runtime.choices.get(group)
        option = f"{group}={choice}: " if choice else ""
    except (ImportError, ValueError, AttributeError):
        pass
    key = field if field.endswith("_target_") else f"{field}._target_"
    return StepflowError(f"{key}: cannot import {target!r} ({option}{why}); check the class path, and that its "
                         "package is importable (its folder on PYTHONPATH)")


#: Hydra's command-line flags that take the next argument as their value
VALUED_FLAGS = frozenset({"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                          "--config-dir", "-i", "--info", "--experimental-rerun"})


def overrides_of(argv: list[str]) -> list[str]:
    """The overrides of a command line: its arguments less Hydra's flags and their values (``--config-dir DIR``)."""
    return [a for prev, a in zip(["", *argv], argv) if not a.startswith("-") and prev not in VALUED_FLAGS]


def config_dir_of(argv: list[str]) -> str | None:
    """The ``--config-dir DIR`` / ``-cd DIR`` / ``--config-dir=DIR`` of a command line (the last one), else None."""
    found = None
    for prev, a in zip(["", *argv], argv):
        if prev in ("-cd", "--config-dir"):
            found = a
        elif a.startswith(("--config-dir=", "-cd=")):
            found = a.partition("=")[2]
    return found


def _searchpath_dir(entry: str) -> Path:
    """The directory of one ``hydra.searchpath`` entry (``file://<dir>``, a plain path, ``pkg://<package>[/<dir>]``);
    a one-line error when it is not an existing directory."""
    fix = ("give an existing directory: hydra.searchpath=[file:///abs/conf] (or a plain path, or "
           "pkg://<package>/<folder> of an importable package)")
    if entry.startswith("pkg://"):
        from importlib import resources

        # Hydra reads pkg://a/b/c as the package a.b.c; its folder is the folder c of the longest importable package
        # a(.b) (a folder without __init__.py is a namespace package, whose resources are no plain folder)
        parts = [p for p in entry[len("pkg://"):].replace(".", "/").split("/") if p]
        where, why = None, "no package"
        for i in range(len(parts), 0, -1):
            try:
                base = Path(str(resources.files(".".join(parts[:i]))))
            except Exception as e:  # noqa: BLE001 - ModuleNotFoundError, a module that is no package, ...
                why = f"{type(e).__name__}: {' '.join(str(e).split())}"
                continue
            if base.is_dir():
                where = base.joinpath(*parts[i:])
                break
        if where is None:
            fail(f"hydra.searchpath: {entry} is not a directory ({why}); {fix}")
    else:
        where = Path(entry[len("file://"):] if entry.startswith("file://") else entry).expanduser()
    if not where.is_dir():
        fail(f"hydra.searchpath: {entry} is not a directory; {fix}")
    return where.resolve()


def _searchpath_entries(argv: list[str], config_name: str | None, conf_dir: Path) -> tuple[list[str], bool]:
    """The ``hydra.searchpath`` entries Hydra will use and whether they come from the command line: the command line's
    ``hydra.searchpath=[...]`` (which replaces the primary config's), else the primary config's own, else none."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in overrides_of(argv):
        if arg.partition("=")[0].lstrip("+~") != "hydra.searchpath" or "=" not in arg:
            continue
        value = parser.parse_overrides([arg])[0].value()
        if value is None:
            return [], True
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            fail(f"hydra.searchpath: must be a list of directories, got {arg.partition('=')[2]!r}; give "
                 "hydra.searchpath=[file:///abs/conf,...]")
        return [str(v) for v in value], True
    primary = conf_dir / f"{config_name}.yaml" if config_name else None
    if primary is None or not primary.is_file():
        return [], False
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.select(OmegaConf.load(primary), "hydra.searchpath")
    except Exception:  # noqa: BLE001 - a primary config Hydra will report itself
        return [], False
    return ([str(v) for v in value] if value is not None and OmegaConf.is_list(value) else []), False


def search_path(argv: list[str], config_name: str | None = None, conf_dir: Path = CONF_DIR) -> list[Path]:
    """The config directories of a command line besides the package's conf dir, in Hydra's order: ``--config-dir``
    (``-cd``), then the entries of ``hydra.searchpath`` (the command line's, else the primary config's:
    ``conf/<config_name>.yaml``). An entry that is not an existing directory is a one-line error; entries Hydra
    cannot read before composing (an interpolation, ``structured://``) are skipped."""
    dirs = []
    cd = config_dir_of(argv)
    if cd is not None:
        where = Path(cd).expanduser()
        if not where.is_dir():
            fail(f"--config-dir: {cd} is not a directory; give an existing directory of config groups "
                 "(--config-dir /abs/conf)")
        dirs.append(where.resolve())
    entries, _ = _searchpath_entries(argv, config_name, conf_dir)
    for entry in entries:
        if "${" in entry or entry.startswith("structured://"):
            continue
        dirs.append(_searchpath_dir(entry))
    return list(dict.fromkeys(dirs))


def searchpath_overrides(argv: list[str], config_name: str | None = None, conf_dir: Path = CONF_DIR) -> list[str]:
    """The ``hydra.searchpath=[...]`` override that makes a composition with Hydra's compose API (the up-front checks)
    see what the run will: ``--config-dir`` (which the compose API does not take) as the first entry, then the
    command line's (else the primary config's) entries; ``[]`` when the command line adds no config directory."""
    cd = config_dir_of(argv)
    entries, from_cli = _searchpath_entries(argv, config_name, conf_dir)
    if cd is None and not from_cli:
        return []  # the primary config's own hydra.searchpath: the compose API reads it itself
    if cd is not None:
        entries = [f"file://{Path(cd).expanduser().resolve()}", *entries]

    def quoted(v: str) -> str:  # Hydra's grammar: backslashes are escaped only before a quote (or the closing one)
        import re

        v = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", v)
        return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, v) + "'"

    return [f"hydra.searchpath=[{','.join(quoted(v) for v in entries)}]"]


def group_options(group: str, search: list[Path] | tuple = (), conf_dir: Path = CONF_DIR) -> list[str] | None:
    """The options of config group ``group`` (``reward``, ``experiment``; a nested group as ``hydra/launcher``): the
    ``<group>/**/*.yaml`` files (``league/best`` for a sub-folder) of the package's conf dir and of every directory of
    the search path ``search`` (:func:`search_path`), sorted and unique; None when no directory has the group."""
    if not group or group.startswith(("/", ".")) or ".." in group.split("/") or "\\" in group:
        return None
    from stepflow.core.parts import options

    dirs = [d for d in (conf_dir, *search) if (d / group).is_dir()]
    return options(group, dirs) if dirs else None


def check_group_overrides(argv: list[str], conf_dir: Path = CONF_DIR, search: list[Path] | None = None,
                          config_name: str | None = None) -> None:
    """Reject ``group=option`` (and ``+group=option``) overrides whose option file exists in no config directory,
    with a one-line message listing the available options (Hydra's own message spans several lines). The config
    directories: the package's ``conf_dir`` and the search path (``search``, else :func:`search_path` of ``argv``:
    ``--config-dir``, ``hydra.searchpath``), so a user's own options and groups are accepted."""
    if search is None:
        search = search_path(argv, config_name, conf_dir)
    for arg in overrides_of(argv):
        if "=" not in arg:
            continue
        key, _, val = arg.partition("=")
        key = key.lstrip("+~").partition("@")[0]
        if key.startswith("hydra") or val in ("", "null"):
            continue
        options = group_options(key, search, conf_dir)
        if options is None:
            continue
        for v in val.split(","):  # multirun sweeps: a,b,c
            v = v.strip()
            if v and v not in options:
                fail(f"{key}={v}: unknown option for '{key}'; choose one of: {', '.join(options)}")


def check_grammar(argv: list[str]) -> None:
    """Parse every override, ``hydra.*`` ones included, with Hydra's own override parser, so that a value Hydra's
    grammar cannot read (``hydra.run.dir=/a=b``: quote it, ``hydra.run.dir="'/a=b'"``) is one line, not Hydra's
    several."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in overrides_of(argv):
        try:
            parser.parse_overrides([arg])
        except Exception as e:  # noqa: BLE001 - OverrideParseException and friends, reported as one line
            key, why = arg.partition("=")[0], " ".join(str(e).split()).split(" See https")[0]
            fail(f"{key}: cannot read the override {arg!r} ({why}); quote a value that holds '=', ',' or brackets: "
                 f"{key}=\"'...'\"")


def check_keys(argv: list[str], config_name: str, conf_dir: Path = CONF_DIR) -> None:
    """Compose the config once with the command line's plain overrides, so that what the structured configs reject
    (an unknown key, a value of the wrong type) is reported as one line instead of Hydra's multi-line message. The
    composition sees the command line's config directories (``--config-dir``, ``hydra.searchpath``:
    :func:`searchpath_overrides`), so a user's own options are composed and checked too."""
    from stepflow.config import compose

    overrides = [a for a in overrides_of(argv) if ("=" in a or a.startswith("~"))
                 and not a.lstrip("+~").startswith("hydra")]
    if any("," in a.partition("=")[2] and not a.partition("=")[2].startswith("[") for a in overrides):
        return  # a sweep: check_sweep composes each job
    try:
        compose(config_name, [*overrides, *searchpath_overrides(argv, config_name, conf_dir)], conf_dir=conf_dir)
    except Exception as e:  # noqa: BLE001 - reported as one line
        fail(compose_error(e))


def compose_error(e: BaseException) -> str:
    """One line for a composition error: ``<full key>: <what>; <fix>`` when OmegaConf names the key (a value of the
    wrong type, a key the structured config does not have), else Hydra's message collapsed."""
    import re

    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(str(x))
        x = x.__cause__ or x.__context__
    for msg in chain:
        key = re.search(r"full_key: (\S+)", msg)
        if not key:
            continue
        k = key.group(1)
        conv = re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", msg)
        if conv:
            return f"{k}: {conv.group(1)!r} is not a valid {conv.group(2).lower()}; give {k}=<{conv.group(2).lower()}>"
        # a number field that takes an integral float (serve_reward's counts: max_images=4.0)
        if re.search(r"of type '\w+' is incompatible with type hint 'Union\[int, float\]'", msg):
            val = re.search(r"Value '(.*)' of type", msg)
            return f"{k}: {val.group(1) if val else 'the value'!r} is not a number; give {k}=<number>"
        listy = re.search(r"Invalid value assigned: (\w+) is not a ListConfig, list or tuple", msg)
        if listy:  # a list field given one value: the override's own value, when the chain has it
            given = next((re.search(r"override \S+?=(.+)$", m) for m in chain if re.search(r"override \S+?=", m)),
                         None)
            got = f"{given.group(1)!r} ({listy.group(1)})" if given else f"a {listy.group(1)}"
            return f"{k}: must be a list, got {got}; give {k}=[{given.group(1) if given else '...'}] (in brackets)"
        unknown = re.search(r"Key '(.+?)' not in '(\w+)'", msg)
        if unknown:
            return f"{k}: unknown key ({unknown.group(2)} has no field {unknown.group(1)!r}); check the spelling"
        if re.search(r"Key '(.+?)' is not in struct", msg):
            parent = k.rpartition(".")[0] or "the config"
            return (f"{k}: unknown key ({parent} has no field {k.rpartition('.')[2]!r}); check the spelling, or add "
                    f"a key the config does not have with +{k}=<value>")
        return f"{k}: " + " ".join(msg.split("full_key:")[0].split())
    msg = " ".join(chain[0].split())
    twice = re.match(r"Multiple values for (\S+)\. To override a value use 'override \S+: (.+?)'", msg)
    if twice:  # +group=option for a group the config already chooses
        group, option = twice.groups()
        return (f"+{group}={option}: the config already chooses a {group}; give {group}={option} (without the +) to "
                "replace it")
    return msg.replace("To append to your config use +", "(unknown key; to add a new key use +")


#: the multirun jobs this process ran (``num``, ``overrides``, ``error`` or None), for the sweep's closing summary
JOBS: list[dict] = []

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def _in_process_multirun() -> dict | None:
    """This job's number and overrides when it runs in a multirun of Hydra's basic (in-process, sequential)
    launcher; None otherwise (a single run, or a job of a launcher that runs each job in its own process)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except (ImportError, ValueError):
        return None
    if hc.mode != RunMode.MULTIRUN or hc.launcher.get("_target_") != BASIC_LAUNCHER:
        return None
    return {"num": int(hc.job.num), "overrides": " ".join(hc.overrides.task)}


def sweep_jobs(argv: list[str]) -> list[list[str]]:
    """The jobs of a ``--multirun`` command line (Hydra's basic sweeper's expansion), each as its override list."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = overrides_of(argv)
    parsed = OverridesParser.create().parse_overrides(args)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_sweep(argv: list[str], config_name: str, conf_dir: Path = CONF_DIR) -> int:
    """Compose every job of a sweep before the first one starts, so that a value of the wrong type or an unknown key
    in any job is one line naming the job (Hydra reports it only when that job's turn comes, in several lines);
    returns the number of jobs."""
    from stepflow.config import composer

    try:
        jobs = sweep_jobs(argv)
    except Exception as e:  # noqa: BLE001 - reported as one line
        fail(f"cannot expand the sweep: {' '.join(str(e).split())}")
    searchpath = searchpath_overrides(argv, config_name, conf_dir)
    with composer(conf_dir) as compose:
        for i, job in enumerate(jobs):
            plain = [o for o in job if not o.lstrip("+~").startswith("hydra")]
            try:
                compose(config_name, [*plain, *searchpath])
            except Exception as e:  # noqa: BLE001 - reported as one line
                fail(f"{compose_error(e)} (sweep job #{i}: {' '.join(plain)})")
    return len(jobs)


def multirun_summary(total: int | None) -> tuple[str, int]:
    """The closing line of an in-process sweep: how many jobs ran, failed and were skipped (never started), and the
    failed ones; the exit status is 1 when any job failed or was skipped."""
    failed = [j for j in JOBS if j["error"] is not None]
    skipped = max(0, (total or len(JOBS)) - len(JOBS))
    line = (f"stepflow: multirun: {len(JOBS) + skipped} jobs: {len(JOBS) - len(failed)} ran, {len(failed)} failed, "
            f"{skipped} skipped")
    if failed:
        line += "; failed: " + ", ".join(f"#{j['num']} ({j['overrides']})" for j in failed)
    return line, 1 if failed or skipped else 0


def resume_in_place(argv: list[str]) -> list[str]:
    """``ckpt_path=<run>/checkpoints/<file>.ckpt`` without ``hydra.run.dir``: the resumed run's directory becomes the
    run directory (Hydra's log appends to its ``train.log``; Hydra's record of this invocation goes to
    ``.hydra/resume_<time>_<pid>/``, the original's ``.hydra/`` stays), so a resume started anywhere creates no new
    directory. Other command lines are returned unchanged."""
    import time

    keys = {a.partition("=")[0].lstrip("+~") for a in argv if "=" in a}
    ckpt = next((a.partition("=")[2] for a in argv if a.partition("=")[0].lstrip("+") == "ckpt_path"), None)
    if not ckpt or ckpt == "auto" or "hydra.run.dir" in keys or any(a in ("-m", "--multirun") for a in argv):
        return argv
    ckpt = ckpt.strip("'\"")
    path = Path(ckpt).expanduser()
    if path.parent.name != "checkpoints" or not path.is_file() or "'" in str(path) or "\\" in str(path):
        return argv  # not a run's checkpoint (train.run says what is wrong with it)
    run_dir = path.resolve().parent.parent
    extra = [f"hydra.run.dir='{run_dir}'"]
    if "hydra.output_subdir" not in keys:
        extra.append(f"hydra.output_subdir=.hydra/resume_{time.strftime('%Y-%m-%d_%H-%M-%S')}_{os.getpid()}")
    return [*argv, *extra]


def entry_point(config_name: str, resumes: bool = False) -> Callable:
    """Decorator for ``main(cfg)`` functions: validates argv, runs Hydra, prints user errors as one line.
    ``resumes``: the command resumes runs from ``ckpt_path`` (:func:`resume_in_place`).

    In a multirun of Hydra's basic launcher a failed job prints its one line (naming the job) and the sweep goes on
    with the next job; the sweep ends with :func:`multirun_summary` and a non-zero exit if any job failed. A signal
    (SIGINT / SIGTERM) stops the whole sweep. Jobs of other launchers (SLURM) fail in their own process."""

    def deco(fn: Callable) -> Callable:
        import hydra

        @functools.wraps(fn)
        def task(cfg):
            job = _in_process_multirun()
            quiet_libraries()
            try:
                check_finite(cfg)
                out = fn(cfg)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - every error is one line unless debugging
                if debugging() and not isinstance(e, SystemExit):
                    raise
                if not isinstance(e, SystemExit):
                    e = import_error(e, cfg=cfg) or e  # a _target_ that does not import: named by its config key
                if job is None:
                    if isinstance(e, SystemExit):
                        raise
                    report(e)
                msg, code = (f"exited with status {e.code}", e.code) if isinstance(e, SystemExit) else message(e)
                JOBS.append({**job, "error": msg})
                if not isinstance(e, SystemExit):
                    print(f"stepflow: error: {msg} (multirun job #{job['num']}: {job['overrides']})", file=sys.stderr,
                          flush=True)
                if code in (130, 143):  # a signal stops the sweep, not only this job
                    raise SystemExit(code) from None
                return None
            if job is not None:
                JOBS.append({**job, "error": None})
            return out

        hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(task)

        def cli() -> None:
            if resumes:
                sys.argv[1:] = resume_in_place(sys.argv[1:])
            argv = sys.argv[1:]
            check_grammar(argv)
            check_group_overrides(argv, config_name=config_name)
            multirun = "-m" in argv or "--multirun" in argv
            total = None
            # the up-front checks compose what the run will under --multirun and --config-dir (a searchpath entry
            # for them); other flags (--cfg, --help, -cn ...) skip them
            composing = {"--multirun", "--config-dir"}
            if not any(a.startswith("--") and a not in composing and not a.startswith("--config-dir=") for a in argv):
                if multirun:
                    total = check_sweep(argv, config_name)
                else:
                    check_keys(argv, config_name)
            try:
                hydra_main()
            except SystemExit:
                if JOBS:
                    print(multirun_summary(total)[0], file=sys.stderr, flush=True)
                raise
            except Exception as e:  # noqa: BLE001 - Hydra's own argument errors, outside the task
                if debugging():
                    raise
                fail(" ".join(str(e).split()) or type(e).__name__)
            if JOBS:
                line, code = multirun_summary(total)
                print(line, file=sys.stderr, flush=True)
                if code:
                    raise SystemExit(code)

        cli.task = task  # type: ignore[attr-defined]
        return cli

    return deco
