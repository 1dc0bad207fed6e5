"""OCR reward: the edit distance against hand-computed values, Flow-GRPO's formula, target extraction, and the
reward on a stub engine (a plain Python callable: the engine interface, not a model)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from stepflow.errors import RewardLoadError
from stepflow.rewards.ocr import OCRReward, levenshtein, ocr_reward, quoted_target


@pytest.mark.parametrize("a,b,d", [
    ("kitten", "sitting", 3),        # k->s, e->i, +g
    ("flaw", "lawn", 2),             # -f, +n
    ("intention", "execution", 5),   # the textbook example
    ("", "abc", 3), ("abc", "", 3), ("", "", 0),
    ("abc", "abc", 0), ("abc", "acb", 2), ("ab", "ba", 2),
    ("helloworld", "hello", 5), ("openai", "opnai", 1),
])
def test_levenshtein_hand_computed(a, b, d):
    assert levenshtein(a, b) == d
    assert levenshtein(b, a) == d


def test_quoted_target():
    assert quoted_target('A neon sign that says "Open 24h" on a wall') == "Open 24h"
    assert quoted_target('a "first" and a "second"') == "first"  # the first pair, as Flow-GRPO's split('"')[1]
    assert quoted_target("no quotes here") is None
    assert quoted_target('an unclosed "quote') is None


@pytest.mark.parametrize("rec,tgt,r", [
    ("Hello World", "Hello World", 1.0),
    ("HELLOWORLD", "hello world", 1.0),          # case and spaces are ignored
    ("xx hello world yy", "Hello World", 1.0),    # target contained in the recognized text
    ("hello", "Hello World", 0.5),               # Lev("hello", "helloworld") = 5 of 10
    ("helo wrld", "Hello World", 0.8),           # 2 deletions of 10
    ("", "abc", 0.0),                            # nothing read
    ("zzzzzzzzzzzzzzzzzzzz", "abcd", 0.0),        # distance clipped at len(target)
    ("abxd", "abcd", 0.75),
])
def test_ocr_formula(rec, tgt, r):
    assert ocr_reward(rec, tgt) == pytest.approx(r)


def _stub_engine(img: np.ndarray) -> str:
    """Reads the image's mean brightness as one of three strings (a deterministic stand-in OCR engine)."""
    m = img.mean()
    if m < 64:
        return "STEP FLOW"
    if m < 192:
        return "step"
    raise RuntimeError("engine crashed")


def test_ocr_reward_with_stub_engine():
    imgs = torch.stack([torch.full((3, 32, 32), v) for v in (0.0, 0.5, 0.0, 1.0, 0.5)])
    prompts = ['a poster reading "Step Flow"', 'a poster reading "Step Flow"', "no quoted text at all",
               'a mug with "step"', 'a shirt saying "stop"']
    r = OCRReward(engine=_stub_engine, batch_size=2)  # chunked through Reward.__call__
    out = r(imgs, prompts)
    # 1.0: exact; 0.5: "step" vs "stepflow" = 4 of 8; 0 (no target); engine failure = 0; "step" vs "stop" = 1 of 4
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 0.5, 0.0, 0.0, 0.75]))
    torch.testing.assert_close(out.components["edit_distance"], torch.tensor([0.0, 4.0, 0.0, 4.0, 1.0]))
    torch.testing.assert_close(out.components["target_len"], torch.tensor([8.0, 8.0, 0.0, 4.0, 4.0]))
    assert OCRReward(engine=_stub_engine, no_target_score=0.25)(imgs[2:3], prompts[2:3]).scores.item() == 0.25


def test_ocr_engine_errors_are_one_line():
    for engine, needle in (("no_such_module_xyz:fn", "no_such_module_xyz"), ("tesseract", "unknown engine")):
        with pytest.raises(RewardLoadError) as ei:
            OCRReward(engine=engine)
        assert "\n" not in str(ei.value) and needle in str(ei.value)
    for pkg in ("paddleocr", "easyocr"):
        if importlib.util.find_spec(pkg) is None:
            with pytest.raises(RewardLoadError) as ei:
                OCRReward(engine=pkg)
            assert "\n" not in str(ei.value) and "pip install" in str(ei.value) and pkg in str(ei.value)
    assert OCRReward(engine="builtins:str").engine is str  # dotted engine path
