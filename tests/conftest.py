"""Test-wide settings and fixtures only (nothing here is imported by a test module; the helpers they import live in
:mod:`stepflow.testing.harness`): never touch the network, keep torch deterministic and small, build the tiny models
once per run, compose the Hydra configs and run the entry points the way a user does.

Fixtures:

- ``root``: the checkout (:data:`stepflow.testing.harness.ROOT`);
- ``compose(config_name, overrides)``: the one Hydra composition (:func:`stepflow.testing.harness.compose_config`);
- ``cli(module, *args)``: an entry point (``stepflow.train`` / ``evaluate`` / ``pretrain`` / ``serve_reward``) run
  in-process with that command line, its exit status and output captured (``.returncode``, ``.stdout``, ``.stderr``);
- ``run_module(module, *args)``: the same in a subprocess (one test per entry point, and the multi-process tests);
- ``tiny_pipeline(kind)``: a tiny random diffusers pipeline folder (``sd3``, ``sd35_large``, ``flux_dev``,
  ``flux_schnell``, ``qwen_image``) built once per test run; ``tiny_clip_dir``: the tiny CLIP / PickScore folder;
- ``http_server(handler)``: the one fake HTTP server (:class:`stepflow.testing.harness.FakeHTTPServer`), stopped at
  the end of the test.

Every test runs with ``STEPFLOW_CACHE`` pointing at one folder of this run (shared by the xdist workers), so
``model=*_tiny`` builds each tiny pipeline once per run and never writes into ``~/.cache``.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

from stepflow.testing import harness  # noqa: E402

torch.set_num_threads(1)  # tiny models: one thread is faster and steadier on a shared 2-core machine


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests run only where CUDA is available (``pytest -m gpu`` on a GPU machine)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Every test module starts on one torch thread (a run in-process may have set ``torch_threads``)."""
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _stepflow_cache(tmp_path_factory, worker_id):
    """``$STEPFLOW_CACHE``: one folder per test run, shared by the xdist workers (the builders write atomically), so
    the tiny pipelines are built once per run, in-process and in the subprocesses alike."""
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if worker_id != "master" else base) / "stepflow-cache"
    cache.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("STEPFLOW_CACHE")
    os.environ["STEPFLOW_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("STEPFLOW_CACHE", None)
    else:
        os.environ["STEPFLOW_CACHE"] = old


@pytest.fixture(scope="session")
def worker_id(request):
    """The xdist worker (``gw0``...), ``master`` without xdist (xdist's own fixture when it is installed)."""
    return getattr(request.config, "workerinput", {}).get("workerid", "master")


@pytest.fixture(scope="session")
def root():
    """The repository checkout."""
    return harness.ROOT


@pytest.fixture(scope="session")
def compose():
    """``compose(config_name, overrides)``: a composed config (:func:`stepflow.testing.harness.compose_config`)."""
    return harness.compose_config


#: the entry points whose Hydra config has a run dir (outputs/<name>/<second>) and, for train, a sweep dir
_RUN_DIR_MODULES = ("stepflow.train", "stepflow.evaluate", "stepflow.pretrain", "stepflow.serve_reward")


def own_run_dir(module: str, args, tmp_dir) -> tuple:
    """``args`` with ``hydra.run.dir`` (``hydra.sweep.dir`` for a multirun) under ``tmp_dir`` where they name none:
    the default, outputs/<name>/<second> in the checkout, is shared by the tests that start in the same second on
    other xdist workers, and that directory's lock refuses all but the first ('in use by another run')."""
    if module not in _RUN_DIR_MODULES:
        return tuple(args)
    key = "hydra.sweep.dir=" if ("--multirun" in args or "-m" in args) else "hydra.run.dir="
    args = tuple(args)
    if any(str(a).startswith((key, f"+{key}", f"++{key}")) for a in args):
        return args
    # beside the first override: Hydra's parser takes the overrides as one run of positional arguments, so one
    # appended after a flag (`experiment=smoke --multirun --cfg job <here>`) is refused as unrecognised
    at = next((i for i, a in enumerate(args) if "=" in str(a) and not str(a).startswith("-")), len(args))
    return (*args[:at], f"{key}{tmp_dir}", *args[at:])


@pytest.fixture
def cli(monkeypatch, tmp_path_factory):
    """``cli(module, *args, cwd=None, env=None)``: ``python -m <module> <args>`` run in this process
    (:func:`stepflow.testing.harness.run_in_process`); returns ``.returncode``, ``.stdout``, ``.stderr``. A run that
    names no run dir gets its own (:func:`own_run_dir`)."""

    def call(module: str, *args: str, cwd=None, env=None, timeout=None):  # noqa: ARG001 - timeout: as run_module
        args = own_run_dir(module, args, tmp_path_factory.mktemp("run"))
        return harness.run_in_process(module, *args, cwd=cwd, env=env, monkeypatch=monkeypatch)

    return call


@pytest.fixture(scope="session")
def run_module():
    """``run_module(module, *args, timeout=300, cwd=ROOT, env=None)``: an entry point in a subprocess."""
    return harness.run_module


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """``tiny_pipeline(kind)``: the folder of a tiny random diffusers pipeline, built (``save_tiny_*``) the first
    time a test of this run asks for it. Kinds: :data:`stepflow.testing.harness.TINY_KINDS`."""
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = harness.save_tiny(kind, tmp_path_factory.mktemp(f"tiny_{kind}"))
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A tiny random CLIP (PickScore's layout) saved with ``save_pretrained``, built once per run."""
    from stepflow.testing.tiny_rewards import build_tiny_clip

    return str(build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), seed=0))


@pytest.fixture
def http_server():
    """``http_server(handler, raw=False)``: a started :class:`stepflow.testing.harness.FakeHTTPServer` (``.url``,
    ``.port``, ``.calls``), shut down after the test."""
    servers = []

    def start(handler, **kwargs):
        srv = harness.FakeHTTPServer(handler, **kwargs).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()
