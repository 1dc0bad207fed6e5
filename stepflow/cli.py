"""Shared plumbing of the Hydra entry points (train, evaluate, pretrain, serve_reward): one-line errors for bad
overrides, bad values, missing files and models, and every other failure (``HYDRA_FULL_ERROR=1`` shows the
traceback)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import NoReturn

#: the Hydra config directory, shipped inside the package (found the same way from a wheel or an editable install)
CONF_DIR = Path(str(resources.files("stepflow").joinpath("conf")))


def _register() -> None:
    """Register the structured configs (``train_schema``) that ``conf/train.yaml`` composes; every composition of
    the configs goes through this module (``CONF_DIR``), so importing it is enough."""
    from stepflow.config import register_configs

    register_configs()


_register()


class StepflowError(ValueError):
    """A user-facing configuration or input error, printed as one line (``exit_code``: the process's status)."""

    exit_code = 2

    def __init__(self, msg: str = "", exit_code: int | None = None):
        super().__init__(msg)
        if exit_code is not None:
            self.exit_code = exit_code


def debugging() -> bool:
    """``HYDRA_FULL_ERROR=1`` (or ``STEPFLOW_TRACEBACK=1``): show tracebacks instead of one-line errors."""
    return any(os.environ.get(k, "") not in ("", "0") for k in ("HYDRA_FULL_ERROR", "STEPFLOW_TRACEBACK"))


def fail(msg: str, code: int = 2) -> NoReturn:
    """Exit with a one-line error ``stepflow: error: <msg>`` (exit status ``code``)."""
    first = " ".join(str(msg).split()) if str(msg).strip() else "error"
    print(f"stepflow: error: {first}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def report(e: BaseException) -> NoReturn:
    """The one line for an exception that reached an entry point: its own message for the errors stepflow raises
    and for bad values / missing files, the exception type and message (plus how to see the traceback) otherwise."""
    from stepflow.rewards.errors import RewardError

    if isinstance(e, StepflowError):
        fail(str(e) or type(e).__name__, e.exit_code)
    if isinstance(e, (RewardError, ValueError, FileNotFoundError, KeyError)):
        fail(str(e) or type(e).__name__)
    if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
        fail(f"out of memory ({type(e).__name__}); lower loop.prompts_per_iter, train.micro_batch_size, "
             "loop.estimate_chunk or loop.decode_chunk")
    fail(f"{type(e).__name__}: {' '.join(str(e).split())[:400]} (set HYDRA_FULL_ERROR=1 for the traceback)")


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
        options = sorted(p.stem for p in (conf_dir / key).glob("*.yaml"))
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
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [a for a in argv if not a.startswith("-") and ("=" in a or a.startswith("~"))
                 and not a.lstrip("+~").startswith("hydra")]
    if any("," in a.partition("=")[2] and not a.partition("=")[2].startswith("[") for a in overrides):
        return  # a sweep: Hydra validates each job
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            compose(config_name=config_name, overrides=overrides)
    except Exception as e:  # noqa: BLE001 - reported as one line
        fail(compose_error(e))
    finally:
        GlobalHydra.instance().clear()


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
        unknown = re.search(r"Key '(.+?)' not in '(\w+)'", msg)
        if unknown:
            return f"{k}: unknown key ({unknown.group(2)} has no field {unknown.group(1)!r}); check the spelling"
        return f"{k}: " + " ".join(msg.split("full_key:")[0].split())
    msg = " ".join(chain[0].split())
    return msg.replace("To append to your config use +", "(unknown key; to add a new key use +")


def entry_point(config_name: str) -> Callable:
    """Decorator for ``main(cfg)`` functions: validates argv, runs Hydra, prints user errors as one line."""

    def deco(fn: Callable) -> Callable:
        import hydra

        @functools.wraps(fn)
        def task(cfg):
            try:
                return fn(cfg)
            except Exception as e:  # noqa: BLE001 - every error is one line unless debugging
                if debugging():
                    raise
                report(e)

        hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(task)

        def cli() -> None:
            argv = sys.argv[1:]
            check_grammar(argv)
            check_group_overrides(argv)
            if "-m" not in argv and "--multirun" not in argv and not any(a.startswith("--") for a in argv):
                check_keys(argv, config_name)
            try:
                hydra_main()
            except Exception as e:  # noqa: BLE001 - Hydra's own argument errors, outside the task
                if debugging():
                    raise
                fail(" ".join(str(e).split()) or type(e).__name__)

        cli.task = task  # type: ignore[attr-defined]
        return cli

    return deco
