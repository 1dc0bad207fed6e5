"""OCR text-rendering reward (Flow-GRPO's ``ocr``), with a pluggable OCR engine.

For a prompt ``... "Hello World" ...`` the target is the text between the first pair of double quotes. With
``rec`` the engine's recognized text and ``tgt`` the target, both lower-cased with spaces removed::

    d      = 0 if tgt is a substring of rec else min(Levenshtein(rec, tgt), len(tgt))
    reward = 1 - d / len(tgt)                                                   in [0, 1]

A prompt without a (non-empty) quoted target scores ``no_target_score`` (default 0); an engine failure on an
image counts as d = len(tgt) (reward 0), as upstream. Engines (``engine:``):

- ``paddleocr`` (Flow-GRPO's, PaddleOCR 2.x; ``pip install "paddleocr<3" paddlepaddle``):
  ``PaddleOCR(lang="en", use_angle_cls=False)``, the text of all boxes with confidence > 0 concatenated;
- ``easyocr`` (``pip install easyocr``): ``Reader(["en"]).readtext(img, detail=0)`` concatenated;
- a dotted path ``"pkg.module:function"`` (or a Python callable when built in code) taking one (H, W, 3) uint8
  RGB array and returning the recognized string.

Neither OCR package is a stepflow dependency: they are imported when the reward is built, with a one-line error.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from stepflow.errors import RewardLoadError
from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.loading import to_uint8

log = logging.getLogger(__name__)

Engine = Callable[[np.ndarray], str]


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions all cost 1); O(len(a)·len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def quoted_target(prompt: str) -> str | None:
    """The text between the first pair of double quotes (Flow-GRPO: ``prompt.split('"')[1]``); None if absent."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def ocr_reward(recognized: str, target: str) -> float:
    """Flow-GRPO's formula on already-recognized text (see the module docstring)."""
    rec = recognized.replace(" ", "").lower()
    tgt = target.replace(" ", "").lower()
    if not tgt:
        return 1.0 if not rec else 0.0
    d = 0 if tgt in rec else min(levenshtein(rec, tgt), len(tgt))
    return 1.0 - d / len(tgt)


def _missing(pkg: str, pip: str) -> RewardLoadError:
    return RewardLoadError(f"reward ocr: engine '{pkg}' is not installed (optional extra: pip install {pip}), "
                           f"or set reward.engine=easyocr|paddleocr|pkg.module:function")


def paddleocr_engine(use_gpu: bool = False) -> Engine:
    try:
        import paddleocr
    except ImportError:
        raise _missing("paddleocr", "'paddleocr<3' paddlepaddle") from None
    version = str(getattr(paddleocr, "__version__", "?"))
    if not version.startswith("2."):
        raise RewardLoadError(f"reward ocr: engine 'paddleocr' needs PaddleOCR 2.x (Flow-GRPO uses 2.9.1; its result "
                              f"format changed in 3.x), found {version}; or set reward.engine=pkg.module:function")
    ocr = paddleocr.PaddleOCR(use_angle_cls=False, lang="en", use_gpu=use_gpu, show_log=False)

    def run(img: np.ndarray) -> str:
        result = ocr.ocr(img, cls=False)
        if not result or not result[0]:
            return ""
        return "".join(res[1][0] for res in result[0] if res[1][1] > 0)

    return run


def easyocr_engine(use_gpu: bool = False) -> Engine:
    try:
        import easyocr
    except ImportError:
        raise _missing("easyocr", "easyocr") from None
    reader = easyocr.Reader(["en"], gpu=use_gpu, verbose=False)
    return lambda img: "".join(reader.readtext(img, detail=0))


def make_engine(engine: str | Engine, use_gpu: bool = False) -> Engine:
    if callable(engine):
        return engine
    if engine == "paddleocr":
        return paddleocr_engine(use_gpu)
    if engine == "easyocr":
        return easyocr_engine(use_gpu)
    if isinstance(engine, str) and ":" in engine:
        mod, _, fn = engine.partition(":")
        try:
            return getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise RewardLoadError(f"reward ocr: cannot import engine '{engine}' ({type(e).__name__}: {e})") from None
    raise RewardLoadError(f"reward ocr: unknown engine {engine!r}; use paddleocr, easyocr or pkg.module:function")


class OCRReward(Reward):
    """engine: ``paddleocr`` | ``easyocr`` | ``pkg.module:function`` | a callable (img uint8 HWC -> str).
    Components: ``edit_distance`` (the clipped d) and ``target_len``."""

    name = "ocr"

    def __init__(self, engine: str | Engine = "paddleocr", use_gpu: bool = False, no_target_score: float = 0.0,
                 batch_size: int = 64):
        self.engine = make_engine(engine, use_gpu)
        self.no_target_score = float(no_target_score)
        self.batch_size = batch_size

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        arrays = to_uint8(images)
        scores, dists, lens = [], [], []
        for img, prompt in zip(arrays, prompts):
            target = quoted_target(prompt)
            n = len(target.replace(" ", "")) if target is not None else 0
            if n == 0:
                r, d = self.no_target_score, 0
            else:
                try:
                    rec = self.engine(img)
                except Exception as e:  # noqa: BLE001 - upstream: an OCR failure is the maximum penalty
                    log.warning("OCR engine failed on one image (%s: %s); reward 0", type(e).__name__, e)
                    rec = ""
                r = ocr_reward(rec, target)
                d = round((1.0 - r) * n)
            scores.append(r)
            dists.append(float(d))
            lens.append(float(n))
        return RewardOut(torch.tensor(scores, dtype=torch.float32),
                         {"edit_distance": torch.tensor(dists), "target_len": torch.tensor(lens)})
