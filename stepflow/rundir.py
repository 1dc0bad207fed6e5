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

__all__ = ["run_lock", "writable_dir", "acquire", "release", "RunDirCallback", "check_resume", "global_rank", "LOCK_NAME", "RESUMABLE"]

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
        try:  # a read-only directory: one line here, not the traceback of Hydra's log file handler
            writable_dir(d, key)
        except StepflowError as e:
            fail(str(e))
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


def writable_dir(path, field: str) -> Path:
    """``path`` made a directory that this process can write into (a probe file written and removed: a read-only
    directory or file system stops even root here), or one line naming ``field`` and the fix."""
    import tempfile

    d = Path(str(path)).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        why = "a file is in its way" if isinstance(e, (FileExistsError, NotADirectoryError)) else (
            e.strerror or type(e).__name__)
        raise StepflowError(f"{field}: cannot write into {d} ({why}: {e.filename or d}); give a directory that can be "
                            f"written, {field}=<dir>") from None
    return d


def _flat(d, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _effective(container: dict) -> dict:
    """The typed groups of a training config as they resolve: ``loop`` and ``train`` through their dataclasses (a
    field a later stepflow added is its default), the parts (sampler, advantage, objective, window) through their
    classes (every field the built part holds, defaults included, and its ``_target_``). A group that no longer
    builds stays as written (the comparison then names it)."""
    import dataclasses

    from stepflow.config import LoopConfig, TrainConfig
    from stepflow.core.parts import build_part
    from stepflow.errors import StepflowError

    if "loop" not in container and "train" not in container:  # not a training config (pretrain's): as written
        return container
    out = dict(container)
    for key, cls in (("loop", LoopConfig), ("train", TrainConfig)):
        group = container.get(key, {})
        if isinstance(group, dict):
            try:
                out[key] = dataclasses.asdict(cls(**group))
            except (TypeError, ValueError):
                pass
    for key in ("sampler", "advantage", "objective", "window"):
        group = container.get(key)
        if isinstance(group, dict) and group.get("_target_"):
            try:
                part = build_part(key, group)
            except StepflowError:
                continue
            fields = {k: v for k, v in vars(part).items() if not k.startswith("_")
                      and isinstance(v, (int, float, str, bool, type(None), list, tuple))}
            out[key] = {"_target_": group["_target_"], **{k: list(v) if isinstance(v, tuple) else v
                                                         for k, v in fields.items()}}
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


def resolve_ckpt(ckpt, run_dir: Path) -> Path | None:
    """``ckpt_path``: a file, or ``auto`` = ``<run dir>/checkpoints/last.ckpt`` when it exists (a requeued job resumes
    itself; a first start begins fresh)."""
    if not ckpt:
        return None
    if str(ckpt) == "auto":
        last = run_dir / "checkpoints" / "last.ckpt"
        return last if last.is_file() else None
    ckpt = Path(str(ckpt)).expanduser()
    if not ckpt.is_file():
        raise StepflowError(f"ckpt_path: checkpoint not found: {ckpt} (point it at <run dir>/checkpoints/last.ckpt)")
    return ckpt


def resume_command(last: Path) -> str:
    """The command line that resumes this run: the original overrides plus ``ckpt_path``."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("ckpt_path=", "hydra."))]
    except (ValueError, ImportError):  # not under a Hydra entry point (tests, notebooks)
        overrides = []
    return " ".join(["python -m stepflow.train", *overrides, f"ckpt_path={last}"])


def summary_line(history: list[dict], run_dir: Path) -> str:
    """One line for the end of a run: iterations, held-out metrics first -> last, NFEs and where the outputs are."""
    evals = [h for h in history if any(k.startswith("eval/") for k in h)]
    per_category = ("eval/geneval_", "eval/exact_scene_", "eval/extra_objects_")  # the overall values only
    keys = sorted({k for h in evals for k in h if k.startswith("eval/") and not k.startswith(per_category)})
    parts = []
    for k in keys:
        at = [(int(h["iteration"]), h[k]) for h in evals if k in h]
        if at:
            since = f" (from iteration {at[0][0]})" if at[0][0] else ""  # eval.at_start=false: no base evaluation
            parts.append(f"{k} {at[0][1]:.3f} -> {at[-1][1]:.3f} ({at[-1][1] - at[0][1]:+.3f}{since})")
    its = max((int(h["iteration"]) for h in history), default=0)
    nfe = max((h.get("cost/nfe_total", 0) for h in history), default=0)
    equiv = max((h.get("cost/nfe_fwd_equiv_total", 0) for h in history), default=0)
    secs = sum(h.get("time/iteration_s", 0.0) for h in history)
    head = f"stepflow: {its} iterations, {secs:.0f} s training, {int(nfe):,} NFEs"
    if equiv > nfe:  # what a budget counts: a backward pass as two forwards
        head += f" ({int(equiv):,} forward-equivalent)"
    return "; ".join([head, *parts, f"outputs in {run_dir}"])


@contextlib.contextmanager
def tidied_if_unstarted(run_dir: Path, fresh: bool, record: Path | None = None):
    """A run that fails before it writes a checkpoint leaves behind only what explains why: ``train.log`` holds the
    error line. A fresh run (``fresh``) also keeps Hydra's record (``.hydra/``); the ``config.yaml`` it wrote and the
    folders it left empty go. A resume leaves the run as it found it, but for the log: ``record`` (this invocation's
    Hydra record, ``.hydra/resume_<time>/``) goes and ``config.resume.yaml`` is what it was before. Results a fresh
    run wrote (a start evaluation's metrics and grid) stay."""
    last, resumed = run_dir / "checkpoints" / "last.ckpt", run_dir / "config.resume.yaml"
    before = last.stat().st_mtime_ns if last.exists() else None
    resumed_before = None if fresh or not resumed.is_file() else resumed.read_bytes()
    try:
        yield
    except BaseException:
        started = last.exists() and last.stat().st_mtime_ns != before
        if not started and global_rank() == 0:
            if fresh:
                (run_dir / "config.yaml").unlink(missing_ok=True)
                for d in sorted((p for p in run_dir.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                    if not any(d.iterdir()):
                        d.rmdir()
            else:  # config.resume.yaml: the settings of the run's last resume that trained, not of this one
                if resumed_before is None:
                    resumed.unlink(missing_ok=True)
                else:
                    resumed.write_bytes(resumed_before)
                if record is not None and record.is_dir() and record.parent.name == ".hydra":
                    import shutil

                    shutil.rmtree(record, ignore_errors=True)
        raise
