"""Checkpoints that survive a kill: written to a temporary file and renamed into place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to ``<path>.tmp`` then ``os.replace``: a kill never leaves a truncated checkpoint."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            torch.save(checkpoint, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def checkpoint_callback(dirpath: str | Path) -> ModelCheckpoint:
    """``last.ckpt`` after every iteration (epoch)."""
    return ModelCheckpoint(dirpath=str(dirpath), filename="iter_{epoch:04d}", save_last=True, save_top_k=1,
                           every_n_epochs=1, save_on_train_epoch_end=True, enable_version_counter=False,
                           auto_insert_metric_name=False)
