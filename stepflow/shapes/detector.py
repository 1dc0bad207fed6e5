"""The judge: a deterministic detector of coloured shapes and GenEval's decision rules on its detections.

:func:`detect_batch` (and :func:`detect`, one image) finds objects in images (rendered or model samples: float in
[0, 1], possibly noisy/blurry), a whole batch at a time:

- foreground = pixels far from the background colour; colour = nearest palette colour measured against the segment
  ``background -> colour`` (blurred edge pixels, mixes of colour and background, still get the right colour);
- objects = 4-connected components, split by colour when different colours touch and by erosion when same-colour
  shapes are fused; specks under ``min_area`` are ignored;
- shape from moment features of the object's soft mask (vertical skewness: triangles; diagonal-vs-axis kurtosis:
  squares vs circles), which survive blur and noise;
- ``fit``: IoU of the object's mask with the ideal shape in its bounding box (0 for boxes that are too elongated or
  outside the drawable size range); only ``fit >= MIN_FIT`` makes a detection, so blobs of noise, smears and fused
  clutter are not objects (random colour noise scores ~0.02);
- ``conf``: the detector's confidence, a score that ranks the detections the way a detector's score does (see
  :func:`confidence`): shape fit first, then size, then a 1e-6 raster-order tie-break, so that distinct objects
  never tie and "the most confident circle" is always defined.

:func:`evaluate` / :func:`judge` apply GenEval's rules (``evaluation/evaluate_images.py`` of djghosh13/geneval,
functions ``evaluate_image`` and ``evaluate``) to the detections, judging from GenEval metadata (``tag``,
``include``, ``exclude``; :meth:`Requirement.to_meta` writes it for a prompt of the grammar):

- per class, the detections ordered by ``conf`` (most confident first), at most ``MAX_OBJECTS``; for ``tag ==
  "counting"`` only those with ``conf > COUNTING_THRESHOLD`` (GenEval: score > 0.9 for counting, > 0.3 otherwise;
  our presence threshold is the detection gate ``fit >= MIN_FIT``);
- ``include`` clause ``{class, count}``: at least ``count`` detections of the class;
- ``color``: the clause's ``count`` most confident detections of the class all have the colour (GenEval classifies
  the colour of ``objects[class][:count]``);
- ``position: [rel, i]``: every one of those stands in ``rel`` to every object matched by include clause ``i``
  (the most confident ones), under GenEval's box-centre rule; fails when clause ``i`` did not match;
- ``exclude`` clause ``{class, count}``: fewer than ``count`` detections of the class (counting prompts exclude
  ``count + 1``; GenEval's other categories have no exclude lines, so extra objects do not fail them).

``strict`` is GenEval's ``correct``; ``detail["extra_objects"]`` counts the kept detections beyond what the prompt asks
for and ``detail["exact_scene"]`` is ``strict`` with none (:func:`extra_objects`); ``partial`` (the RL reward) is the mean of the same checks in [0, 1]: one check
per count, colour, position and exclude clause, each 0/1, except that the count of a class that also has an
exclude line is one check ``0.5 ** (distance of the count from [count, exclude count - 1])`` (counting:
``0.5 ** |count error|``). ``partial == 1`` exactly when ``strict``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import ndimage

from stepflow.shapes.prompts import Requirement, parse_prompt
from stepflow.shapes.world import BACKGROUND, COLORS, RELATIONS, SHAPES, relative_position, side_range

_PAL_NAMES = tuple(COLORS)
_PAL = np.asarray([COLORS[c] for c in _PAL_NAMES], dtype=np.float32) / 255.0  # (K, 3)
_BG = np.asarray(BACKGROUND, dtype=np.float32) / 255.0
_DIR = _PAL - _BG  # (K, 3) background -> colour
_DIR_N2 = (_DIR**2).sum(-1)  # (K,)

#: a pixel is foreground when it is at least this far (RGB Euclidean, [0,1] units) from the background;
#: the palette colours are 0.8-1.3 away from it, so this is about 40 % of the way (blur edges, noise tolerated)
FG_THRESHOLD = 0.35
#: shape decision thresholds on the soft-mask moment features (see :func:`shape_features`)
TRIANGLE_SKEW = -0.2
SQUARE_KURT_GAP = 0.17
#: detections whose shape fit is below this are not objects (the counterpart of GenEval's presence threshold,
#: score > 0.3): blobs of noise, smears and fused clutter do not count as a circle/square/triangle.
MIN_FIT = 0.55
#: shapes are drawn in square boxes: a box more elongated than this is not a shape
MAX_ASPECT = 1.6
#: objects are drawn with sides in side_range(size); a box whose longer side is under this fraction of the smallest
#: side, or over 1/this of the largest, is not a shape (e.g. single patch-sized blocks of noise)
SIDE_TOLERANCE = 0.75
#: confidence = fit * (1 - SIZE_WEIGHT * (1 - box area / largest drawn box area)) - TIE_EPS * raster position
SIZE_WEIGHT = 0.05
TIE_EPS = 1e-6
#: GenEval's COUNTING_THRESHOLD counterpart: counting prompts count only detections with conf above this (GenEval:
#: 0.9 on Mask2Former's score, 0.3 for the other tags; the scales differ, so the value is ours). Set where the
#: shape-like detections of random colour noise stop: of 151 such detections in 10,000 random colour-block images,
#: 6 have conf > 0.65; counting scenes blurred with sigma 0.7 / 1.0 (+ noise 0.05) keep their count 99.2 % / 98.5 %
#: of the time, and 94.5 % of the base model's detections are above it.
COUNTING_THRESHOLD = 0.65
#: GenEval's MAX_OBJECTS: at most this many detections per class (the most confident)
MAX_OBJECTS = 16


@dataclass(frozen=True)
class Detection:
    shape: str
    color: str
    cx: float  # centroid, continuous pixel coordinates (pixel i spans [i, i+1))
    cy: float
    area: int  # pixels
    box: tuple[int, int, int, int] = (0, 0, 0, 0)  # x0, y0, x1, y1 (exclusive)
    conf: float = 1.0  # the detector's confidence: ranks detections (see confidence())
    fit: float = 1.0  # shape fit: IoU of the object's mask with the ideal shape in its box

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


def confidence(fit, box_h, box_w, cx, cy, size: int):
    """The detector's confidence of a detection (numpy broadcasting; ``size`` = the canvas side in pixels)::

        conf = fit * (1 - SIZE_WEIGHT * (1 - min(1, box_h * box_w / hi**2))) - TIE_EPS * (cy * size + cx) / size**2

    with ``hi`` the largest drawn side (:func:`side_range`): shape fit first (a crisp shape of the largest size
    scores 1 - tie, the smallest ~0.97), then size (bigger objects are more confident, as with a detector), then a
    1e-6 raster-order tie-break (top-left first) so that distinct objects never tie."""
    hi = side_range(size)[1]
    rel = np.minimum(1.0, np.asarray(box_h, np.float64) * np.asarray(box_w, np.float64) / float(hi * hi))
    raster = (np.asarray(cy, np.float64) * size + np.asarray(cx, np.float64)) / float(size * size)
    return np.asarray(fit, np.float64) * (1.0 - SIZE_WEIGHT * (1.0 - rel)) - TIE_EPS * raster


# ----------------------------------------------------------------------------------------------- detection

_CROSS = np.zeros((3, 3, 3), dtype=bool)
_CROSS[1] = ndimage.generate_binary_structure(2, 1)  # 4-connectivity inside each image, none across images


def _label(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components of each (H, W) plane of a boolean (M, H, W) stack: labels (0 = background, unique
    over the stack, numbered in raster order of each component's first pixel) and their number."""
    lab, n = ndimage.label(mask, structure=_CROSS)
    return lab, int(n)


