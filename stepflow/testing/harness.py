"""The test harness, importable (``tests/conftest.py`` holds fixtures only and wraps these):

- :func:`compose_config`: the tests' door to :func:`stepflow.config.compose` (the one Hydra composition of
  ``stepflow/conf/<config_name>.yaml``); tests call it or request the ``compose`` fixture, never
  ``initialize_config_dir``; :func:`smoke_config`: the ``train`` config of ``experiment=smoke`` with overrides;
- :func:`run_in_process`: ``python -m <module> <args>`` run in this process (the ``cli`` fixture): exit status,
  stdout and stderr as a subprocess would give them, without the seconds of a fresh interpreter's imports;
- :func:`run_module`: the same in a subprocess, offline (one test per entry point, and the multi-process tests);
- :func:`save_tiny`: a tiny random pipeline folder of one kind (:data:`TINY_KINDS`, the ``tiny_pipeline`` fixture);
- :func:`random_config_policies` / :func:`train_random_config_once`: a ``model=*_random`` config (the GPU checks'
  random builders) built by the training CLI's own path, tiny on the CPU and at full size on the meta device, and
  one CLI iteration of it at tiny size (gpu_check.sh's command line);
- :class:`FakeHTTPServer`: the one programmable HTTP server of the tests (the ``http_server`` fixture).

``ROOT``: the repository checkout these tests run in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compose_config(config_name: str = "train", overrides: Iterable[str] = (), return_hydra_config: bool = False):
    """Compose ``stepflow/conf/<config_name>.yaml`` with ``overrides`` (as the entry point would, minus the run):
    :func:`stepflow.config.compose`, the one composition stepflow has, with the tests' default ``train``."""
    from stepflow.config import compose

    return compose(config_name, list(overrides), return_hydra_config=return_hydra_config)


def smoke_config(*overrides: str):
    """The ``train`` config of the CPU smoke experiment with ``overrides`` on top: ``compose_config("train",
    ["experiment=smoke", *overrides])``, the tests' starting point for a run of the loop on the tiny shapes model."""
    return compose_config("train", ["experiment=smoke", *overrides])


