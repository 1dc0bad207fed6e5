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
    """Exit with a one-line error ``stepflow: error: <msg>`` (exit status ``code``)."""
    first = " ".join(str(msg).split()) if str(msg).strip() else "error"
    print(f"stepflow: error: {first}", file=sys.stderr, flush=True)
    raise SystemExit(code)


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
        why = " ".join(str(cause if cause is not None else e).split())
        what = f"{type(cause).__name__}: " if cause is not None else ""
        if cause is None and "Error locating target" in why:
            target = node.get("_target_") if isinstance(node, dict) else None
            raise StepflowError(f"{field}._target_: cannot import {target!r}; check the class path") from None
        raise StepflowError(f"{field}: {what}{why[:300]}") from None


def check_group_overrides(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject ``group=option`` overrides whose option file does not exist, with a one-line message listing the
    available options (Hydra's own message spans several lines)."""
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, val = arg.partition("=")
        key = key.lstrip("+~")
        if key.startswith("hydra") or key not in groups or val in ("", "null"):
            continue
        options = sorted(str(p.relative_to(conf_dir / key).with_suffix("")) for p in (conf_dir / key).rglob("*.yaml"))
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
    valued = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir",
              "-i", "--info", "--experimental-rerun"}
    for prev, arg in zip(["", *argv], argv):
        if arg.startswith("-") or prev in valued:
            continue
        try:
            parser.parse_overrides([arg])
        except Exception as e:  # noqa: BLE001 - OverrideParseException and friends, reported as one line
            key, why = arg.partition("=")[0], " ".join(str(e).split()).split(" See https")[0]
            fail(f"{key}: cannot read the override {arg!r} ({why}); quote a value that holds '=', ',' or brackets: "
                 f"{key}=\"'...'\"")


def check_keys(argv: list[str], config_name: str, conf_dir: Path = CONF_DIR) -> None:
    """Compose the config once with the command line's plain overrides, so that what the structured configs reject
    (an unknown key, a value of the wrong type) is reported as one line instead of Hydra's multi-line message."""
    from stepflow.config import compose

    overrides = [a for a in argv if not a.startswith("-") and ("=" in a or a.startswith("~"))
                 and not a.lstrip("+~").startswith("hydra")]
    if any("," in a.partition("=")[2] and not a.partition("=")[2].startswith("[") for a in overrides):
        return  # a sweep: check_sweep composes each job
    try:
        compose(config_name, overrides, conf_dir=conf_dir)
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
        unknown = re.search(r"Key '(.+?)' not in '(\w+)'", msg)
        if unknown:
            return f"{k}: unknown key ({unknown.group(2)} has no field {unknown.group(1)!r}); check the spelling"
        if re.search(r"Key '(.+?)' is not in struct", msg):
            parent = k.rpartition(".")[0] or "the config"
            return (f"{k}: unknown key ({parent} has no field {k.rpartition('.')[2]!r}); check the spelling, or add "
                    f"a key the config does not have with +{k}=<value>")
        return f"{k}: " + " ".join(msg.split("full_key:")[0].split())
    msg = " ".join(chain[0].split())
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

    args = [a for a in argv if not a.startswith("-")]
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
    with composer(conf_dir) as compose:
        for i, job in enumerate(jobs):
            plain = [o for o in job if not o.lstrip("+~").startswith("hydra")]
            try:
                compose(config_name, plain)
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


def entry_point(config_name: str) -> Callable:
    """Decorator for ``main(cfg)`` functions: validates argv, runs Hydra, prints user errors as one line.

    In a multirun of Hydra's basic launcher a failed job prints its one line (naming the job) and the sweep goes on
    with the next job; the sweep ends with :func:`multirun_summary` and a non-zero exit if any job failed. A signal
    (SIGINT / SIGTERM) stops the whole sweep. Jobs of other launchers (SLURM) fail in their own process."""

    def deco(fn: Callable) -> Callable:
        import hydra

        @functools.wraps(fn)
        def task(cfg):
            job = _in_process_multirun()
            try:
                check_finite(cfg)
                out = fn(cfg)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - every error is one line unless debugging
                if debugging() and not isinstance(e, SystemExit):
                    raise
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
            argv = sys.argv[1:]
            check_grammar(argv)
            check_group_overrides(argv)
            multirun = "-m" in argv or "--multirun" in argv
            total = None
            if not any(a.startswith("--") and a != "--multirun" for a in argv):
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
