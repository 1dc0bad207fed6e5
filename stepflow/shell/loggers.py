"""Loggers of a run (``logger/`` config group, each a ``_target_`` node): ``metrics.csv`` and offline-safe wandb."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

from stepflow.shell.checkpoint import atomic_write

__all__ = ["MetricsCSVLogger", "wandb_logger"]


class MetricsCSVLogger(Logger):
    """``<save_dir>/metrics.csv``, one row per logged step (``iteration`` first, then the metrics sorted).

    Appends while the columns are unchanged; rewrites the file (atomically) when a new column appears and after a
    resume, from the rows restored out of the checkpoint (:meth:`restore`), which are the truth.
    """

    def __init__(self, save_dir: str | os.PathLike, filename: str = "metrics.csv"):
        super().__init__()
        self.path = Path(save_dir) / filename
        self.rows: list[dict[str, float]] = []
        self._columns: list[str] | None = None
        self._written = 0

    @property
    def name(self) -> str:
        return "csv"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass  # the resolved config is the run dir's config.yaml

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({"iteration": step, **{k: float(v) for k, v in metrics.items()}})
        self._write()

    def restore(self, rows: Sequence[dict[str, float]]) -> None:
        """Replace the rows with those of a resumed run (the next write rewrites the file)."""
        self.rows = [dict(r) for r in rows]
        self._columns = None

    def _write(self) -> None:
        cols = ["iteration"] + sorted({k for r in self.rows for k in r if k != "iteration"})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if cols == self._columns and self._written <= len(self.rows):
            with self.path.open("a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=cols).writerows(self.rows[self._written:])
        else:
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=cols)
            w.writeheader()
            w.writerows(self.rows)
            atomic_write(self.path, lambda fh: fh.write(buf.getvalue().encode()))
            self._columns = cols
        self._written = len(self.rows)


def wandb_logger(save_dir: str, project: str = "stepflow", offline: bool | None = None, **kwargs: Any):
    """Lightning's ``WandbLogger``, offline when no ``WANDB_API_KEY`` is set or ``WANDB_MODE=offline`` (a run never
    stops for a missing login)."""
    from lightning.pytorch.loggers import WandbLogger

    if offline is None:
        offline = not os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") == "offline"
    return WandbLogger(project=project, save_dir=str(save_dir), offline=offline, **kwargs)
