"""The embedded world's reward: the shapes judge as a :class:`~stepflow.rewards.base.Reward`.

``scores`` is the judge's partial credit in [0, 1] (fraction of satisfied GenEval checks; counting
``0.5 ** |count error|``), or its strict 0/1 GenEval correctness with ``mode="strict"``. Components (all (B,)):
``strict`` (0/1), ``partial``, ``n_objects`` (detections), ``extra_objects`` (detections the prompt does not ask for)
and ``exact_scene`` (0/1: strict and no extra object; :func:`stepflow.shapes.detector.extra_objects`; neither enters
the scores). The rules are GenEval's (colour and position on the most
confident detections, a counting threshold, exclude lines; see :mod:`stepflow.shapes.detector`).

What is judged: the GenEval metadata of a sample (``meta[i]`` with an ``include`` list, plus ``tag`` and optional
``exclude``; every record of the world's prompt files carries it, and ``python -m stepflow.serve_reward
reward=shapes_geneval`` passes the client's ``meta`` through), else the prompt text, a string of the
:mod:`stepflow.shapes.prompts` grammar. An unknown prompt or malformed metadata raises a one-line ValueError naming it.

:func:`geneval_table` is the evaluation metric: GenEval's overall score = mean over categories of the per-category
strict accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from stepflow.rewards.base import Reward, RewardOut
from stepflow.shapes import CATEGORIES
from stepflow.shapes import detector as _det
from stepflow.shapes.detector import FG_THRESHOLD

__all__ = ["ShapesGenEvalReward", "geneval_table", "table_from_strict", "table_from_values", "judge_batch"]


def _to_hwc_batch(images) -> np.ndarray:
    """(B, 3, H, W) torch/numpy or (B, H, W, 3) numpy -> (B, H, W, 3) float32 numpy in [0, 1]."""
    if isinstance(images, Tensor):
        images = images.detach().float().cpu().numpy()
    a = np.asarray(images, dtype=np.float32)
    if a.ndim != 4:
        raise ValueError(f"shapes_geneval: images must be (B, 3, H, W) (or (B, H, W, 3)), got shape {a.shape}")
    if a.shape[1] == 3 and a.shape[-1] != 3:
        a = np.moveaxis(a, 1, -1)
    return np.clip(a, 0.0, 1.0)


def _specs(prompts: Sequence[str], meta: Sequence[dict[str, Any] | None] | None) -> list:
    """What to judge per sample: its GenEval metadata when the record carries an ``include`` list, else the prompt."""
    if meta is None:
        return list(prompts)
    if len(meta) != len(prompts):
        raise ValueError(f"shapes_geneval: {len(prompts)} prompts but {len(meta)} meta records")
    return [m if isinstance(m, dict) and "include" in m else p for p, m in zip(prompts, meta)]


def judge_batch(images, prompts: Sequence[str], threshold: float = FG_THRESHOLD, min_area: int | None = None,
                meta: Sequence[dict[str, Any] | None] | None = None):
    """Judge each (image, prompt / metadata) pair: a list of :class:`~stepflow.shapes.detector.JudgeResult`."""
    arr = _to_hwc_batch(images)
    if len(prompts) != arr.shape[0]:
        raise ValueError(f"shapes_geneval: {arr.shape[0]} images but {len(prompts)} prompts")
    return _det.judge_batch(arr, _specs(prompts, meta), threshold=threshold, min_area=min_area)  # checks specs first


def geneval_table(images, prompts: Sequence[str], meta: Sequence[dict[str, Any] | None] | None = None,
                  **judge_kwargs) -> dict[str, float]:
    """Strict accuracy per category (``geneval_<category>``, for the categories present; the category is the
    metadata's ``tag``) and ``geneval``, their unweighted mean (as GenEval computes its overall score)."""
    specs = [_det.geneval_meta(s) for s in _specs(prompts, meta)]
    results = judge_batch(images, prompts, meta=specs, **judge_kwargs)
    return table_from_strict([m["tag"] for m in specs], [float(r.strict) for r in results])


def table_from_strict(tags: Sequence[str], strict: Sequence[float]) -> dict[str, float]:
    """GenEval's aggregation of per-sample strict verdicts: the accuracy per category (``geneval_<tag>``) and
    ``geneval``, the unweighted mean of the categories present."""
    per: dict[str, list[float]] = {}
    for t, s in zip(tags, strict):
        per.setdefault(t, []).append(float(s))
    order = [c for c in CATEGORIES if c in per] + [c for c in per if c not in CATEGORIES]
    table = {f"geneval_{c}": float(np.mean(per[c])) for c in order}
    return {"geneval": float(np.mean(list(table.values()))) if table else 0.0, **table}


def table_from_values(name: str, tags: Sequence[str], values: Sequence[float]) -> dict[str, float]:
    """Any per-sample value aggregated as GenEval aggregates its verdicts (:func:`table_from_strict`): the mean per
    category (``<name>_<tag>``) and ``<name>``, the unweighted mean of the categories present."""
    return {k.replace("geneval", name, 1): v for k, v in table_from_strict(tags, values).items()}


class ShapesGenEvalReward(Reward):
    """Partial-credit GenEval reward of the embedded shapes world (deterministic, CPU, no weights).

    Args:
        mode: ``"partial"`` (default; the RL reward) or ``"strict"`` (0/1 GenEval correctness) as ``scores``.
        threshold: foreground threshold of the detector (RGB distance from the background, [0, 1] units).
        min_area: smallest object in pixels (default: 8 px at 32 x 32, scaled with the image area).
        batch_size: images per :meth:`score` call.
    """

    name = "shapes_geneval"

    def __init__(self, mode: str = "partial", threshold: float = FG_THRESHOLD, min_area: int | None = None,
                 batch_size: int = 256):
        if mode not in ("partial", "strict"):
            raise ValueError(f"shapes_geneval: mode must be 'partial' or 'strict', got {mode!r}")
        self.mode = mode
        self.threshold = float(threshold)
        self.min_area = None if min_area is None else int(min_area)
        self.batch_size = int(batch_size)

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict[str, Any]] | None = None) -> RewardOut:
        res = judge_batch(images, prompts, self.threshold, self.min_area, meta=meta)
        strict = torch.tensor([float(r.strict) for r in res], dtype=torch.float32)
        partial = torch.tensor([r.partial for r in res], dtype=torch.float32)
        n_obj = torch.tensor([float(len(r.detail["detections"])) for r in res], dtype=torch.float32)
        extra = torch.tensor([float(r.detail["extra_objects"]) for r in res], dtype=torch.float32)
        exact = torch.tensor([float(r.detail["exact_scene"]) for r in res], dtype=torch.float32)
        scores = partial if self.mode == "partial" else strict
        return RewardOut(scores.clone(), {"strict": strict, "partial": partial, "n_objects": n_obj,
                                          "extra_objects": extra, "exact_scene": exact})

    def geneval_table(self, images, prompts: Sequence[str], meta=None) -> dict[str, float]:
        return geneval_table(images, prompts, meta, threshold=self.threshold, min_area=self.min_area)