def _erode(m: np.ndarray) -> np.ndarray:
    """4-neighbour erosion of each plane of (M, H, W); pixels on the image border are eroded."""
    out = m.copy()
    out[:, 1:, :] &= m[:, :-1, :]
    out[:, :-1, :] &= m[:, 1:, :]
    out[:, :, 1:] &= m[:, :, :-1]
    out[:, :, :-1] &= m[:, :, 1:]
    out[:, 0, :] = out[:, -1, :] = False
    out[:, :, 0] = out[:, :, -1] = False
    return out


def _dilate(m: np.ndarray) -> np.ndarray:
    """4-neighbour dilation of each plane of (M, H, W)."""
    out = m.copy()
    out[:, 1:, :] |= m[:, :-1, :]
    out[:, :-1, :] |= m[:, 1:, :]
    out[:, :, 1:] |= m[:, :, :-1]
    out[:, :, :-1] |= m[:, :, 1:]
    return out


#: (source, destination) slices of the four neighbour shifts, in the order a pixel adopts a neighbour's label
_SHIFTS = (((slice(None), slice(None, -1), slice(None)), (slice(None), slice(1, None), slice(None))),
           ((slice(None), slice(1, None), slice(None)), (slice(None), slice(None, -1), slice(None))),
           ((slice(None), slice(None), slice(None, -1)), (slice(None), slice(None), slice(1, None))),
           ((slice(None), slice(None), slice(1, None)), (slice(None), slice(None), slice(None, -1))))


