"""Prompts of the shapes world: grammar, parser, enumeration, train/eval split and the versioned prompt files.

Grammar (GenEval phrasing; every prompt of a category is one of these templates, lower case):

================  ==============================================  ===========================
category (tag)    template                                        example
================  ==============================================  ===========================
single_object     a photo of a {shape}                            a photo of a circle
two_object        a photo of a {shape1} and a {shape2}            a photo of a square and a triangle
counting          a photo of {two|three|four} {shape}s            a photo of three circles
colors            a photo of a {color} {shape}                    a photo of a green triangle
position          a photo of a {shape1} {relation} a {shape2}     a photo of a circle left of a square
color_attr        a photo of a {c1} {shape1} and a {c2} {shape2}  a photo of a red square and a blue circle
================  ==============================================  ===========================

Two-object prompts (two_object, position, color_attr) name two different shapes; color_attr names two different
colours; relations are "left of", "right of", "above", "below" (GenEval's). Prompt-space sizes: single_object 3,
two_object 6, counting 9, colors 18, position 24, color_attr 180 (240 in all).

Split (``v1``): a category is split *disjointly* (no evaluation requirement, up to the symmetry of "A and B" =
"B and A" and of "A left of B" = "B right of A", ever occurs among the training prompts) when it is large enough
that the training side still covers every shape, colour and relation: colors (6 held out of 18: one shape per
colour, each shape twice), position (4 of 12 canonical pairs = 8 of 24 prompts), color_attr (24 of 90 unordered
pairs = 48 of 180 prompts). single_object (3), two_object (6) and counting (9) are too small: eval and train
share all their prompts. The eval file is balanced (~48 lines per category): small categories repeat their
prompts (field ``repeat``), so one image per line gives ~48 samples per category. The train file holds every
training prompt once (so it is dominated by color_attr; weight by category if that matters).

Regenerate the files with ``python -m stepflow.shapes.prompts --write`` (deterministic, seeded);
``--check`` verifies that the files on disk match the generator.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stepflow.shapes.world import COLORS, RELATIONS, SHAPES, Scene, place

CATEGORIES: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
NUMBERS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
COUNTS: tuple[int, ...] = (2, 3, 4)  # counting prompts (GenEval counts 2-4; single_object covers 1)
VERSION = "v1"
SPLIT_SEED = 20250117
SPLITS = ("train", "eval")
#: eval lines per category (small categories repeat prompts to get close to this)
EVAL_PER_CATEGORY = 48
_OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


@dataclass(frozen=True)
class ObjectReq:
    """A required object group: ``count`` objects of ``shape`` (each of ``color`` if given)."""

    shape: str
    count: int = 1
    color: str | None = None

    def phrase(self) -> str:
        if self.count == 1:
            return f"a {self.color + ' ' if self.color else ''}{self.shape}"
        return f"{NUMBERS[self.count]} {self.color + ' ' if self.color else ''}{self.shape}s"


@dataclass(frozen=True)
class Requirement:
    """A parsed prompt. ``objects[0] relation objects[1]`` when ``relation`` is set; ``exact``: counts are exact
    (counting prompts: GenEval excludes ``count + 1`` of that class), otherwise "at least"."""

    category: str
    objects: tuple[ObjectReq, ...]
    relation: str | None = None
    exact: bool = False

    @property
    def prompt(self) -> str:
        o = self.objects
        if self.category == "position":
            return f"a photo of {o[0].phrase()} {self.relation} {o[1].phrase()}"
        return "a photo of " + " and ".join(x.phrase() for x in o)

    def key(self) -> tuple:
        """Canonical key: equal for prompts that state the same requirement ("A and B" = "B and A",
        "A left of B" = "B right of A")."""
        objs = tuple((o.shape, o.count, o.color or "") for o in self.objects)
        if self.relation is None:
            return (self.category, tuple(sorted(objs)), None)
        if self.relation in ("right of", "below"):
            return (self.category, objs[::-1], _OPPOSITE[self.relation])
        return (self.category, objs, self.relation)

    def to_meta(self) -> dict[str, Any]:
        """GenEval-style metadata: include/exclude lists (+ simple structured fields)."""
        include = []
        for i, o in enumerate(self.objects):
            d: dict[str, Any] = {"class": o.shape, "count": o.count}
            if o.color:
                d["color"] = o.color
            if self.relation is not None and i == 0:
                d["position"] = [self.relation, 1]
            include.append(d)
        if self.relation is not None:  # GenEval lists the reference object first
            include = [include[1], include[0]]
            include[1]["position"] = [self.relation, 0]
        meta: dict[str, Any] = {
            "prompt": self.prompt,
            "category": self.category,
            "tag": self.category,
            "include": include,
            "objects": [{"shape": o.shape, "count": o.count, "color": o.color} for o in self.objects],
        }
        if self.exact:
            meta["exclude"] = [{"class": o.shape, "count": o.count + 1} for o in self.objects]
        if self.relation is not None:
            meta["relation"] = self.relation
        return meta


# ----------------------------------------------------------------------------------------------- parsing

_SH = "|".join(SHAPES)
_CO = "|".join(COLORS)
_RE = "|".join(RELATIONS)
_NUM = "|".join(NUMBERS[c] for c in COUNTS)
_WORD2NUM = {v: k for k, v in NUMBERS.items()}
_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("single_object", re.compile(rf"a photo of a (?P<s1>{_SH})")),
    ("two_object", re.compile(rf"a photo of a (?P<s1>{_SH}) and a (?P<s2>{_SH})")),
    ("counting", re.compile(rf"a photo of (?P<n>{_NUM}) (?P<s1>{_SH})s")),
    ("colors", re.compile(rf"a photo of a (?P<c1>{_CO}) (?P<s1>{_SH})")),
    ("position", re.compile(rf"a photo of a (?P<s1>{_SH}) (?P<rel>{_RE}) a (?P<s2>{_SH})")),
    ("color_attr", re.compile(rf"a photo of a (?P<c1>{_CO}) (?P<s1>{_SH}) and a (?P<c2>{_CO}) (?P<s2>{_SH})")),
]


def parse_prompt(prompt: str) -> Requirement:
    """Parse a prompt of the grammar above into a :class:`Requirement` (exact: the grammar is ours).

    Raises a one-line ValueError naming the prompt if it is not in the grammar."""
    text = " ".join(str(prompt).strip().lower().rstrip(".").split())
    for cat, pat in _PATTERNS:
        m = pat.fullmatch(text)
        if m is None:
            continue
        g = m.groupdict()
        if cat == "counting":
            return Requirement(cat, (ObjectReq(g["s1"], _WORD2NUM[g["n"]]),), exact=True)
        if cat in ("single_object", "colors"):
            return Requirement(cat, (ObjectReq(g["s1"], 1, g.get("c1")),))
        if g["s1"] == g["s2"]:
            break  # two-object templates name two different shapes
        if cat == "color_attr" and g["c1"] == g["c2"]:
            break
        objs = (ObjectReq(g["s1"], 1, g.get("c1")), ObjectReq(g["s2"], 1, g.get("c2")))
        return Requirement(cat, objs, relation=g.get("rel"))
    raise ValueError(f"unknown shapes prompt (not in the stepflow.shapes grammar): {prompt!r}")


# ----------------------------------------------------------------------------------------------- enumeration


def all_requirements(category: str) -> list[Requirement]:
    """Every prompt of ``category`` (deterministic order)."""
    if category == "single_object":
        return [Requirement(category, (ObjectReq(s),)) for s in SHAPES]
    if category == "two_object":
        return [Requirement(category, (ObjectReq(a), ObjectReq(b))) for a, b in itertools.permutations(SHAPES, 2)]
    if category == "counting":
        return [Requirement(category, (ObjectReq(s, n),), exact=True) for s in SHAPES for n in COUNTS]
    if category == "colors":
        return [Requirement(category, (ObjectReq(s, 1, c),)) for c in COLORS for s in SHAPES]
    if category == "position":
        return [
            Requirement(category, (ObjectReq(a), ObjectReq(b)), relation=r)
            for r in RELATIONS
            for a, b in itertools.permutations(SHAPES, 2)
        ]
    if category == "color_attr":
        return [
            Requirement(category, (ObjectReq(a, 1, ca), ObjectReq(b, 1, cb)))
            for a, b in itertools.permutations(SHAPES, 2)
            for ca, cb in itertools.permutations(COLORS, 2)
        ]
    raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")


def prompt_space_sizes() -> dict[str, int]:
    return {c: len(all_requirements(c)) for c in CATEGORIES}


#: categories whose evaluation prompts are held out of training (the others are too small to split)
DISJOINT_CATEGORIES: tuple[str, ...] = ("colors", "position", "color_attr")


def _held_out_keys(category: str) -> set[tuple]:
    """Canonical keys of the evaluation requirements of a disjointly split category (deterministic)."""
    rng = np.random.default_rng([SPLIT_SEED, CATEGORIES.index(category)])
    if category == "colors":
        shapes = [SHAPES[i % len(SHAPES)] for i in range(len(COLORS))]  # each shape held out len(COLORS)/3 times
        shapes = [shapes[i] for i in rng.permutation(len(shapes))]
        return {Requirement(category, (ObjectReq(s, 1, c),)).key() for c, s in zip(COLORS, shapes)}
    keys = sorted({r.key() for r in all_requirements(category)}, key=repr)
    if category == "position":
        out = set()
        for rel in ("left of", "above"):  # 2 canonical pairs per axis
            axis = [k for k in keys if k[2] == rel]
            out |= {axis[i] for i in rng.choice(len(axis), 2, replace=False)}
        return out
    if category == "color_attr":
        return {keys[i] for i in rng.choice(len(keys), EVAL_PER_CATEGORY // 2, replace=False)}
    raise ValueError(f"category {category!r} is not split disjointly")


def split_requirements(category: str, split: str) -> list[Requirement]:
    """The distinct requirements of ``category`` in ``split`` ("train" or "eval")."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    reqs = all_requirements(category)
    if category not in DISJOINT_CATEGORIES:
        return reqs
    held = _held_out_keys(category)
    return [r for r in reqs if (r.key() in held) == (split == "eval")]


