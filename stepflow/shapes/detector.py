"""The judge: a deterministic detector of coloured shapes and a GenEval-style scorer.

:func:`detect` finds objects in an image (rendered or a model sample: float in [0, 1], possibly noisy/blurry):
foreground = pixels far from the background colour; colour = nearest palette colour measured against the segment
``background -> colour`` (so blurred edge pixels, mixes of colour and background, still get the right colour);
objects = 4-connected components (split by colour when different colours touch, split by erosion when same-colour
shapes are fused); specks under ``min_area`` are ignored; shape from moment features of the object's soft mask
(vertical skewness: triangles; diagonal-vs-axis kurtosis: squares vs circles), which survive blur and noise.

:func:`judge` scores an image against a prompt: ``strict`` is GenEval's correctness rule (right objects with the
right counts, colours and relative positions), ``partial`` the fraction of satisfied requirements in [0, 1] (the
RL reward; counting gets ``0.5 ** |count error|``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepflow.shapes.prompts import Requirement, parse_prompt
from stepflow.shapes.world import BACKGROUND, COLORS, SHAPES, relative_position, side_range

_PAL_NAMES = tuple(COLORS)
_PAL = np.asarray([COLORS[c] for c in _PAL_NAMES], dtype=np.float32) / 255.0  # (K, 3)
_BG = np.asarray(BACKGROUND, dtype=np.float32) / 255.0
_DIR = _PAL - _BG  # (K, 3) background -> colour
_DIR_N2 = (_DIR**2).sum(-1)  # (K,)

#: a pixel is foreground when it is at least this far (RGB Euclidean, [0,1] units) from the background;
#: the palette colours are 0.8-1.3 away from it, so this is about 40 % of the way (blur edges, noise tolerated)
FG_THRESHOLD = 0.35


@dataclass(frozen=True)
class Detection:
    shape: str
    color: str
    cx: float  # centroid, continuous pixel coordinates (pixel i spans [i, i+1))
    cy: float
    area: int  # pixels
    box: tuple[int, int, int, int] = (0, 0, 0, 0)  # x0, y0, x1, y1 (exclusive)
    conf: float = 1.0  # shape fit: IoU of the object's mask with the ideal shape in its box (see shape_fit)

    @property
    def box_center(self) -> tuple[float, float]:
        return (self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2

    @property
    def dims(self) -> tuple[int, int]:
        return self.box[2] - self.box[0], self.box[3] - self.box[1]


@dataclass
class JudgeResult:
    strict: bool
    partial: float
    detail: dict[str, Any] = field(default_factory=dict)


def _as_hwc(image) -> np.ndarray:
    if hasattr(image, "detach"):
        image = image.detach().cpu().float().numpy()
    a = np.asarray(image, dtype=np.float32)
    if a.ndim != 3:
        raise ValueError(f"detect: expected an (H, W, 3) image, got shape {a.shape}")
    if a.shape[-1] != 3 and a.shape[0] == 3:
        a = np.moveaxis(a, 0, -1)
    return np.clip(a, 0.0, 1.0)


try:  # scipy is a dev extra: use its fast labelling when present, else the pure-numpy one (same components)
    from scipy.ndimage import label as _scipy_label
except ImportError:  # pragma: no cover
    _scipy_label = None


def _label(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components of a boolean mask: (labels with 0 = background, number of components)."""
    if _scipy_label is not None:
        lab, n = _scipy_label(mask)
        return lab.astype(np.int64, copy=False), int(n)
    return _label_numpy(mask)


