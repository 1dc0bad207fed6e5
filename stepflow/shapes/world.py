"""The world: palette, shapes, scenes and a fast numpy renderer.

A :class:`Scene` is a canvas size plus a tuple of :class:`ShapeSpec` (shape, colour, top-left pixel, side
length in pixels). :func:`render` paints precomputed boolean masks (one per shape and side length, cached) onto a
fixed dark background, crisp (no anti-aliasing), so the judge can be exact on rendered scenes.

Geometry conventions: image row ``y`` grows downwards (so "above" means smaller ``y``), ``x`` grows to the
right; a shape of side ``s`` at top-left ``(x, y)`` covers rows ``y .. y+s-1`` and columns ``x .. x+s-1``;
its box centre is ``(x + s/2, y + s/2)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

#: Six colours far apart in RGB (min pairwise distance ~150 of 441) and far from the background.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (40, 90, 245),
    "yellow": (240, 220, 40),
    "purple": (200, 50, 230),
    "white": (240, 240, 240),
}

#: Fixed background (dark neutral grey).
BACKGROUND: tuple[int, int, int] = (24, 24, 24)

RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")

#: Shape side range in pixels at the reference 32 x 32 canvas; scaled linearly with the canvas size.
MIN_SIDE_32, MAX_SIDE_32 = 7, 11
#: Minimum empty pixels between two shapes' boxes (so touching never happens in rendered scenes) and to the border.
GAP_32, MARGIN_32 = 2, 1


def side_range(size: int) -> tuple[int, int]:
    """Inclusive (min, max) shape side in pixels for a ``size`` x ``size`` canvas."""
    lo = max(3, round(MIN_SIDE_32 * size / 32))
    hi = max(lo, round(MAX_SIDE_32 * size / 32))
    return lo, hi


def _gap(size: int) -> int:
    return max(1, round(GAP_32 * size / 32))


def _margin(size: int) -> int:
    return max(0, round(MARGIN_32 * size / 32))


@dataclass(frozen=True)
class ShapeSpec:
    """One object: ``shape`` in SHAPES, ``color`` a key of COLORS, top-left pixel ``(x, y)``, side ``s`` px."""

    shape: str
    color: str
    x: int
    y: int
    s: int

    @property
    def cx(self) -> float:
        """Box centre, x (pixels, continuous coordinates: pixel i spans [i, i+1))."""
        return self.x + self.s / 2

    @property
    def cy(self) -> float:
        return self.y + self.s / 2

    @property
    def box(self) -> tuple[int, int, int, int]:
        """(x0, y0, x1, y1), x1/y1 exclusive."""
        return self.x, self.y, self.x + self.s, self.y + self.s


@dataclass(frozen=True)
class Scene:
    """A canvas of ``size`` x ``size`` pixels holding ``objects`` (no two overlap)."""

    objects: tuple[ShapeSpec, ...] = field(default_factory=tuple)
    size: int = 32

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.objects:
            out[o.shape] = out.get(o.shape, 0) + 1
        return out


@cache
def shape_mask(shape: str, s: int) -> np.ndarray:
    """Boolean (s, s) mask of ``shape`` filling an s x s box (cached; do not modify the result).

    circle: pixel centres within radius s/2 of the box centre; square: the full box; triangle: isosceles,
    apex up at the top-centre, base the full bottom row.
    """
    c = (np.arange(s) + 0.5) / s  # pixel centres in [0, 1]
    yy, xx = np.meshgrid(c, c, indexing="ij")
    if shape == "circle":
        m = (xx - 0.5) ** 2 + (yy - 0.5) ** 2 <= 0.25
    elif shape == "square":
        m = np.ones((s, s), dtype=bool)
    elif shape == "triangle":
        # half-width grows linearly from ~0 at the top row to 0.5 at the bottom row (pixel-centre test)
        ybot = yy + 0.5 / s
        m = np.abs(xx - 0.5) <= 0.5 * ybot + 0.25 / s
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    m = np.ascontiguousarray(m)
    m.setflags(write=False)
    return m


_COLOR_ARR = {k: np.asarray(v, dtype=np.float32) / 255.0 for k, v in COLORS.items()}
_BG_ARR = np.asarray(BACKGROUND, dtype=np.float32) / 255.0


def _scaled(o: ShapeSpec, f: float) -> ShapeSpec:
    s = max(1, round(o.s * f))
    return ShapeSpec(o.shape, o.color, round(o.cx * f - s / 2), round(o.cy * f - s / 2), s)


def render(scene: Scene, size: int | None = None) -> np.ndarray:
    """Paint ``scene``: (size, size, 3) float32 in [0, 1]. ``size`` defaults to ``scene.size``; another size rescales
    the layout (positions and sides rounded to whole pixels)."""
    size = scene.size if size is None else int(size)
    img = np.empty((size, size, 3), dtype=np.float32)
    img[...] = _BG_ARR
    f = size / scene.size
    for o in scene.objects:
        if f != 1:
            o = _scaled(o, f)
        m = shape_mask(o.shape, o.s)
        y0, x0 = max(o.y, 0), max(o.x, 0)
        y1, x1 = min(o.y + o.s, size), min(o.x + o.s, size)
        if y1 <= y0 or x1 <= x0:
            continue
        img[y0:y1, x0:x1][m[y0 - o.y : y1 - o.y, x0 - o.x : x1 - o.x]] = _COLOR_ARR[o.color]
    return img


def render_batch(scenes, size: int | None = None) -> np.ndarray:
    """Render many scenes: (N, size, size, 3) float32."""
    return np.stack([render(s, size) for s in scenes])


# ---------------------------------------------------------------------------------------------------------------
# relations (GenEval's rule) and placement
# ---------------------------------------------------------------------------------------------------------------

#: GenEval's POSITION_THRESHOLD: offsets are shrunk by this fraction of the summed box dimensions.
POSITION_THRESHOLD = 0.1


def relative_position(a_center, a_dim, b_center, b_dim) -> set[str]:
    """GenEval's ``relative_position(obj_a, obj_b)``: the relations in which A stands to B.

    Offsets are centre differences shrunk by ``POSITION_THRESHOLD * (dim_a + dim_b)`` per axis; a relation holds
    when its normalised shrunk offset exceeds 0.5 (so a diagonal placement can be both "left of" and "above").
    Image y grows downwards, so "above" is a negative dy.
    """
    offset = np.asarray(a_center, dtype=np.float64) - np.asarray(b_center, dtype=np.float64)
    dims = np.asarray(a_dim, dtype=np.float64) + np.asarray(b_dim, dtype=np.float64)
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    rels = set()
    if dx < -0.5:
        rels.add("left of")
    if dx > 0.5:
        rels.add("right of")
    if dy < -0.5:
        rels.add("above")
    if dy > 0.5:
        rels.add("below")
    return rels


def spec_relations(a: ShapeSpec, b: ShapeSpec) -> set[str]:
    return relative_position((a.cx, a.cy), (a.s, a.s), (b.cx, b.cy), (b.s, b.s))


def _disjoint(a: ShapeSpec, b: ShapeSpec, gap: int) -> bool:
    return a.x + a.s + gap <= b.x or b.x + b.s + gap <= a.x or a.y + a.s + gap <= b.y or b.y + b.s + gap <= a.y


def place(
    shapes: list[tuple[str, str]],
    rng: np.random.Generator,
    size: int = 32,
    relation: tuple[str, int, int] | None = None,
    max_tries: int = 2000,
) -> Scene:
    """Random non-overlapping layout of ``shapes`` [(shape, colour), ...] on a ``size`` canvas.

    Sides are uniform in :func:`side_range`; boxes keep ``GAP`` empty pixels between them and ``MARGIN`` to the
    border. ``relation=(rel, i, j)`` demands that object i stands in exactly relation ``rel`` to object j under
    GenEval's rule (and in no perpendicular relation, so the picture is unambiguous). Rejection sampling; on
    failure the side range shrinks.
    """
    lo, hi = side_range(size)
    gap, margin = _gap(size), _margin(size)
    for attempt in range(max_tries):
        cap = hi - (attempt * (hi - lo)) // max(1, max_tries // 2) if attempt >= max_tries // 2 else hi
        cap = max(lo, min(hi, cap))
        objs: list[ShapeSpec] = []
        ok = True
        for shape, color in shapes:
            s = int(rng.integers(lo, cap + 1))
            for _ in range(50):
                x = int(rng.integers(margin, size - margin - s + 1))
                y = int(rng.integers(margin, size - margin - s + 1))
                cand = ShapeSpec(shape, color, x, y, s)
                if all(_disjoint(cand, o, gap) for o in objs):
                    objs.append(cand)
                    break
            else:
                ok = False
                break
        if not ok:
            continue
        if relation is not None:
            rel, i, j = relation
            if spec_relations(objs[i], objs[j]) != {rel}:
                continue
        return Scene(tuple(objs), size)
    raise RuntimeError(f"could not place {shapes} with relation {relation} on a {size}px canvas")
