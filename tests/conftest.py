"""Test-wide settings and fixtures: never touch the network, keep torch deterministic and small, compose the Hydra
configs and run the entry points the way a user does."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny models: one thread is faster and steadier on a shared 2-core machine

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Every test module starts on one torch thread (a run in-process may have set ``torch_threads``)."""
    torch.set_num_threads(1)
    yield


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests run only where CUDA is available (``pytest -m gpu`` on a GPU machine)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def compose_config(config_name: str = "train", overrides=(), return_hydra_config: bool = False):
    """Compose ``stepflow/conf/<config_name>.yaml`` with ``overrides`` (as the entry point would, minus the run)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from stepflow.cli import CONF_DIR

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)
    finally:
        GlobalHydra.instance().clear()


@pytest.fixture
def compose():
    """``compose(config_name, overrides)``: a composed config (see :func:`compose_config`)."""
    return compose_config


def run_cli(module: str, *args: str, timeout: int = 300, cwd: Path | str = ROOT, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` in a subprocess, offline, capturing its output."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def cli():
    """``cli(module, *args, timeout=...)``: run an entry point in a subprocess (see :func:`run_cli`)."""
    return run_cli