def _label_numpy(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """Pure-numpy 4-connected labelling (min-label propagation with pointer jumping); labels are numbered in
    raster order of each component's first pixel, as scipy's are."""
    h, w = mask.shape
    big = h * w + 1
    lab = np.where(mask, np.arange(1, h * w + 1, dtype=np.int64).reshape(h, w), big)
    if not mask.any():
        return np.zeros((h, w), dtype=np.int64), 0
    while True:
        m = lab.copy()
        np.minimum(m[1:, :], lab[:-1, :], out=m[1:, :])
        np.minimum(m[:-1, :], lab[1:, :], out=m[:-1, :])
        np.minimum(m[:, 1:], lab[:, :-1], out=m[:, 1:])
        np.minimum(m[:, :-1], lab[:, 1:], out=m[:, :-1])
        m = np.where(mask, m, big)
        # pointer jumping: each pixel adopts the current label of the pixel its label names
        flat = m.ravel()
        idx = np.where(flat < big, flat - 1, 0)
        jumped = np.where(flat < big, np.minimum(flat, flat[idx]), big).reshape(h, w)
        if np.array_equal(jumped, lab):
            break
        lab = jumped
    uniq = np.unique(lab[mask])
    remap = np.zeros(big + 1, dtype=np.int64)
    remap[uniq] = np.arange(1, len(uniq) + 1)
    out = np.where(mask, remap[np.minimum(lab, big)], 0)
    return out, len(uniq)


def _erode(mask: np.ndarray) -> np.ndarray:
    m = mask.copy()
    m[1:, :] &= mask[:-1, :]
    m[:-1, :] &= mask[1:, :]
    m[:, 1:] &= mask[:, :-1]
    m[:, :-1] &= mask[:, 1:]
    m[0, :] = m[-1, :] = False
    m[:, 0] = m[:, -1] = False
    return m


def _dilate(mask: np.ndarray) -> np.ndarray:
    m = mask.copy()
    m[1:, :] |= mask[:-1, :]
    m[:-1, :] |= mask[1:, :]
    m[:, 1:] |= mask[:, :-1]
    m[:, :-1] |= mask[:, 1:]
    return m


def _dilate_within(labels: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Grow labelled seeds inside ``mask`` until every reachable mask pixel has the nearest seed's label."""
    lab = labels.copy()
    while True:
        new = lab.copy()
        for src, dst in (((slice(None, -1), slice(None)), (slice(1, None), slice(None))),
                         ((slice(1, None), slice(None)), (slice(None, -1), slice(None))),
                         ((slice(None), slice(None, -1)), (slice(None), slice(1, None))),
                         ((slice(None), slice(1, None)), (slice(None), slice(None, -1)))):
            take = (new[dst] == 0) & (lab[src] > 0) & mask[dst]
            new[dst][take] = lab[src][take]
        if np.array_equal(new, lab):
            return lab
        lab = new


#: shape decision thresholds on the soft-mask moment features (see :func:`shape_features`)
TRIANGLE_SKEW = -0.2
SQUARE_KURT_GAP = 0.17


def shape_features(weights: np.ndarray) -> dict[str, float]:
    """Moment features of a soft object mask (weights >= 0, e.g. colour opacity in a neighbourhood of the object).

    skew_y: normalised third central moment of the vertical marginal: triangle (apex up, mass at the bottom)
    ~-0.55, circle and square 0. kurt_gap: mean kurtosis of the two diagonal marginals minus that of the two axis
    marginals: square ~0.6 (uniform axis marginal 1.8, triangular diagonal marginal 2.4), circle ~0 (isotropic),
    triangle ~0. Both are invariant to position and scale and degrade slowly under blur and noise, unlike the
    binary fill ratio."""
    h, w = weights.shape
    tot = float(weights.sum())
    if tot <= 0:
        return {"skew_y": 0.0, "kurt_gap": 0.0}
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    wn = weights / tot
    dx = xs - (wn * xs).sum()
    dy = ys - (wn * ys).sum()

    def kurt(u):
        v = (wn * u * u).sum()
        return float((wn * u**4).sum() / max(v * v, 1e-12))

    vy = float((wn * dy * dy).sum())
    skew = float((wn * dy**3).sum() / max(vy, 1e-12) ** 1.5)
    gap = (kurt(dx + dy) + kurt(dx - dy)) / 2 - (kurt(dx) + kurt(dy)) / 2
    return {"skew_y": skew, "kurt_gap": gap}


def classify_shape(weights: np.ndarray) -> str:
    f = shape_features(weights)
    if f["skew_y"] < TRIANGLE_SKEW:
        return "triangle"
    return "square" if f["kurt_gap"] > SQUARE_KURT_GAP else "circle"


#: detections whose shape fit is below this are not objects (GenEval drops low-confidence detections the same way):
#: blobs of noise, smears and fused clutter do not count as a circle/square/triangle.
MIN_CONF = 0.55
#: shapes are drawn in square boxes: a box more elongated than this is not a shape
MAX_ASPECT = 1.6


def shape_template(shape: str, bh: int, bw: int) -> np.ndarray:
    """Boolean (bh, bw) mask of ``shape`` stretched to fill a bh x bw box (same pixel-centre rules as the
    renderer's ``shape_mask``, which it equals for bh == bw)."""
    y = (np.arange(bh) + 0.5) / bh
    x = (np.arange(bw) + 0.5) / bw
    yy, xx = np.meshgrid(y, x, indexing="ij")
    if shape == "circle":
        return (xx - 0.5) ** 2 + (yy - 0.5) ** 2 <= 0.25
    if shape == "square":
        return np.ones((bh, bw), dtype=bool)
    return np.abs(xx - 0.5) <= 0.5 * (yy + 0.5 / bh) + 0.25 / bw


#: objects are drawn with sides in side_range(size); a box whose longer side is under this fraction of the smallest
#: side, or over 1/this of the largest, is not a shape (e.g. single patch-sized blocks of noise)
SIDE_TOLERANCE = 0.75


def shape_fit(part: np.ndarray, shape: str) -> float:
    """Confidence that a binary object mask is ``shape``: IoU with the ideal shape in the mask's bounding box;
    0 when the box is more elongated than ``MAX_ASPECT`` or its size is outside the drawable range (see
    ``SIDE_TOLERANCE``). Crisp rendered shapes give 1."""
    ys, xs = np.nonzero(part)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    bh, bw = y1 - y0, x1 - x0
    lo, hi = side_range(part.shape[0])
    if max(bh, bw) > MAX_ASPECT * min(bh, bw) or max(bh, bw) < SIDE_TOLERANCE * lo or max(bh, bw) > hi / SIDE_TOLERANCE:
        return 0.0
    crop = part[y0:y1, x0:x1]
    t = shape_template(shape, bh, bw)
    return float((crop & t).sum() / max((crop | t).sum(), 1))


def _pixel_colors(pix: np.ndarray) -> np.ndarray:
    """(N, 3) pixels -> (N,) index of the palette colour whose background->colour segment is nearest."""
    d = pix[:, None, :] - _BG  # (N, 1, 3)
    alpha = np.clip((d * _DIR).sum(-1) / _DIR_N2, 0.0, 1.0)  # (N, K) position along each segment
    resid = ((d - alpha[..., None] * _DIR) ** 2).sum(-1)  # (N, K)
    return resid.argmin(-1)


def detect(image, min_area: int | None = None, threshold: float = FG_THRESHOLD,
           min_conf: float | None = None) -> list[Detection]:
    """Objects in ``image`` ((H, W, 3) or (3, H, W) float in [0, 1], numpy or torch), sorted by (cy, cx).

    ``min_area`` defaults to 8 px at 32 x 32, scaled with the image area (the smallest shape has ~25 px).
    Candidates whose :func:`shape_fit` is below ``min_conf`` are dropped (not objects)."""
    img = _as_hwc(image)
    h, w, _ = img.shape
    min_conf = MIN_CONF if min_conf is None else min_conf
    if min_area is None:
        min_area = max(2, round(8 * h * w / 1024))
    fg = np.sqrt(((img - _BG) ** 2).sum(-1)) > threshold
    if not fg.any():
        return []
    cidx = np.zeros((h, w), dtype=np.int64)
    cidx[fg] = _pixel_colors(img[fg])
    labels, n = _label(fg)
    objects: list[tuple[np.ndarray, int]] = []  # (mask, colour index)
    for k in range(1, n + 1):
        comp = labels == k
        area = int(comp.sum())
        if area < min_area:
            continue
        counts = np.bincount(cidx[comp], minlength=len(_PAL_NAMES))
        present = [c for c in np.argsort(-counts) if counts[c] >= max(min_area, 0.15 * area)]
        if len(present) <= 1:
            objects.append((comp, int(counts.argmax())))
            continue
        for c in present:  # different colours touching: split by colour
            sub, m = _label(comp & (cidx == c))
            for j in range(1, m + 1):
                part = sub == j
                if part.sum() >= min_area:
                    objects.append((part, int(c)))
    parts: list[tuple[np.ndarray, int]] = [(p, c) for comp, c in objects for p in _split_fused(comp, min_area)]
    owner = np.full((h, w), -1, dtype=np.int64)
    for i, (p, _) in enumerate(parts):
        owner[p] = i
    out: list[Detection] = []
    for part, c in parts:
        ys, xs = np.nonzero(part)
        y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
        # soft mask: opacity of colour c in a 2-px neighbourhood of the part that no other object owns
        Y0, Y1, X0, X1 = max(y0 - 2, 0), min(y1 + 2, h), max(x0 - 2, 0), min(x1 + 2, w)
        region = _dilate(_dilate(part))[Y0:Y1, X0:X1] & (owner[Y0:Y1, X0:X1] < 0) | part[Y0:Y1, X0:X1]
        crop = img[Y0:Y1, X0:X1] - _BG
        alpha = np.clip((crop * _DIR[c]).sum(-1) / _DIR_N2[c], 0.0, 1.0)
        weights = np.where(region & ((alpha > 0.2) | part[Y0:Y1, X0:X1]), alpha, 0.0)
        shape = classify_shape(weights)
        conf = shape_fit(part, shape)
        if conf < min_conf:
            continue
        out.append(Detection(shape, _PAL_NAMES[c], float(xs.mean() + 0.5), float(ys.mean() + 0.5), int(len(ys)),
                             (int(x0), int(y0), int(x1), int(y1)), conf))
    out.sort(key=lambda d: (d.cy, d.cx))
    return out


def _split_fused(comp: np.ndarray, min_area: int) -> list[np.ndarray]:
    """Split a same-colour component that looks like several fused shapes (thin bridges): erode until it falls
    apart into pieces that are each big enough, then give every pixel to the nearest piece. Compact single shapes
    erode to one piece and are returned unchanged."""
    area = int(comp.sum())
    ys, xs = np.nonzero(comp)
    bh, bw = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    fill = area / float(bh * bw)
    aspect = max(bh, bw) / float(min(bh, bw))
    if fill > 0.72 and aspect < 1.4:
        return [comp]
    cur = comp
    for _ in range(3):
        cur = _erode(cur)
        if cur.sum() == 0:
            return [comp]
        lab, n = _label(cur)
        if n >= 2:
            sizes = np.bincount(lab.ravel())[1:]
            keep = [i + 1 for i in range(n) if sizes[i] >= max(2, min_area // 4)]
            if len(keep) >= 2:
                seeds = np.where(np.isin(lab, keep), lab, 0)
                grown = _dilate_within(seeds, comp)
                parts = [grown == k for k in keep]
                parts = [p for p in parts if p.sum() >= min_area]
                if len(parts) >= 2:
                    return parts
                return [comp]
    return [comp]


# ----------------------------------------------------------------------------------------------- scoring


def _rel_holds(a: Detection, b: Detection, rel: str) -> bool:
    return rel in relative_position(a.box_center, a.dims, b.box_center, b.dims)  # GenEval uses box centres


def evaluate(dets: list[Detection], req: Requirement) -> JudgeResult:
    """Score detections against a parsed requirement (see module docstring)."""
    by_shape: dict[str, list[Detection]] = {s: [] for s in SHAPES}
    for d in dets:
        by_shape[d.shape].append(d)
    checks: dict[str, float] = {}
    cat = req.category
    if cat == "counting":
        o = req.objects[0]
        n = len(by_shape[o.shape])
        checks[f"count {o.shape}={o.count} (found {n})"] = 0.5 ** abs(n - o.count)
    else:
        for o in req.objects:
            found = by_shape[o.shape]
            checks[f"has {o.shape}"] = float(len(found) >= 1)
            if o.color is not None:
                checks[f"{o.shape} is {o.color}"] = float(any(d.color == o.color for d in found))
        if req.relation is not None:
            a, b = req.objects
            ok = any(_rel_holds(da, db, req.relation) for da in by_shape[a.shape] for db in by_shape[b.shape])
            checks[f"{a.shape} {req.relation} {b.shape}"] = float(ok)
    vals = list(checks.values())
    strict = all(v >= 1.0 for v in vals)
    partial = float(np.mean(vals))
    return JudgeResult(strict, partial, {"category": cat, "checks": checks, "detections": dets})


def judge(image, prompt: str | Requirement, **detect_kwargs) -> JudgeResult:
    """Score ``image`` against ``prompt``: strict GenEval correctness and partial credit in [0, 1].

    strict (as GenEval): single_object / two_object: at least one of each named shape; counting: exactly n of
    the shape; colors / color_attr: at least one object of each named shape has the named colour; position: both
    shapes present and some pair stands in the named relation under GenEval's centroid rule (offset shrunk by
    0.1 x the summed box dimensions, normalised offset beyond 0.5). Objects not named by the prompt are ignored.
    partial: mean of the checks (presence of each shape, colour of each shape, the relation), or
    ``0.5 ** |n - count|`` for counting; equals 1 exactly when strict holds.
    """
    req = prompt if isinstance(prompt, Requirement) else parse_prompt(prompt)
    return evaluate(detect(image, **detect_kwargs), req)
