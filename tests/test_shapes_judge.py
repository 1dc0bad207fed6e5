"""The shapes judge: detection agrees with the renderer, altered scenes score lower, robustness to model-like noise."""

from collections import Counter

import numpy as np
import pytest
import torch

from stepflow.shapes import (
    CATEGORIES,
    COLORS,
    SHAPES,
    Scene,
    ShapeSpec,
    detect,
    evaluate,
    judge,
    parse_prompt,
    render,
    sample_prompt,
    scene_for_prompt,
    shape_mask,
)
from stepflow.shapes.world import place


def _blur(im, sigma):
    r = int(np.ceil(3 * sigma))
    x = np.arange(-r, r + 1)
    k = np.exp(-x**2 / (2 * sigma**2))
    k /= k.sum()
    p = np.pad(im, ((r, r), (r, r), (0, 0)), mode="edge")
    p = sum(k[i] * p[i:i + im.shape[0]] for i in range(2 * r + 1))
    return sum(k[i] * p[:, i:i + im.shape[1]] for i in range(2 * r + 1))


def _gt(scene):
    return sorted((o.shape, o.color) for o in scene.objects)


def test_agreement_2000_fresh_scenes():
    """>= 99 % of freshly rendered scenes: detections == ground-truth objects (shape, colour, centroid within 1 px)
    and the judge calls the scene correct for its prompt; overall and per category."""
    rng = np.random.default_rng(12345)
    ok, jok, tot = Counter(), Counter(), Counter()
    for i in range(2000):
        rec = sample_prompt(rng, CATEGORIES[i % len(CATEGORIES)])
        scene = scene_for_prompt(rec["prompt"], rng)
        img = render(scene)
        dets = detect(img)
        match = _gt(scene) == sorted((d.shape, d.color) for d in dets)
        if match:  # centroids: every object has a detection of its kind within 1 px of its mask centroid
            for o in scene.objects:
                m = np.zeros((32, 32), bool)
                m[o.y:o.y + o.s, o.x:o.x + o.s] = shape_mask(o.shape, o.s)
                ys, xs = np.nonzero(m)
                c = (xs.mean() + 0.5, ys.mean() + 0.5)
                match &= any(d.shape == o.shape and d.color == o.color and abs(d.cx - c[0]) < 1 and abs(d.cy - c[1]) < 1
                             for d in dets)
        tot[rec["category"]] += 1
        ok[rec["category"]] += match
        jok[rec["category"]] += evaluate(dets, parse_prompt(rec["prompt"])).strict
    assert sum(ok.values()) / 2000 >= 0.99 and sum(jok.values()) / 2000 >= 0.99
    for c in CATEGORIES:
        assert ok[c] / tot[c] >= 0.99 and jok[c] / tot[c] >= 0.99, (c, ok[c], jok[c], tot[c])


def test_agreement_on_blurred_noisy_samples():
    """Model-like samples (Gaussian blur sigma 0.7, noise 0.05): the judge still accepts >= 95 % of correct scenes."""
    rng = np.random.default_rng(7)
    good = 0
    for i in range(300):
        rec = sample_prompt(rng, CATEGORIES[i % len(CATEGORIES)])
        img = render(scene_for_prompt(rec["prompt"], rng))
        img = np.clip(_blur(img, 0.7) + 0.05 * rng.standard_normal(img.shape), 0, 1).astype(np.float32)
        good += judge(img, rec["prompt"]).strict
    assert good / 300 >= 0.95


def _mirror(scene, axis):
    n = scene.size
    objs = tuple(ShapeSpec(o.shape, o.color, n - o.x - o.s if axis == "x" else o.x,
                           n - o.y - o.s if axis == "y" else o.y, o.s) for o in scene.objects)
    return Scene(objs, n)


def _alterations(req, scene, rng):
    """Scenes that violate ``req`` in count, colour or position."""
    out = {}
    objs = list(scene.objects)
    if req.category == "counting":
        o = req.objects[0]
        out["count-1"] = Scene(tuple(objs[1:]), scene.size)
        items = [(x.shape, x.color) for x in objs] + [(o.shape, "red")]
        out["count+1"] = place(items, rng)
    if req.category in ("single_object", "two_object", "position", "color_attr", "colors"):
        out["missing"] = Scene(tuple(objs[1:]), scene.size)
    if req.category in ("colors", "color_attr"):
        for i in range(len(req.objects)):
            wrong = next(c for c in COLORS if c not in {x.color for x in req.objects})
            changed = list(objs)
            changed[i] = ShapeSpec(objs[i].shape, wrong, objs[i].x, objs[i].y, objs[i].s)
            out[f"color{i}"] = Scene(tuple(changed), scene.size)
    if req.category == "position":
        out["swapped"] = _mirror(scene, "x" if req.relation in ("left of", "right of") else "y")
    return out