def _dilate_within(labels: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Grow labelled seeds (M, H, W) inside ``mask`` until every reachable mask pixel has a seed's label: each round
    an unlabelled pixel takes the label of its upper, lower, left, then right neighbour (first labelled wins)."""
    lab = labels.copy()
    while True:
        new = lab.copy()
        for src, dst in _SHIFTS:
            take = (new[dst] == 0) & (lab[src] > 0) & mask[dst]
            new[dst][take] = lab[src][take]
        if np.array_equal(new, lab):
            return lab
        lab = new


def _per_label_planes(lab: np.ndarray, n: int) -> np.ndarray:
    """(n + 1,) plane index of every label of a stack labelled by :func:`_label` (entry 0 unused)."""
    plane = np.zeros(n + 1, dtype=np.int64)
    p, _, _ = np.nonzero(lab)
    plane[lab[lab > 0]] = p
    return plane


def _split_fused(masks: np.ndarray, min_area: int) -> np.ndarray:
    """Split same-colour objects that look like several fused shapes (thin bridges), each (H, W) plane of the
    boolean (M, H, W) stack on its own: erode (up to 3 times) until the object falls apart into at least two pieces
    of >= max(2, min_area // 4) px, give every pixel to the nearest piece and keep the parts of >= min_area px if
    there are at least two; otherwise the object stays whole. Returns (M, H, W) part labels (0 = no part; unique
    over the stack); a plane that stays whole is one part."""
    m = masks.shape[0]
    result = np.zeros(masks.shape, dtype=np.int64)
    done = np.zeros(m, dtype=bool)
    cur = masks.copy()
    seed_min = max(2, min_area // 4)
    next_id = 1
    for _ in range(3):
        idx = np.flatnonzero(~done)
        if idx.size == 0:
            break
        cur[idx] = _erode(cur[idx])
        done[idx[~cur[idx].any(axis=(1, 2))]] = True  # eroded away: stays whole
        idx = np.flatnonzero(~done)
        if idx.size == 0:
            break
        lab, n = _label(cur[idx])
        plane = _per_label_planes(lab, n)
        sizes = np.bincount(lab.ravel(), minlength=n + 1)
        keep = sizes >= seed_min
        keep[0] = False
        n_pieces = np.bincount(plane[1:], minlength=idx.size)
        n_keep = np.bincount(plane[1:][keep[1:]], minlength=idx.size)
        decide = (n_pieces >= 2) & (n_keep >= 2)
        if not decide.any():
            continue
        sel = np.flatnonzero(decide)
        seeds = np.where(keep[lab[sel]], lab[sel], 0)
        grown = _dilate_within(seeds, masks[idx[sel]])
        psize = np.bincount(grown.ravel(), minlength=n + 1)
        good = keep & (psize >= min_area)
        n_good = np.bincount(plane[1:][good[1:]], minlength=idx.size)
        for j, g in zip(sel, grown):  # j: position in idx
            if n_good[j] >= 2:
                ids = np.where(good[g], g, 0)
                uniq = np.unique(ids[ids > 0])
                remap = np.zeros(n + 1, dtype=np.int64)
                remap[uniq] = np.arange(next_id, next_id + uniq.size)
                result[idx[j]] = remap[ids]
                next_id += uniq.size
        done[idx[sel]] = True
    whole = ~result.reshape(m, -1).any(axis=1)
    wid = np.flatnonzero(whole)
    result[wid] = np.where(masks[wid], (next_id + np.arange(wid.size))[:, None, None], 0)
    return result


def _pixel_colors(pix: np.ndarray) -> np.ndarray:
    """(N, 3) pixels -> (N,) index of the palette colour whose background->colour segment is nearest (residual of
    the projection of ``pixel - background`` onto each segment, the position along it clipped to [0, 1])."""
    d = [(pix[:, i] - _BG[i])[:, None] for i in range(3)]  # (N, 1) per channel
    alpha = np.clip((d[0] * _DIR[:, 0] + d[1] * _DIR[:, 1] + d[2] * _DIR[:, 2]) / _DIR_N2, 0.0, 1.0)  # (N, K)
    r = [d[i] - alpha * _DIR[:, i] for i in range(3)]
    return (r[0] * r[0] + r[1] * r[1] + r[2] * r[2]).argmin(-1)


def shape_features(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Moment features of soft object masks, (..., h, w) weights >= 0 (e.g. colour opacity in a neighbourhood of the
    object) -> (skew_y, kurt_gap), each of shape (...).

    skew_y: normalised third central moment of the vertical marginal: triangle (apex up, mass at the bottom)
    ~-0.55, circle and square 0. kurt_gap: mean kurtosis of the two diagonal marginals minus that of the two axis
    marginals: square ~0.6 (uniform axis marginal 1.8, triangular diagonal marginal 2.4), circle ~0 (isotropic),
    triangle ~0. Both are invariant to position and scale and degrade slowly under blur and noise, unlike the
    binary fill ratio. An all-zero mask gives (0, 0)."""
    w = np.asarray(weights, dtype=np.float64)
    lead, (h, wd) = w.shape[:-2], w.shape[-2:]
    w = w.reshape(-1, h, wd)
    ys, xs = np.arange(h, dtype=np.float64), np.arange(wd, dtype=np.float64)
    tot = w.sum(axis=(1, 2))
    wn = w / np.where(tot > 0, tot, 1.0)[:, None, None]
    dy = ys - (wn.sum(2) @ ys)[:, None]  # (M, h) centred coordinates
    dx = xs - (wn.sum(1) @ xs)[:, None]  # (M, w)
    powers = np.arange(5)
    # central moments mu[a, b] = sum_yx wn * dx**a * dy**b, a + b <= 4, by two batched contractions
    mu = (np.swapaxes(wn @ dx[:, :, None] ** powers, 1, 2) @ dy[:, :, None] ** powers)  # (M, 5, 5): [dx^a, dy^b]

    def kurt(m4, m2):
        return m4 / np.maximum(m2 * m2, 1e-12)

    skew = mu[:, 0, 3] / np.maximum(mu[:, 0, 2], 1e-12) ** 1.5
    s2, c2 = mu[:, 2, 0] + mu[:, 0, 2], 2 * mu[:, 1, 1]  # second moments of dx +- dy: s2 +- c2
    s4, c4 = mu[:, 4, 0] + 6 * mu[:, 2, 2] + mu[:, 0, 4], 4 * (mu[:, 3, 1] + mu[:, 1, 3])  # fourth: s4 +- c4
    gap = (kurt(s4 + c4, s2 + c2) + kurt(s4 - c4, s2 - c2)) / 2 - (kurt(mu[:, 4, 0], mu[:, 2, 0])
                                                                  + kurt(mu[:, 0, 4], mu[:, 0, 2])) / 2
    empty = tot <= 0
    return np.where(empty, 0.0, skew).reshape(lead), np.where(empty, 0.0, gap).reshape(lead)


def _shape_index(skew: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """Index into SHAPES: triangle when skew_y < TRIANGLE_SKEW, else square when kurt_gap > SQUARE_KURT_GAP,
    else circle."""
    return np.where(skew < TRIANGLE_SKEW, SHAPES.index("triangle"),
                    np.where(gap > SQUARE_KURT_GAP, SHAPES.index("square"), SHAPES.index("circle")))


def _box_ok(bh: np.ndarray, bw: np.ndarray, size: int) -> np.ndarray:
    """Boxes that can hold a drawn shape: not more elongated than MAX_ASPECT, longer side within the drawable range
    widened by SIDE_TOLERANCE."""
    lo, hi = side_range(size)
    long, short = np.maximum(bh, bw), np.minimum(bh, bw)
    return (long <= MAX_ASPECT * short) & (long >= SIDE_TOLERANCE * lo) & (long <= hi / SIDE_TOLERANCE)


def _as_batch(images) -> np.ndarray:
    """(N, H, W, 3) or (N, 3, H, W) numpy/torch -> (N, H, W, 3) float32 in [0, 1]."""
    if hasattr(images, "detach"):
        images = images.detach().cpu().float().numpy()
    a = np.asarray(images, dtype=np.float32)
    if a.ndim != 4:
        raise ValueError(f"detect_batch: expected (N, H, W, 3) or (N, 3, H, W) images, got shape {a.shape}")
    if a.shape[-1] != 3 and a.shape[1] == 3:
        a = np.moveaxis(a, 1, -1)
    return np.clip(a, 0.0, 1.0)


def detect(image, min_area: int | None = None, threshold: float = FG_THRESHOLD,
           min_fit: float | None = None) -> list[Detection]:
    """Objects in one ``image`` ((H, W, 3) or (3, H, W) float in [0, 1], numpy or torch), most confident first;
    see :func:`detect_batch`."""
    if hasattr(image, "detach"):
        image = image.detach().cpu().float().numpy()
    a = np.asarray(image, dtype=np.float32)
    if a.ndim != 3:
        raise ValueError(f"detect: expected an (H, W, 3) image, got shape {a.shape}")
    return detect_batch(a[None], min_area=min_area, threshold=threshold, min_fit=min_fit)[0]


def detect_batch(images, min_area: int | None = None, threshold: float = FG_THRESHOLD,
                 min_fit: float | None = None) -> list[list[Detection]]:
    """Objects in each of ``images`` ((N, H, W, 3) or (N, 3, H, W) float in [0, 1], numpy or torch, square images):
    per image, the detections most confident first (by ``conf``; see the module docstring).

    ``min_area`` defaults to 8 px at 32 x 32, scaled with the image area (the smallest shape has ~25 px).
    Candidates whose shape fit is below ``min_fit`` (default ``MIN_FIT``) are dropped (not objects). Vectorised over
    the batch: a handful of labelling calls per batch, moments and fits of all objects at once."""
    imgs = _as_batch(images)
    n_img, h, w, _ = imgs.shape
    min_fit = MIN_FIT if min_fit is None else float(min_fit)
    if min_area is None:
        min_area = max(2, round(8 * h * w / 1024))
    out: list[list[Detection]] = [[] for _ in range(n_img)]
    if n_img == 0:
        return out
    fg = np.sqrt(((imgs - _BG) ** 2).sum(-1)) > threshold
    if not fg.any():
        return out
    cidx = np.zeros(fg.shape, dtype=np.int64)
    cidx[fg] = _pixel_colors(imgs[fg])
    obj, obj_color = _objects(fg, cidx, min_area)
    part, part_color = _parts(obj, obj_color, min_area)
    for i, d in _measure(imgs, part, part_color, min_fit):
        out[i].append(d)
    for dets in out:
        dets.sort(key=_rank_key)
    return out


def _objects(fg: np.ndarray, cidx: np.ndarray, min_area: int) -> tuple[np.ndarray, np.ndarray]:
    """Foreground components of >= min_area px, split by colour where different colours touch (each colour that
    holds >= max(min_area, 15 %) of the component gives its own >= min_area px pieces): an (N, H, W) object label
    map (0 = none) and each object's colour index ((n_obj + 1,), entry 0 unused)."""
    k = len(_PAL_NAMES)
    lab, n = _label(fg)
    counts = np.bincount(lab[fg] * k + cidx[fg], minlength=(n + 1) * k).reshape(n + 1, k)
    area = counts.sum(1)
    big = area >= min_area
    big[0] = False
    present = counts >= np.maximum(min_area, 0.15 * area)[:, None]
    multi = big & (present.sum(1) >= 2)
    single = big & ~multi
    obj_ids = np.zeros(n + 1, dtype=np.int64)
    obj_ids[single] = np.arange(1, single.sum() + 1)
    obj = obj_ids[lab]
    obj_color = [0] + counts.argmax(1)[single].tolist()
    if multi.any():
        rows = np.flatnonzero(multi[lab].any(axis=(1, 2)))  # images that have multi-colour components
        lab_m, cidx_m = lab[rows], cidx[rows]
        in_multi = multi[lab_m]
        obj_m = obj[rows]
        for c in range(k):
            sub, m = _label(in_multi & (cidx_m == c) & present[lab_m, c])
            if m == 0:
                continue
            keep = np.bincount(sub.ravel(), minlength=m + 1) >= min_area
            keep[0] = False
            ids = np.zeros(m + 1, dtype=np.int64)
            ids[keep] = np.arange(len(obj_color), len(obj_color) + keep.sum())
            obj_m = np.where(sub > 0, ids[sub], obj_m)
            obj_color += [c] * int(keep.sum())
        obj[rows] = obj_m
    return obj, np.asarray(obj_color, dtype=np.int64)


def _parts(obj: np.ndarray, obj_color: np.ndarray, min_area: int) -> tuple[np.ndarray, np.ndarray]:
    """Objects -> parts: objects that are neither compact (fill > 0.72) nor square-ish (aspect < 1.4) go through
    :func:`_split_fused`. Returns the (N, H, W) part label map (1..P, 0 = none) and each part's colour index."""
    n_obj = obj_color.size - 1
    o_img, o_y, o_x = np.nonzero(obj)
    o_id = obj[o_img, o_y, o_x]
    o_area = np.bincount(o_id, minlength=n_obj + 1)
    y0, y1, x0, x1 = _boxes(o_id, o_y, o_x, n_obj)
    bh, bw = y1 - y0, x1 - x0
    fill = o_area / np.maximum(bh * bw, 1)
    aspect = np.maximum(bh, bw) / np.maximum(np.minimum(bh, bw), 1)
    cand = np.flatnonzero(~((fill > 0.72) & (aspect < 1.4)))
    cand = cand[cand > 0]
    is_cand = np.zeros(n_obj + 1, dtype=bool)
    is_cand[cand] = True
    part = np.where(is_cand[obj], 0, obj)  # compact objects are their own part (ids <= n_obj)
    part_color = obj_color
    if cand.size:
        img_of = np.zeros(n_obj + 1, dtype=np.int64)
        img_of[o_id] = o_img
        split = _split_fused(obj[img_of[cand]] == cand[:, None, None], min_area)  # one plane per candidate
        sp, sy, sx = np.nonzero(split)
        part[img_of[cand][sp], sy, sx] = n_obj + split[sp, sy, sx]  # ids n_obj + 1 ...
        sp_color = np.zeros(int(split.max()) + 1, dtype=np.int64)
        sp_color[split[sp, sy, sx]] = obj_color[cand][sp]
        part_color = np.concatenate([obj_color, sp_color[1:]])
    used = np.zeros(part_color.size, dtype=bool)  # renumber 1..P
    used[part[part > 0]] = True
    remap = np.zeros(part_color.size, dtype=np.int64)
    remap[used] = np.arange(1, used.sum() + 1)
    return remap[part], np.concatenate([[0], part_color[used]])


def _measure(imgs: np.ndarray, part: np.ndarray, part_color: np.ndarray, min_fit: float):
    """Shape, fit and confidence of every part; yields (image index, Detection) for those with fit >= min_fit."""
    _, h, w, _ = imgs.shape
    n_part = part_color.size - 1
    if n_part == 0:
        return
    p_img, p_y, p_x = np.nonzero(part)
    p_id = part[p_img, p_y, p_x]
    p_area = np.bincount(p_id, minlength=n_part + 1)
    cx = np.bincount(p_id, weights=p_x, minlength=n_part + 1) / np.maximum(p_area, 1) + 0.5
    cy = np.bincount(p_id, weights=p_y, minlength=n_part + 1) / np.maximum(p_area, 1) + 0.5
    y0, y1, x0, x1 = _boxes(p_id, p_y, p_x, n_part)
    bh, bw = y1 - y0, x1 - x0
    pimg = np.zeros(n_part + 1, dtype=np.int64)
    pimg[p_id] = p_img
    cand = np.arange(1, n_part + 1)
    if min_fit > 0:  # a box that cannot hold a shape has fit 0 whatever the shape: skip its features
        cand = cand[_box_ok(bh[cand], bw[cand], h)]
    if cand.size == 0:
        return

    # soft masks, in windows from (box - 2 px, clipped) covering box + 2 px: the opacity of the part's colour on the
    # part and on the unowned pixels within 2 px of it where that opacity is > 0.2
    win = min(int(max(bh[cand].max(), bw[cand].max())) + 4, max(h, w))
    wy0, wx0 = np.maximum(y0[cand] - 2, 0), np.maximum(x0[cand] - 2, 0)
    ry = wy0[:, None, None] + np.arange(win)[None, :, None]
    rx = wx0[:, None, None] + np.arange(win)[None, None, :]
    inside = (ry < h) & (rx < w)
    gi, gy, gx = pimg[cand][:, None, None], np.minimum(ry, h - 1), np.minimum(rx, w - 1)
    plab = part[gi, gy, gx]
    mine = (plab == cand[:, None, None]) & inside
    region = (_dilate(_dilate(mine)) & (plab == 0) & inside) | mine
    col = part_color[cand]
    crop = imgs[gi, gy, gx] - _BG
    alpha = np.clip((crop * _DIR[col][:, None, None, :]).sum(-1) / _DIR_N2[col][:, None, None], 0.0, 1.0)
    weights = np.where(region & ((alpha > 0.2) | mine), alpha, 0.0)
    shape = _shape_index(*shape_features(weights))

    # shape fit: IoU with the ideal shape stretched over the part's box (the renderer's pixel-centre rules)
    by0, bx0 = y0[cand][:, None, None], x0[cand][:, None, None]
    cbh, cbw = bh[cand][:, None, None], bw[cand][:, None, None]
    yy = ((ry - by0) + 0.5) / cbh
    xx = ((rx - bx0) + 0.5) / cbw
    inbox = (ry >= by0) & (ry < by0 + cbh) & (rx >= bx0) & (rx < bx0 + cbw)
    circle = (xx - 0.5) ** 2 + (yy - 0.5) ** 2 <= 0.25
    triangle = np.abs(xx - 0.5) <= 0.5 * (yy + 0.5 / cbh) + 0.25 / cbw
    s3 = shape[:, None, None]
    templ = inbox & np.where(s3 == SHAPES.index("circle"), circle,
                             np.where(s3 == SHAPES.index("triangle"), triangle, True))
    fit = (mine & templ).sum(axis=(1, 2)) / np.maximum((mine | templ).sum(axis=(1, 2)), 1)
    fit = np.where(_box_ok(bh[cand], bw[cand], h), fit, 0.0)
    conf = confidence(fit, bh[cand], bw[cand], cx[cand], cy[cand], h)
    for j in np.flatnonzero(fit >= min_fit):
        p = cand[j]
        yield int(pimg[p]), Detection(SHAPES[shape[j]], _PAL_NAMES[part_color[p]], float(cx[p]), float(cy[p]),
                                      int(p_area[p]), (int(x0[p]), int(y0[p]), int(x1[p]), int(y1[p])),
                                      float(conf[j]), float(fit[j]))


def _rank_key(d: Detection):
    """Most confident first; the remaining fields only order detections that are equal in everything else."""
    return (-d.conf, d.cy, d.cx, d.box, d.area, d.shape, d.color)


def _boxes(ids: np.ndarray, ys: np.ndarray, xs: np.ndarray, n: int):
    """Bounding boxes (y0, y1, x0, x1; exclusive ends) of labels 1..n from their pixels; (n + 1,) arrays each."""
    big = np.iinfo(np.int64).max
    y0, x0 = np.full(n + 1, big, dtype=np.int64), np.full(n + 1, big, dtype=np.int64)
    y1, x1 = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    np.minimum.at(y0, ids, ys)
    np.minimum.at(x0, ids, xs)
    np.maximum.at(y1, ids, ys + 1)
    np.maximum.at(x1, ids, xs + 1)
    y0[0] = x0[0] = 0
    return y0, y1, x0, x1


# ----------------------------------------------------------------------------------------------- scoring


def _rel_holds(a: Detection, b: Detection, rel: str) -> bool:
    return rel in relative_position(a.box_center, a.dims, b.box_center, b.dims)  # GenEval uses box centres


def geneval_meta(spec: str | Requirement | dict[str, Any]) -> dict[str, Any]:
    """GenEval metadata (``tag``, ``include``, ``exclude``) of a prompt of the grammar, a :class:`Requirement` or a
    metadata record (checked: shapes-world classes, colours and relations, positive counts, position targets that
    name an earlier include clause). Raises a one-line ValueError naming the prompt otherwise."""
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if isinstance(spec, Requirement):
        spec = spec.to_meta()
    if not isinstance(spec, dict) or not isinstance(spec.get("include"), list):
        raise ValueError(f"shapes judge: expected a prompt or GenEval metadata with an 'include' list, got {spec!r}")
    name = spec.get("prompt", spec)
    tag = spec.get("tag", spec.get("category"))
    if not isinstance(tag, str):
        raise ValueError(f"shapes judge: GenEval metadata without a 'tag': {name!r}")

    def clause(c, where, i):
        if not isinstance(c, dict) or c.get("class") not in SHAPES:
            raise ValueError(f"shapes judge: {where} clause {i} of {name!r} names no shape of {SHAPES}: {c!r}")
        if not isinstance(c.get("count"), int) or isinstance(c["count"], bool) or c["count"] < 1:
            raise ValueError(f"shapes judge: {where} clause {i} of {name!r} needs a count >= 1: {c!r}")
        if where == "include" and "color" in c and c["color"] not in COLORS:
            raise ValueError(f"shapes judge: include clause {i} of {name!r}: unknown colour {c['color']!r}")
        if where == "include" and "position" in c:
            pos = c["position"]
            if (not isinstance(pos, list | tuple) or len(pos) != 2 or pos[0] not in RELATIONS
                    or not isinstance(pos[1], int) or not 0 <= pos[1] < i):
                raise ValueError(f"shapes judge: include clause {i} of {name!r}: position must be [relation, index "
                                 f"of an earlier clause], got {pos!r}")
        return c

    include = [clause(c, "include", i) for i, c in enumerate(spec["include"])]
    exclude = spec.get("exclude") or []
    if not isinstance(exclude, list):
        raise ValueError(f"shapes judge: 'exclude' of {name!r} must be a list, got {exclude!r}")
    exclude = [clause(c, "exclude", i) for i, c in enumerate(exclude)]
    return {**spec, "tag": tag, "include": include, "exclude": exclude}


def evaluate(dets: list[Detection], spec: str | Requirement | dict[str, Any]) -> JudgeResult:
    """GenEval's decision (``evaluate_images.py``: ``evaluate_image`` keeps and orders the detections, ``evaluate``
    checks the clauses) on detections, for a prompt, :class:`Requirement` or GenEval metadata; see the module
    docstring for the rules and the partial credit."""
    return _decide(dets, geneval_meta(spec))


def _decide(dets: list[Detection], meta: dict[str, Any]) -> JudgeResult:
    """:func:`evaluate` on checked metadata (:func:`geneval_meta`)."""
    tag = meta["tag"]
    by_class: dict[str, list[Detection]] = {s: [] for s in SHAPES}
    for d in sorted(dets, key=_rank_key):
        if tag != "counting" or d.conf > COUNTING_THRESHOLD:
            by_class[d.shape].append(d)
    by_class = {s: v[:MAX_OBJECTS] for s, v in by_class.items()}
    upper: dict[str, int] = {}  # class -> smallest excluded count
    for e in meta["exclude"]:
        upper[e["class"]] = min(upper.get(e["class"], e["count"]), e["count"])
    checks: dict[str, float] = {}
    matched_groups: list[list[Detection] | None] = []
    for i, req in enumerate(meta["include"]):
        cls, cnt = req["class"], req["count"]
        objs = by_class[cls]
        found = objs[:cnt]  # GenEval: objects[class][:count], the most confident ones
        matched = len(found) >= cnt
        if cls in upper:  # counted from both sides: one graded check
            err = max(cnt - len(objs), len(objs) - (upper[cls] - 1), 0)
            checks[f"{i}: {cnt} <= #{cls} < {upper[cls]} (found {len(objs)})"] = 0.5**err
        else:
            checks[f"{i}: #{cls} >= {cnt} (found {len(objs)})"] = float(matched)
        if "color" in req:
            ok = matched and sum(d.color == req["color"] for d in found) >= cnt
            checks[f"{i}: top {cnt} {cls} {req['color']} (found {[d.color for d in found]})"] = float(ok)
            matched = matched and ok
        if "position" in req:
            rel, t = req["position"]
            target = matched_groups[t]
            ok = matched and target is not None and all(_rel_holds(a, b, rel) for a in found for b in target)
            checks[f"{i}: top {cls} {rel} top {meta['include'][t]['class']}"] = float(ok)
            matched = ok
        matched_groups.append(found if matched else None)
    included = {c["class"] for c in meta["include"]}
    for i, e in enumerate(meta["exclude"]):
        if e["class"] not in included:
            n = len(by_class[e["class"]])
            checks[f"exclude {i}: #{e['class']} < {e['count']} (found {n})"] = float(n < e["count"])
    vals = list(checks.values())
    strict = all(v >= 1.0 for v in vals)
    partial = float(np.mean(vals)) if vals else 1.0
    extra = extra_objects(by_class, meta)
    return JudgeResult(strict, partial, {"category": tag, "checks": checks, "detections": list(dets),
                                         "extra_objects": extra, "exact_scene": bool(strict and extra == 0)})


def extra_objects(by_class: dict[str, list[Detection]], meta: dict[str, Any]) -> int:
    """The objects an image holds that its prompt does not ask for (not a GenEval rule; reported beside it): over
    every class, the detections GenEval's rules keep for the prompt's tag (``by_class``: the counting threshold for
    ``counting``, at most MAX_OBJECTS per class) beyond the sum of the include counts of that class,
    ``sum_c max(0, #c - asked_c)``. An image with ``strict`` and no extra object is an *exact scene*: it holds what the
    prompt asks for and no other object (GenEval's single-, two-object, colour and position rules accept extras)."""
    asked: dict[str, int] = {}
    for c in meta["include"]:
        asked[c["class"]] = asked.get(c["class"], 0) + int(c["count"])
    return int(sum(max(0, len(v) - asked.get(cls, 0)) for cls, v in by_class.items()))


def judge(image, spec: str | Requirement | dict[str, Any], **detect_kwargs) -> JudgeResult:
    """Score ``image`` against a prompt, :class:`Requirement` or GenEval metadata record: GenEval's strict
    correctness and partial credit in [0, 1] (rules in the module docstring)."""
    meta = geneval_meta(spec)
    return _decide(detect(image, **detect_kwargs), meta)


def judge_batch(images, specs, **detect_kwargs) -> list[JudgeResult]:
    """:func:`judge` for a batch ((N, H, W, 3) or (N, 3, H, W)) and N specs, detecting the whole batch at once."""
    arr = _as_batch(images)
    if len(arr) != len(specs):
        raise ValueError(f"shapes judge: {len(arr)} images but {len(specs)} prompts")
    metas = [geneval_meta(s) for s in specs]  # fail fast, before any detection
    return [_decide(d, m) for d, m in zip(detect_batch(arr, **detect_kwargs), metas)]
