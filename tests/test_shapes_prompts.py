"""Prompt grammar, train/eval split and the versioned prompt files."""

import json
from pathlib import Path

import pytest

from stepflow.cli import CONF_DIR
from stepflow.shapes import (
    CATEGORIES,
    COLORS,
    DISJOINT_CATEGORIES,
    SHAPES,
    all_requirements,
    load_prompts,
    parse_prompt,
    prompt_file,
    prompt_space_sizes,
    split_requirements,
)
from stepflow.shapes.prompts import generate_records
from stepflow.shapes.world import RELATIONS

ROOT = Path(__file__).resolve().parents[1]


def test_prompt_space_sizes():
    assert prompt_space_sizes() == {"single_object": 3, "two_object": 6, "counting": 9, "colors": 18,
                                    "position": 24, "color_attr": 180}
    assert set(DISJOINT_CATEGORIES) == {"colors", "position", "color_attr"}


@pytest.mark.parametrize("cat", CATEGORIES)
def test_round_trip(cat):
    reqs = all_requirements(cat)
    assert len({r.prompt for r in reqs}) == len(reqs)
    for r in reqs:
        assert r.category == cat
        assert r.prompt.startswith("a photo of ")
        assert parse_prompt(r.prompt) == r
        assert parse_prompt("  " + r.prompt.upper() + ". ") == r


def test_geneval_phrasing_examples():
    ex = {
        "a photo of a circle": ("single_object", [("circle", 1, None)], None),
        "a photo of a square and a triangle": ("two_object", [("square", 1, None), ("triangle", 1, None)], None),
        "a photo of three circles": ("counting", [("circle", 3, None)], None),
        "a photo of a green triangle": ("colors", [("triangle", 1, "green")], None),
        "a photo of a circle left of a square": ("position", [("circle", 1, None), ("square", 1, None)], "left of"),
        "a photo of a red square and a blue circle": ("color_attr", [("square", 1, "red"), ("circle", 1, "blue")], None),
    }
    for p, (cat, objs, rel) in ex.items():
        r = parse_prompt(p)
        assert (r.category, [(o.shape, o.count, o.color) for o in r.objects], r.relation) == (cat, objs, rel)
    assert parse_prompt("a photo of four triangles").exact


@pytest.mark.parametrize("bad", ["a photo of a dog", "a photo of a circle and a circle", "a photo of five squares",
                                 "a photo of a red circle and a red square", "", "a photo of a circle above a circle"])
def test_unknown_prompt_raises_one_line(bad):
    with pytest.raises(ValueError) as e:
        parse_prompt(bad)
    msg = str(e.value)
    assert "\n" not in msg and repr(bad) in msg


@pytest.mark.parametrize("cat", CATEGORIES)
def test_split(cat):
    train, ev = split_requirements(cat, "train"), split_requirements(cat, "eval")
    assert train and ev
    tk, ek = {r.key() for r in train}, {r.key() for r in ev}
    if cat in DISJOINT_CATEGORIES:
        assert not tk & ek, "eval requirement leaks into train"
        assert len(train) + len(ev) == len(all_requirements(cat))
        # training still covers every shape, colour and relation of the category
        assert {o.shape for r in train for o in r.objects} == set(SHAPES)
        if cat != "position":
            assert {o.color for r in train for o in r.objects} == set(COLORS)
        else:
            assert {r.relation for r in train} == set(RELATIONS)
    else:
        assert train == ev == all_requirements(cat)


def test_key_symmetries():
    a, b = parse_prompt("a photo of a circle left of a square"), parse_prompt("a photo of a square right of a circle")
    assert a.key() == b.key() != parse_prompt("a photo of a square left of a circle").key()
    c, d = parse_prompt("a photo of a red square and a blue circle"), parse_prompt("a photo of a blue circle and a red square")
    assert c.key() == d.key()


@pytest.mark.parametrize("split", ["train", "eval"])
def test_files_match_generator(split):
    p = prompt_file(split)
    assert p.is_file() and p.name == f"{split}_v1.jsonl"
    recs = load_prompts(split)
    assert recs == generate_records(split), "run python -m stepflow.shapes.prompts --write"
    assert [json.loads(line) for line in p.read_text().splitlines()] == recs
    for r in recs:
        assert r["category"] == r["tag"] and r["category"] in CATEGORIES
        assert parse_prompt(r["prompt"]).to_meta() == {k: v for k, v in r.items() if k != "repeat"}


def test_files_disjoint_and_balanced():
    train, ev = load_prompts("train"), load_prompts("eval")
    tkeys = {parse_prompt(r["prompt"]).key() for r in train}
    for r in ev:
        if r["category"] in DISJOINT_CATEGORIES:
            assert parse_prompt(r["prompt"]).key() not in tkeys, r["prompt"]
    per = {c: sum(r["category"] == c for r in ev) for c in CATEGORIES}
    assert all(40 <= n <= 56 for n in per.values()), per
    assert len({r["prompt"] for r in train}) == len(train)
    assert {r["category"] for r in train} == set(CATEGORIES)


def test_data_config_points_at_files():
    text = (CONF_DIR / "data" / "shapes.yaml").read_text()
    assert "name: shapes" in text
    for split in ("train", "eval"):
        assert f"{split}_file: pkg://stepflow/shapes/prompts/{split}_v1.jsonl" in text
        from importlib import resources
        p = Path(str(resources.files("stepflow").joinpath(f"shapes/prompts/{split}_v1.jsonl")))
        assert p.resolve() == prompt_file(split)