@pytest.mark.parametrize("cat", CATEGORIES)
def test_altered_scenes_score_lower(cat):
    rng = np.random.default_rng(CATEGORIES.index(cat))
    n_alt = 0
    for _ in range(25):
        rec = sample_prompt(rng, cat)
        req = parse_prompt(rec["prompt"])
        scene = scene_for_prompt(req, rng)
        good = judge(render(scene), req)
        assert good.strict and good.partial == 1.0
        for name, alt in _alterations(req, scene, rng).items():
            bad = judge(render(alt), req)
            assert not bad.strict, (rec["prompt"], name, bad.detail["checks"])
            assert 0.0 <= bad.partial < good.partial, (rec["prompt"], name, bad.partial)
            n_alt += 1
    assert n_alt >= 25


def test_partial_credit_is_graded():
    rng = np.random.default_rng(0)
    # counting: partial decreases with |count error|
    vals = []
    for n in range(0, 5):
        scene = place([("circle", "blue")] * n, rng) if n else Scene((), 32)
        vals.append(judge(render(scene), "a photo of three circles").partial)
    assert vals[3] == 1.0 and vals[2] == vals[4] == 0.5 and vals[1] == 0.25 and vals[0] < vals[1]
    # colour attribution: one colour wrong earns more than both wrong, less than both right
    p = "a photo of a red square and a blue circle"
    s = lambda c1, c2: judge(render(place([("square", c1), ("circle", c2)], rng)), p).partial  # noqa: E731
    assert s("red", "blue") == 1.0 > s("red", "green") > s("yellow", "green") > judge(render(Scene()), p).partial


def test_detect_ignores_specks_and_accepts_torch():
    img = render(Scene((ShapeSpec("circle", "red", 3, 3, 9), ShapeSpec("square", "green", 18, 18, 10)), 32))
    img[28:30, 1:3] = np.asarray(COLORS["white"]) / 255  # a 2x2 speck
    dets = detect(img)  # most confident first: the bigger square
    assert [(d.shape, d.color) for d in dets] == [("square", "green"), ("circle", "red")]
    t = torch.from_numpy(img).permute(2, 0, 1)
    assert [(d.shape, d.color) for d in detect(t)] == [("square", "green"), ("circle", "red")]
    assert detect(render(Scene())) == []


def test_touching_shapes_of_different_colours_are_separated():
    rng = np.random.default_rng(3)
    for _ in range(30):
        s1, s2 = rng.choice(SHAPES, 2)
        c1, c2 = rng.choice(list(COLORS), 2, replace=False)
        scene = Scene((ShapeSpec(s1, c1, 4, 10, 10), ShapeSpec(s2, c2, 14, 10, 10)), 32)  # sharing an edge
        assert _gt(scene) == sorted((d.shape, d.color) for d in detect(render(scene)))


def test_same_colour_fused_pair_is_split():
    scene = Scene((ShapeSpec("circle", "red", 3, 8, 11), ShapeSpec("circle", "red", 14, 8, 11)), 32)  # touching
    assert [(d.shape, d.color) for d in detect(render(scene))] == [("circle", "red")] * 2


def test_position_rule_uses_margin():
    # centres 1 px apart horizontally: neither left of nor right of (GenEval's margin); 14 px apart: left of
    p = "a photo of a circle left of a square"
    near = Scene((ShapeSpec("circle", "red", 5, 2, 9), ShapeSpec("square", "blue", 6, 18, 9)), 32)
    far = Scene((ShapeSpec("circle", "red", 2, 10, 9), ShapeSpec("square", "blue", 16, 12, 9)), 32)
    assert not judge(render(near), p).strict and judge(render(far), p).strict
    assert not judge(render(far), "a photo of a circle right of a square").strict


def test_noise_and_clutter_are_not_objects():
    """Blocky colour noise (what an untrained patch-4 model draws) must not pass as shapes: a judge that accepts
    clutter would score noise at GenEval ~0.5 and let RL hack the reward."""
    from stepflow.shapes import COLORS, detect, judge

    rng = np.random.default_rng(0)
    palette = np.asarray(list(COLORS.values()), dtype=np.float32) / 255.0
    bg = np.full((32, 32, 3), 24 / 255.0, dtype=np.float32)
    passed = 0
    for _ in range(200):
        img = bg.copy()
        for _ in range(rng.integers(4, 16)):  # random 4x4 blocks on the patch grid (2x2 same-colour clusters are real squares)
            y, x = rng.integers(0, 8, size=2) * 4
            img[y:y + 4, x:x + 4] = palette[rng.integers(len(palette))]
        passed += judge(img, "a photo of a circle").strict or judge(img, "a photo of a square").strict
    assert passed / 200 < 0.05, passed
    # an elongated bar is not a square
    img = bg.copy()
    img[10:13, 4:28] = palette[0]
    assert detect(img) == []


def test_shape_fit_of_rendered_shapes_is_high():
    from stepflow.shapes import SHAPES, Scene, ShapeSpec, render
    from stepflow.shapes.detector import detect

    for shape in SHAPES:
        for side in (7, 9, 11):
            img = render(Scene((ShapeSpec(shape, "red", 10, 10, side),), 32))
            (d,) = detect(img)
            assert d.shape == shape and d.conf > 0.9, (shape, side, d)
