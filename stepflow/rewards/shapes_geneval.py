"""The embedded world's reward: the shapes judge as a :class:`~stepflow.rewards.base.Reward`.

``scores`` is the judge's partial credit in [0, 1] (fraction of satisfied requirements; counting
``0.5 ** |count error|``), or its strict 0/1 GenEval correctness with ``mode="strict"``. Components (all (B,)):
``strict`` (0/1), ``partial``, ``n_objects`` (detections). Prompts are plain strings in the
:mod:`stepflow.shapes.prompts` grammar; an unknown prompt raises a one-line ValueError naming it.

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
from stepflow.shapes import CATEGORIES, judge, parse_prompt
from stepflow.shapes.detector import FG_THRESHOLD

__all__ = ["ShapesGenEvalReward", "geneval_table", "judge_batch"]


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


def judge_batch(images, prompts: Sequence[str], threshold: float = FG_THRESHOLD, min_area: int | None = None):
    """Judge each (image, prompt) pair: a list of :class:`~stepflow.shapes.detector.JudgeResult`."""
    arr = _to_hwc_batch(images)
    if len(prompts) != arr.shape[0]:
        raise ValueError(f"shapes_geneval: {arr.shape[0]} images but {len(prompts)} prompts")
    reqs = [parse_prompt(p) for p in prompts]  # fail fast, before any detection
    return [judge(im, r, threshold=threshold, min_area=min_area) for im, r in zip(arr, reqs)]


def geneval_table(images, prompts: Sequence[str], **judge_kwargs) -> dict[str, float]:
    """Strict accuracy per category (``geneval_<category>``, for the categories present) and ``geneval``, their
    unweighted mean (as GenEval computes its overall score)."""
    results = judge_batch(images, prompts, **judge_kwargs)
    per: dict[str, list[float]] = {}
    for p, r in zip(prompts, results):
        per.setdefault(parse_prompt(p).category, []).append(float(r.strict))
    table = {f"geneval_{c}": float(np.mean(per[c])) for c in CATEGORIES if c in per}
    table = {"geneval": float(np.mean(list(table.values()))) if table else 0.0, **table}
    return table


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
        res = judge_batch(images, prompts, self.threshold, self.min_area)
        strict = torch.tensor([float(r.strict) for r in res], dtype=torch.float32)
        partial = torch.tensor([r.partial for r in res], dtype=torch.float32)
        n_obj = torch.tensor([float(len(r.detail["detections"])) for r in res], dtype=torch.float32)
        scores = partial if self.mode == "partial" else strict
        return RewardOut(scores.clone(), {"strict": strict, "partial": partial, "n_objects": n_obj})

    def geneval_table(self, images, prompts: Sequence[str]) -> dict[str, float]:
        return geneval_table(images, prompts, threshold=self.threshold, min_area=self.min_area)