def generate_records(split: str) -> list[dict[str, Any]]:
    """The lines of ``{split}_v1.jsonl`` (deterministic)."""
    out = []
    for cat in CATEGORIES:
        reqs = split_requirements(cat, split)
        reps = max(1, round(EVAL_PER_CATEGORY / len(reqs))) if split == "eval" else 1
        for k in range(reps):
            for r in reqs:
                d = r.to_meta()
                if split == "eval":
                    d["repeat"] = k
                out.append(d)
    return out


# ----------------------------------------------------------------------------------------------- files


def prompt_file(split: str) -> Path:
    """Path of the versioned prompt file of ``split`` ("train" or "eval"), inside the package."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return Path(__file__).resolve().parent / f"{split}_{VERSION}.jsonl"


def load_prompts(split: str) -> list[dict[str, Any]]:
    """The records of the prompt file of ``split``: dicts with prompt, category, tag, include, objects, ..."""
    with open(prompt_file(split), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_prompt_files(directory: Path | None = None) -> list[Path]:
    directory = Path(directory) if directory is not None else prompt_file("train").parent
    paths = []
    for split in SPLITS:
        p = directory / f"{split}_{VERSION}.jsonl"
        with open(p, "w", encoding="utf-8") as f:
            for rec in generate_records(split):
                f.write(json.dumps(rec, sort_keys=True) + "\n")
        paths.append(p)
    return paths


# ----------------------------------------------------------------------------------------------- sampling


def sample_prompt(rng: np.random.Generator, category: str | None = None) -> dict[str, Any]:
    """A random prompt record (same fields as the file lines): category uniform over CATEGORIES unless given,
    then a prompt uniform over the whole prompt space of that category (train and eval alike: meant for
    pretraining data; RL training should read ``load_prompts("train")``)."""
    if category is None:
        category = CATEGORIES[int(rng.integers(len(CATEGORIES)))]
    reqs = all_requirements(category)
    return reqs[int(rng.integers(len(reqs)))].to_meta()


def scene_for_prompt(prompt: str | Requirement, rng: np.random.Generator, size: int = 32) -> Scene:
    """A random scene that satisfies ``prompt`` (pretraining data).

    Exactly the objects the prompt names (counting: ``n`` of the shape), nothing else. Unspecified colours are
    drawn uniformly and independently per object (so counting scenes are usually multi-coloured, and
    "a photo of a circle" shows a circle of any colour). Sides uniform in the world's range, positions uniform
    without overlap; position prompts place the pair so that GenEval's rule gives exactly the named relation.
    """
    req = prompt if isinstance(prompt, Requirement) else parse_prompt(prompt)
    colors = list(COLORS)
    items: list[tuple[str, str]] = []
    for o in req.objects:
        for _ in range(o.count):
            items.append((o.shape, o.color or colors[int(rng.integers(len(colors)))]))
    rel = (req.relation, 0, 1) if req.relation is not None else None
    return place(items, rng, size=size, relation=rel)


def iter_all_prompts() -> Iterable[Requirement]:
    for c in CATEGORIES:
        yield from all_requirements(c)
