"""One run per run directory: a lock naming its holder, and resumes that keep the original run's settings."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from stepflow.errors import StepflowError

__all__ = ["run_lock", "acquire", "release", "RunDirCallback", "check_resume", "global_rank", "LOCK_NAME", "RESUMABLE"]

LOCK_NAME = ".stepflow.lock"

#: settings a resume may change: how long the run goes on, how it is evaluated, CPU threads, where it logs
RESUMABLE = ("ckpt_path", "loop.iterations", "loop.budget", "eval.", "torch_threads", "logger.", "trainer.devices", "trainer.num_nodes")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def global_rank() -> int:
    """This process's global rank before Lightning is set up (from the launcher's environment)."""
    for k in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return 0


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _mine(holder: dict) -> bool:
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def acquire(run_dir: Path) -> bool:
    """Take ``<run_dir>/.stepflow.lock`` (pid, host, start time) for this process; True if it was taken now, False if
    this process already holds it. A second run on the same directory stops with one line naming the holder; a lock
    left by a process that is gone (same host) is taken over."""
    path = Path(run_dir) / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if _mine(holder):
                return False
            if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) and not _alive(holder["pid"]):
                path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            raise StepflowError(f"hydra.run.dir: {run_dir} is in use by another run (pid {holder.get('pid', '?')} on "
                                f"{holder.get('host', '?')} since {holder.get('since', '?')}); give this run its own "
                                f"hydra.run.dir, or stop that run (a stale lock: delete {path})") from None
        with os.fdopen(fd, "w") as fh:
            json.dump(me, fh)
        return True
    raise StepflowError(f"hydra.run.dir: cannot take the lock {path}; delete it if no run uses {run_dir}")


def release(run_dir: Path) -> None:
    """Drop ``<run_dir>/.stepflow.lock`` if this process holds it (never another run's)."""
    path = Path(run_dir) / LOCK_NAME
    if _mine(_holder(path)):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def run_lock(run_dir: Path):
    """Hold ``<run_dir>/.stepflow.lock`` for the context (:func:`acquire`; a lock this process took already, in
    :class:`RunDirCallback`, is kept and dropped at the end). Only global rank 0 locks (the other ranks of a
    distributed run share rank 0's directory)."""
    if global_rank() != 0:
        yield
        return
    acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir)


try:
    from hydra.experimental.callback import Callback as _Callback
except ImportError:  # pragma: no cover - Hydra is a dependency; the class only needs a base
    _Callback = object


class RunDirCallback(_Callback):
    """Hydra callback (``hydra.callbacks.run_dir`` in the entry points' configs): before Hydra writes anything into
    ``hydra.run.dir`` (``.hydra/config.yaml``, ``overrides.yaml``, the job's log), create it (one line when it cannot
    be) and, with ``lock``, take its run lock, so a refused second run leaves the running run's record untouched.
    The lock is held until the process ends (:func:`run_lock` of :func:`stepflow.train.run` drops it after the run).
    Multirun jobs get their own subdirectories and are locked by :func:`run_lock` only."""

    def __init__(self, lock: bool = True) -> None:
        self.lock = bool(lock)

    @staticmethod
    def _create(config: DictConfig, key: str) -> Path:
        from stepflow.cli import fail

        d = Path(str(OmegaConf.select(config, key))).expanduser()
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"{key}: cannot create {d} ({e.strerror or type(e).__name__}: {e.filename or d}); give a directory "
                 f"that can be written, {key}=<dir>")
        return d

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._create(config, "hydra.sweep.dir")

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        import atexit

        from stepflow.cli import fail

        run_dir = self._create(config, "hydra.run.dir")
        if not self.lock or global_rank() != 0:
            return
        try:
            if acquire(run_dir):
                atexit.register(release, run_dir)
        except StepflowError as e:
            fail(str(e))


def _flat(d, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _effective(container: dict) -> dict:
    """The typed groups of a training config as their dataclasses resolve them: a field a later stepflow added is
    its default, a null that resolves per option is its value (``sampler.eta`` null → the sampler's own η). A group
    its dataclass no longer accepts stays as written (the comparison then names it)."""
    import dataclasses

    from stepflow.advantage import AdvantageConfig
    from stepflow.config import LoopConfig, ObjectiveConfig, TrainConfig
    from stepflow.sde import SamplerConfig
    from stepflow.window import WindowConfig

    if "loop" not in container and "train" not in container:  # not a training config (pretrain's): as written
        return container
    out = dict(container)
    for key, cls in (("loop", LoopConfig), ("train", TrainConfig), ("sampler", SamplerConfig),
                     ("advantage", AdvantageConfig), ("objective", ObjectiveConfig), ("window", WindowConfig)):
        group = container.get(key, {})
        if isinstance(group, dict):
            try:
                out[key] = dataclasses.asdict(cls(**group))
            except (TypeError, ValueError):
                pass
    return out


def check_resume(cfg: DictConfig, run_dir: Path, resumable: tuple[str, ...] | None = None) -> None:
    """A resume must keep the settings of ``<run_dir>/config.yaml`` except those in ``resumable`` (prefixes; default
    :data:`RESUMABLE`); the original config.yaml is never rewritten. The resumed settings go to
    ``config.resume.yaml``. Settings are compared as the typed groups resolve them, so a run written before a field
    existed resumes when the field keeps its default (:func:`_effective`)."""
    if resumable is None:
        resumable = RESUMABLE
    saved = Path(run_dir) / "config.yaml"
    new = OmegaConf.to_container(cfg, resolve=True)
    if saved.is_file():
        old = _flat(_effective(OmegaConf.to_container(OmegaConf.load(saved), resolve=True)))
        cur = _flat(_effective(new))
        changed = [k for k in sorted(set(old) | set(cur)) if old.get(k, "<unset>") != cur.get(k, "<unset>")
                   and not any(k == r or (r.endswith(".") and k.startswith(r)) for r in resumable)]
        if changed:
            k = changed[0]
            raise StepflowError(f"ckpt_path: this resume changes {k} ({old.get(k, '<unset>')!r} -> "
                                f"{cur.get(k, '<unset>')!r}) from the run's config.yaml ({len(changed)} setting(s) "
                                "differ); resume with the run's own overrides (only loop.iterations, eval.*, "
                                "torch_threads, logger.* may change) or start a new run")
    if global_rank() == 0:
        OmegaConf.save(OmegaConf.create(new), Path(run_dir) / "config.resume.yaml")
