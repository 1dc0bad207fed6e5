"""Checkpoints that survive a kill, a full disk and a crafted file.

- :class:`AtomicCheckpointIO` writes to a temporary file unique to the process and renames it into place (a kill
  never leaves a truncated checkpoint, two writers never share a temporary name); a full disk is one line and leaves
  no temporary file behind. It loads with ``torch.load(weights_only=True)`` only.
- :class:`IterationCheckpoint` writes ``checkpoints/last.ckpt`` after every finished GRPO iteration, whether or not
  the optimizer stepped in it (an iteration whose advantages were all zero takes no step), and keeps
  ``iter_XXXX.ckpt`` every ``keep_every`` iterations.
- :func:`safe_load` is the one way stepflow reads a checkpoint a user hands it (never unpickling code; a file that
  is no checkpoint at all, empty or random bytes or truncated, is told apart from one that would need code);
- :func:`check_compatible` refuses, in one line, a checkpoint of another model (other keys or shapes) before
  Lightning restores weights and optimizer state from it.
"""

from __future__ import annotations

import errno
import os
import pickle
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO

from stepflow.errors import StepflowError

__all__ = ["AtomicCheckpointIO", "IterationCheckpoint", "atomic_write", "check_compatible", "checkpoint_callback",
           "safe_load"]


#: what a message about a checkpoint that cannot be resumed tells the user to do
RESUME_FIX = "point it at <run dir>/checkpoints/last.ckpt"


def safe_load(path: str | os.PathLike, field: str, map_location: Any = "cpu", fix: str = RESUME_FIX) -> Any:
    """``torch.load(path, weights_only=True)``: tensors, containers and plain values only. A file that would need
    code to unpickle is refused with one line naming ``field`` and the path (its payload is never run); a file that
    is no checkpoint at all (empty, random bytes, truncated) is one line saying so, ending in ``fix``."""
    from stepflow.rewards.loading import _refusal, _short, not_a_torch_file

    p = Path(path).expanduser()
    if not p.is_file():
        raise StepflowError(f"{field}: checkpoint not found: {p}; {fix}")
    why = not_a_torch_file(p)
    if why is None:
        try:
            with warnings.catch_warnings():  # "Detected pickle protocol 4": the refusal below says what matters
                warnings.simplefilter("ignore", UserWarning)
                return torch.load(str(p), map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:  # a pickle of something other than tensors and plain values
            raise StepflowError(f"{field}: {p} cannot be loaded as a checkpoint without running code from it "
                                f"(torch.load(weights_only=True) refused it: {_refusal(e)}); pass a checkpoint "
                                "stepflow wrote") from None
        except Exception as e:  # noqa: BLE001 - EOFError, RuntimeError: a torch file cut short or corrupted
            why = f"not a torch file: truncated or corrupted, {_short(e)}"
    raise StepflowError(f"{field}: {p} is not a checkpoint ({why}); {fix}")


def _shape(value: Any) -> tuple[int, ...]:
    """A tensor's shape (``torch.Size``, a DTensor's global shape) or a shape given as a sequence, as a tuple."""
    shape = getattr(value, "shape", value)
    return tuple(int(n) for n in shape)


def check_compatible(checkpoint: Any, expected: Mapping[str, Any], path: str | os.PathLike = "",
                     field: str = "ckpt_path", needs: Sequence[str] = ()) -> None:
    """Refuse, with one line, a checkpoint whose ``state_dict`` is not the module's: another model, another LoRA
    rank or targets, full fine-tuning vs LoRA. ``expected``: the module's ``state_dict()`` (or key -> shape);
    ``needs``: other top-level entries the checkpoint must have (``"stepflow"`` for a GRPO run). The message names
    ``field``, the first key that differs (in the module's key order, then the checkpoint's) and how many do."""
    where = str(path) or "the checkpoint"
    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise StepflowError(f"{field}: {where} is not a training checkpoint (no state_dict); {RESUME_FIX}")
    missing = [k for k in needs if k not in checkpoint]
    if missing:
        raise StepflowError(f"{field}: {where} is not a checkpoint of this kind of run (no {missing[0]!r} entry: "
                            f"written by another program?); {RESUME_FIX}")
    got = {k: _shape(v) for k, v in checkpoint["state_dict"].items()}
    want = {k: _shape(v) for k, v in expected.items()}
    diffs = []
    for k in [*want, *(k for k in got if k not in want)]:
        if k not in got:
            diffs.append(f"{k}: in the model, not in the checkpoint")
        elif k not in want:
            diffs.append(f"{k}: in the checkpoint, not in the model")
        elif got[k] != want[k]:
            diffs.append(f"{k}: shape {list(got[k])} in the checkpoint vs {list(want[k])} in the model")
    if diffs:
        n = f"{len(diffs)} key{'s' if len(diffs) > 1 else ''} differ{'' if len(diffs) > 1 else 's'}"
        raise StepflowError(f"{field}: {where} holds a checkpoint of another model ({diffs[0]}; {n}); resume with "
                            "the run's own model settings (model=..., lora.rank, lora.targets, model.finetune of its "
                            "config.yaml)")


def atomic_write(path: str | os.PathLike, write) -> None:
    """``write(fh)`` into a temporary file next to ``path`` (unique per process and call), fsync, rename into place.
    A full disk (or quota) raises one line and removes the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if _disk_full(e, path.parent):
            raise StepflowError(f"disk full writing {path}; free space in {path.parent} and resume from the last "
                                "checkpoint (the previous one is intact)") from None
        raise


def _disk_full(e: BaseException, where: Path) -> bool:
    """ENOSPC / EDQUOT, or torch.save's own write failure ("unexpected pos", "file write failed") on a disk with
    less than 64 MiB free."""
    import shutil

    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, RuntimeError) and any(s in str(e) for s in ("unexpected pos", "write failed", "No space left")):
        try:
            return shutil.disk_usage(where).free < 64 << 20
        except OSError:
            return True
    return False


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O through :func:`atomic_write` and :func:`safe_load`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        atomic_write(path, lambda fh: torch.save(checkpoint, fh))

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        return safe_load(path, "ckpt_path", map_location=map_location or "cpu")


class IterationCheckpoint(Callback):
    """``<dirpath>/last.ckpt`` after every finished iteration (and ``iter_XXXX.ckpt`` every ``keep_every``)."""

    def __init__(self, dirpath: str | os.PathLike, keep_every: int = 0):
        if keep_every < 0:
            raise ValueError(f"callbacks.checkpoint.keep_every: must be >= 0 (0 = only last.ckpt), got {keep_every}")
        self.dirpath = Path(dirpath)
        self.keep_every = int(keep_every)
        self._saved_iteration: int | None = None

    @property
    def last(self) -> Path:
        return self.dirpath / "last.ckpt"

    def save(self, trainer, pl_module) -> None:
        """Write last.ckpt unless it already holds this iteration (every rank calls; rank 0 writes)."""
        it = int(getattr(pl_module, "iteration", trainer.current_epoch + 1))
        if it == self._saved_iteration or it == 0:
            return
        trainer.save_checkpoint(str(self.last), weights_only=False)  # the whole state: an exact resume
        if self.keep_every and it % self.keep_every == 0:
            trainer.save_checkpoint(str(self.dirpath / f"iter_{it:04d}.ckpt"), weights_only=False)
        self._saved_iteration = it

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.save(trainer, pl_module)


def checkpoint_callback(dirpath: str | os.PathLike, keep_every: int = 0) -> IterationCheckpoint:
    """The ``callbacks.checkpoint`` node of conf/train.yaml."""
    return IterationCheckpoint(dirpath, keep_every)
