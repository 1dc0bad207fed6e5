"""Load an ``experiments/<name>.py`` script as a module (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load_experiment(name: str):
    """``experiments/<name>.py`` as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
