"""Exact scenes and objects not asked for (the league's reward-hacking columns), on hand-made scenes: the counts
the judge reports against the closed form ``extra = sum_c max(0, #c - asked_c)`` of the objects drawn, and
``exact = strict and extra == 0``; then their per-category aggregation in the held-out evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepflow.rewards.shapes_geneval import ShapesGenEvalReward, table_from_values
from stepflow.shapes import render
from stepflow.shapes.detector import geneval_meta, judge
from stepflow.shapes.world import place

#: (prompt, the objects drawn, [(shape, colour)]); the prompt's asked objects come first
SCENES = [
    ("a photo of a red circle", [("circle", "red")]),
    ("a photo of a red circle", [("circle", "red"), ("square", "blue")]),
    ("a photo of a red circle", [("circle", "red"), ("circle", "blue"), ("triangle", "green")]),
    ("a photo of a square", [("square", "green"), ("square", "yellow")]),
    ("a photo of a square and a triangle", [("square", "red"), ("triangle", "blue"), ("circle", "white")]),
    ("a photo of a square and a triangle", [("square", "red"), ("circle", "white")]),  # fails: no triangle
    ("a photo of two circles", [("circle", "red"), ("circle", "blue")]),
    ("a photo of two circles", [("circle", "red"), ("circle", "blue"), ("square", "green")]),
    ("a photo of two circles", [("circle", "red"), ("circle", "blue"), ("circle", "green")]),  # fails: 3 circles
    ("a photo of a white square and a green triangle", [("square", "white"), ("triangle", "green")]),
    ("a photo of a white square and a green triangle", [("square", "green"), ("triangle", "white")]),  # fails
    ("a photo of a white square and a green triangle",
     [("square", "white"), ("triangle", "green"), ("circle", "red"), ("circle", "blue")]),
]


def closed_form(prompt: str, drawn: list[tuple[str, str]]) -> int:
    asked: dict[str, int] = {}
    for c in geneval_meta(prompt)["include"]:
        asked[c["class"]] = asked.get(c["class"], 0) + c["count"]
    have: dict[str, int] = {}
    for shape, _ in drawn:
        have[shape] = have.get(shape, 0) + 1
    return sum(max(0, n - asked.get(s, 0)) for s, n in have.items())


def _scenes(seed: int = 0):
    rng = np.random.default_rng(seed)
    imgs = np.stack([render(place(drawn, rng)) for _, drawn in SCENES])
    return torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous(), [p for p, _ in SCENES]


@pytest.mark.parametrize("seed", [0, 1])
def test_extra_objects_and_exact_scene_match_the_closed_form(seed):
    imgs, prompts = _scenes(seed)
    out = ShapesGenEvalReward()(imgs, prompts)
    want_extra = [closed_form(p, d) for p, d in SCENES]
    strict = out.components["strict"].tolist()
    assert strict == [1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1]  # GenEval's own rules accept the extras (not counting's)
    assert out.components["extra_objects"].tolist() == want_extra
    assert out.components["exact_scene"].tolist() == [float(s == 1 and e == 0) for s, e in zip(strict, want_extra)]
    # the training reward does not see them: partial credit is the same with and without the extra objects
    assert out.scores[1] == out.scores[0] == 1.0
    for i, (p, _) in enumerate(SCENES):  # judge() agrees image by image
        r = judge(imgs[i].permute(1, 2, 0).numpy(), p)
        assert r.detail["extra_objects"] == want_extra[i] and r.detail["exact_scene"] == bool(r.strict and not want_extra[i])


def test_table_from_values_is_the_per_category_mean_then_their_mean():
    t = table_from_values("extra_objects", ["a", "a", "b", "b", "b"], [0.0, 2.0, 1.0, 1.0, 4.0])
    assert t == pytest.approx({"extra_objects_a": 1.0, "extra_objects_b": 2.0, "extra_objects": 1.5})


def test_held_out_evaluation_reports_them_per_category(monkeypatch):
    from stepflow.core import heldout

    imgs, prompts = _scenes()
    tags = [geneval_meta(p)["tag"] for p in prompts]
    monkeypatch.setattr(heldout, "sample_ode", lambda policy, p, **kw: imgs[:len(p)])
    records = [{"prompt": p, "tag": t} for p, t in zip(prompts, tags)]
    res, _, _ = heldout.evaluate_reward(None, ShapesGenEvalReward(), records)
    extra = [closed_form(p, d) for p, d in SCENES]
    strict = ShapesGenEvalReward()(imgs, prompts).components["strict"].tolist()
    for name, vals in (("extra_objects", extra), ("exact_scene", [float(s == 1 and e == 0) for s, e in zip(strict, extra)])):
        per = {t: [v for v, u in zip(vals, tags) if u == t] for t in dict.fromkeys(tags)}
        for t, v in per.items():
            assert res[f"eval/{name}_{t}"] == pytest.approx(sum(v) / len(v))
        assert res[f"eval/{name}"] == pytest.approx(sum(sum(v) / len(v) for v in per.values()) / len(per))
    assert res["eval/geneval"] == pytest.approx(table_from_values("geneval", tags, strict)["geneval"])