def run_module(module: str, *args: str, timeout: int = 300, cwd: Path | str = ROOT, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` in a subprocess, offline, capturing its output (text)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


#: the name the tests use for the subprocess run
run_cli = run_module


@dataclasses.dataclass
class Completed:
    """What :func:`run_in_process` gives: the fields of ``subprocess.CompletedProcess`` the tests read."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_in_process(module: str, *args: str, cwd: Path | str | None = None, env: dict | None = None,
                   monkeypatch=None) -> Completed:
    """``python -m <module> <args>`` in this process: ``sys.argv`` set, ``main()`` of the module called, its
    ``SystemExit`` status (an uncaught exception: 1 and the traceback on stderr, as Python's) and output captured.

    ``env``: variables set for the call; ``cwd``: the working folder for the call (``monkeypatch`` restores both when
    given, else they are restored here). Hydra's and stepflow's process-wide state (the global Hydra, the
    ``HydraConfig`` of the run, the multirun job list, the stop flag, torch's threads) is reset afterwards.
    """
    mod = importlib.import_module(module)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    own = monkeypatch is None
    if own:
        import pytest

        monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.setattr(sys, "argv", [module, *args])
        for k, v in (env or {}).items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, str(v))
        if cwd is not None:
            monkeypatch.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                mod.main()
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:  # noqa: BLE001 - what Python prints for an uncaught exception
                traceback.print_exc()
                code = 1
    finally:
        _reset_process_state()
        if own:
            monkeypatch.undo()
    return Completed([module, *args], code, out.getvalue(), err.getvalue())


def _reset_process_state() -> None:
    import torch
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from stepflow import cli
    from stepflow.core import stop

    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None
    cli.JOBS.clear()
    stop.clear()
    torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------- tiny pipelines
#: the tiny pipeline kinds: kind -> (family, variant) of :mod:`stepflow.testing.tiny_policies`
TINY_KINDS = {
    "sd3": ("sd3", "medium"),
    "sd35_large": ("sd3", "large"),
    "flux_dev": ("flux", "dev"),
    "flux_schnell": ("flux", "schnell"),
    "qwen_image": ("qwen_image", ""),
}


def save_tiny(kind: str, directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny random pipeline of ``kind`` (:data:`TINY_KINDS`) into ``directory``."""
    from stepflow.testing import tiny_policies as tiny

    family, variant = TINY_KINDS[kind]
    if family == "sd3":
        return tiny.save_tiny_sd3(directory, seed, variant)
    if family == "flux":
        return tiny.save_tiny_flux(directory, seed, variant)
    return tiny.save_tiny_qwen_image(directory, seed)


# ------------------------------------------------------------------------------------------------ fake HTTP server
@dataclasses.dataclass
class Reply:
    """A fake server's answer: status, body (bytes as they are; anything else as JSON), headers, delay before."""

    status: int = 200
    body: object = b""
    content_type: str = "application/json"
    delay_s: float = 0.0


class FakeHTTPServer:
    """The tests' one programmable HTTP server on 127.0.0.1 (a free port): every ``POST`` calls
    ``handler(n, path, headers, body_bytes)`` (``n``: the request's number) and answers the :class:`Reply` (or
    ``(status, body[, delay_s])``) it returns; ``handler=None`` accepts requests and never answers (a hung service).
    ``calls``: ``{"path", "headers", "data"}`` of every request. ``with FakeHTTPServer(h) as s`` starts and stops it.
    """

    def __init__(self, handler: Callable | None):
        self.calls: list[dict] = []
        self._hang = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                n = len(outer.calls)
                outer.calls.append({"path": self.path, "headers": dict(self.headers), "data": data})
                if handler is None:
                    outer._hang.wait(600)
                    return
                reply = handler(n, self.path, self.headers, data)
                if not isinstance(reply, Reply):
                    reply = Reply(*reply[:2], delay_s=reply[2] if len(reply) > 2 else 0.0)
                time.sleep(reply.delay_s)
                import json

                body = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", reply.content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def start(self) -> FakeHTTPServer:
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def stop(self) -> None:
        self._hang.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeHTTPServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def one_line_error(r, needle: str) -> str:
    """The run ended non-zero with exactly one line ``stepflow: error: ...`` naming ``needle``, no traceback; returns
    that line (``r``: a finished process or the ``cli`` fixture's result)."""
    assert r.returncode != 0, r.stdout[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("stepflow: error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert needle in errors[0], errors[0]
    return errors[0]


def last_train_metrics(module) -> dict[str, float]:
    """The ``train/`` metrics of a module's last iteration (its history's last row that has any: the final
    evaluation's row has none)."""
    for row in reversed(module.history):
        train = {k: v for k, v in row.items() if k.startswith("train/")}
        if train:
            return train
    raise AssertionError("no iteration logged train/ metrics")


#: a ``model=*_random`` config at tiny size on the CPU in fp32
RANDOM_TINY = ("model.tiny=true", "model.dtype=float32", "model.device=cpu")


def random_config_policies(name: str, *overrides: str, full_size: bool = True):
    """``(tiny, big)``: ``model=<name>`` (a ``*_random`` config) built by the training CLI's own path
    (``stepflow.train.build_policy``: instantiate, then the lora group's adapter) at tiny size on the CPU, and at the
    published size on the meta device (no memory; ``None`` with ``full_size=False``); ``overrides`` go to the tiny
    one."""
    from stepflow.train import build_policy

    tiny = build_policy(compose_config("train", [f"model={name}", *RANDOM_TINY, *overrides]))
    big = build_policy(compose_config("train", [f"model={name}", "model.device=meta"])) if full_size else None
    return tiny, big


def base_parameters(module) -> int:
    """The number of a module's parameters outside its LoRA adapter."""
    return sum(p.numel() for n, p in module.named_parameters() if "lora_" not in n)


def train_random_config_once(run_dir: Path, name: str, finetune: str) -> None:
    """One iteration of ``model=<name>`` at tiny size through the training CLI, as gpu_check.sh runs it (a stand-in
    reward, the peak-memory callback): a trained step, ``memory.csv`` rows ``start`` and ``1``, and the run's weights
    (a LoRA adapter and the checkpoint, or for ``finetune=full`` with ``save_weights=false`` only the NOT_SAVED
    marker and no checkpoint)."""
    import csv

    extra = ["model.save_weights=false", "callbacks.checkpoint=null"] if finetune == "full" else []
    r = run_in_process("stepflow.train", f"model={name}", *RANDOM_TINY, f"model.finetune={finetune}", *extra,
                       "~reward=shapes_geneval", "+reward._target_=stepflow.testing.random_policies.StandInReward",
                       "+callbacks.memory._target_=stepflow.testing.random_policies.peak_memory_callback",
                       "loop.iterations=1", "loop.prompts_per_iter=1", "loop.group_size=4", "loop.num_steps=3",
                       "loop.substeps=1", "train.micro_batch_size=4", "train.beta_kl=0.04", "advantage=gain",
                       "sampler=flow_sde", "eval.max_prompts=2", "eval.num_steps=2", "eval.grid_prompts=2",
                       f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [x for x in csv.DictReader((run_dir / "metrics.csv").open()) if x.get("time/iteration_s")]
    assert len(rows) == 1 and float(rows[0]["train/steps_trained"]) > 0
    mem = list(csv.DictReader((run_dir / "memory.csv").open()))
    assert [m["iteration"] for m in mem] == ["start", "1"] and float(mem[1]["wall_s"]) > 0
    if finetune == "full":
        assert (run_dir / "transformer" / "NOT_SAVED.txt").is_file()
        assert not (run_dir / "checkpoints").exists()
    else:
        assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()
        assert (run_dir / "checkpoints" / "last.ckpt").is_file()
