"""Renderer and scene sampler of the embedded shapes world."""

import numpy as np
import pytest

from stepflow.shapes import (
    BACKGROUND,
    CATEGORIES,
    COLORS,
    SHAPES,
    Scene,
    ShapeSpec,
    all_requirements,
    parse_prompt,
    render,
    sample_prompt,
    scene_for_prompt,
    shape_mask,
    side_range,
)
from stepflow.shapes.world import spec_relations

BG = np.asarray(BACKGROUND, np.float32) / 255


def _color_pixels(img, color):
    return np.all(np.abs(img - np.asarray(COLORS[color], np.float32) / 255) < 1e-6, axis=-1)


def test_constants():
    assert SHAPES == ("circle", "square", "triangle")
    assert CATEGORIES == ("single_object", "two_object", "counting", "colors", "position", "color_attr")
    assert len(COLORS) >= 5
    pal = np.asarray(list(COLORS.values()), float)
    d = np.linalg.norm(pal[:, None] - pal[None], axis=-1)[np.triu_indices(len(pal), 1)]
    assert d.min() > 120, "palette colours must be far apart"
    assert np.linalg.norm(pal - np.asarray(BACKGROUND), axis=-1).min() > 150


def test_render_empty_and_dtype():
    img = render(Scene((), 32))
    assert img.shape == (32, 32, 3) and img.dtype == np.float32
    assert np.allclose(img, BG)
    assert render(Scene((), 48)).shape == (48, 48, 3)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("color", list(COLORS))
def test_render_single_shape(shape, color):
    s = 9
    img = render(Scene((ShapeSpec(shape, color, 5, 7, s),), 32))
    assert img.min() >= 0 and img.max() <= 1
    on = _color_pixels(img, color)
    assert on.sum() == shape_mask(shape, s).sum()
    ys, xs = np.nonzero(on)
    assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (5, 7, 5 + s, 7 + s)  # the mask spans its box
    assert np.allclose(img[~on], BG)


def test_masks_distinct_and_sized():
    lo, hi = side_range(32)
    assert (lo, hi) == (7, 11)
    for s in range(lo, hi + 1):
        areas = {sh: shape_mask(sh, s).mean() for sh in SHAPES}
        assert areas["square"] == 1.0
        assert 0.7 < areas["circle"] < 0.9
        assert 0.5 < areas["triangle"] < 0.7
        tri = shape_mask("triangle", s)
        assert tri[: s // 2].sum() < 0.5 * tri[s - s // 2 :].sum()  # apex up


def test_render_rescales_layout():
    sc = Scene((ShapeSpec("square", "red", 4, 4, 8),), 32)
    big = render(sc, 64)
    assert big.shape == (64, 64, 3)
    assert _color_pixels(big, "red").sum() == 16 * 16


def _check_scene(req, scene, size):
    lo, hi = side_range(size)
    objs = scene.objects
    assert sum(o.count for o in req.objects) == len(objs)
    for o in objs:
        assert lo <= o.s <= hi and 0 <= o.x and o.x + o.s <= size and 0 <= o.y and o.y + o.s <= size
    for i in range(len(objs)):
        for j in range(i + 1, len(objs)):
            a, b = objs[i], objs[j]
            assert a.x + a.s < b.x or b.x + b.s < a.x or a.y + a.s < b.y or b.y + b.s < a.y, "overlap/touch"
    k = 0
    for o in req.objects:
        for _ in range(o.count):
            assert objs[k].shape == o.shape
            if o.color:
                assert objs[k].color == o.color
            k += 1
    if req.relation:
        assert spec_relations(objs[0], objs[1]) == {req.relation}


@pytest.mark.parametrize("size", [32, 64])
def test_scene_for_prompt_satisfies_every_prompt(size):
    rng = np.random.default_rng(0)
    for cat in CATEGORIES:
        for req in all_requirements(cat):
            for _ in range(2):
                _check_scene(req, scene_for_prompt(req.prompt, rng, size=size), size)


def test_free_attributes_vary():
    rng = np.random.default_rng(1)
    colors = {scene_for_prompt("a photo of a circle", rng).objects[0].color for _ in range(60)}
    assert colors == set(COLORS)
    scenes = [scene_for_prompt("a photo of four triangles", rng) for _ in range(30)]
    assert len({o.s for sc in scenes for o in sc.objects}) >= 4
    assert len({(o.x, o.y) for sc in scenes for o in sc.objects}) > 60
    assert any(len({o.color for o in sc.objects}) > 1 for sc in scenes)  # counting: colour per object


def test_scene_is_deterministic_given_rng():
    a = scene_for_prompt("a photo of a red square and a blue circle", np.random.default_rng(5))
    b = scene_for_prompt("a photo of a red square and a blue circle", np.random.default_rng(5))
    assert a == b and np.array_equal(render(a), render(b))


def test_sample_prompt_covers_categories():
    rng = np.random.default_rng(2)
    recs = [sample_prompt(rng) for _ in range(300)]
    assert {r["category"] for r in recs} == set(CATEGORIES)
    for r in recs:
        assert parse_prompt(r["prompt"]).category == r["category"] == r["tag"]
    assert all(sample_prompt(rng, "position")["category"] == "position" for _ in range(10))
