"""Shared plumbing of the Hydra entry points: one-line errors for bad overrides and bad values."""

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
    """A user-facing configuration or input error, printed as one line."""


def fail(msg: str) -> NoReturn:
    """Exit with a one-line error (exit code 2)."""
    first = str(msg).strip().splitlines()[0] if str(msg).strip() else "error"
    print(f"stepflow: error: {first}", file=sys.stderr)
    raise SystemExit(2)


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


def check_keys(argv: list[str], config_name: str, conf_dir: Path = CONF_DIR) -> None:
    """Compose the config once with the command line's plain overrides, so that what the structured configs reject
    (an unknown key, a value of the wrong type) is reported as one line instead of Hydra's multi-line message."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [a for a in argv if not a.startswith("-") and "=" in a and not a.lstrip("+~").startswith("hydra")]
    if any("," in a.partition("=")[2] and not a.partition("=")[2].startswith("[") for a in overrides):
        return  # a sweep: Hydra validates each job
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            compose(config_name=config_name, overrides=overrides)
    except Exception as e:  # noqa: BLE001 - reported as one line
        msg = " ".join(str(e).split())
        fail(msg.replace("To append to your config use +", "(unknown key; to add a new key use +"))
    finally:
        GlobalHydra.instance().clear()


def entry_point(config_name: str) -> Callable:
    """Decorator for ``main(cfg)`` functions: validates argv, runs Hydra, prints user errors as one line."""

    def deco(fn: Callable) -> Callable:
        import hydra

        @functools.wraps(fn)
        def task(cfg):
            try:
                return fn(cfg)
            except (StepflowError, ValueError, FileNotFoundError, KeyError) as e:
                if os.environ.get("STEPFLOW_TRACEBACK"):
                    raise
                fail(str(e) or type(e).__name__)

        hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(task)

        def cli() -> None:
            argv = sys.argv[1:]
            check_group_overrides(argv)
            if "-m" not in argv and "--multirun" not in argv and not any(a.startswith("--") for a in argv):
                check_keys(argv, config_name)
            hydra_main()

        cli.task = task  # type: ignore[attr-defined]
        return cli

    return deco
