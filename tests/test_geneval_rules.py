"""The judge follows GenEval's decision rules (github djghosh13/geneval, evaluation/evaluate_images.py).

Two kinds of evidence:

- crafted rendered scenes, one per rule, whose expected verdict is worked out from GenEval's code (the line is
  quoted in each test), never from ours;
- a transcription of GenEval's ``evaluate_image`` selection and ``evaluate`` decision, run on the same detections
  as our judge over thousands of images (agreement must be 100 %).

Mapping of GenEval's inputs onto the shapes world: the detector's score is our ``conf``; GenEval's presence threshold
(score > 0.3) is our detection gate (every detection passes it, so the transcription uses 0); its counting threshold
(score > 0.9) is our ``COUNTING_THRESHOLD``; ``color_classification`` of a detection is the detection's colour.
"""

import numpy as np
import pytest

from stepflow.shapes import (
    CATEGORIES,
    COLORS,
    SHAPES,
    Scene,
    ShapeSpec,
    all_requirements,
    detect,
    detect_batch,
    evaluate,
    judge,
    judge_batch,
    load_prompts,
    render,
    sample_prompt,
    scene_for_prompt,
)
from stepflow.shapes.detector import COUNTING_THRESHOLD, MAX_OBJECTS, MIN_FIT, Detection
from stepflow.shapes.world import place, shape_mask

# --------------------------------------------------------------------------- GenEval's code, transcribed

POSITION_THRESHOLD = 0.1  # GenEval's default --options position_threshold


def geneval_relative_position(obj_a, obj_b):
    """GenEval's relative_position, verbatim (obj = (box row [x0, y0, x1, y1, score], ...))."""
    boxes = np.array([obj_a[0], obj_b[0]])[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised_offset = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised_offset) < 1e-3):
        return set()
    dx, dy = revised_offset / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def geneval_detected(dets, tag, threshold=0.0, counting_threshold=COUNTING_THRESHOLD, max_objects=16):
    """GenEval's evaluate_image selection, verbatim but for the inputs: per class an (n, 5) array of boxes + scores
    (our conf) and a parallel list of colours; NMS is off (GenEval's default max_overlap 1.0)."""
    detected = {}
    confidence_threshold = threshold if tag != "counting" else counting_threshold
    for classname in SHAPES:
        mine = [d for d in dets if d.shape == classname]
        bbox = np.array([[*d.box, d.conf] for d in mine], dtype=np.float64).reshape(-1, 5)
        colors = [d.color for d in mine]
        ordering = np.argsort(bbox[:, 4])[::-1]
        ordering = ordering[bbox[ordering, 4] > confidence_threshold]
        ordering = ordering[:max_objects].tolist()
        detected[classname] = []
        while ordering:
            max_obj = ordering.pop(0)
            detected[classname].append((bbox[max_obj], colors[max_obj]))
        if not detected[classname]:
            del detected[classname]
    return detected


def geneval_evaluate(objects, metadata):
    """GenEval's evaluate, verbatim but for color_classification (the colours of the found detections)."""
    correct = True
    matched_groups = []
    for req in metadata.get("include", []):
        classname = req["class"]
        matched = True
        found_objects = objects.get(classname, [])[:req["count"]]
        if len(found_objects) < req["count"]:
            correct = matched = False
        else:
            if "color" in req:
                colors = [color for _, color in found_objects]  # color_classification(image, found_objects, ...)
                if colors.count(req["color"]) < req["count"]:
                    correct = matched = False
            if "position" in req and matched:
                expected_rel, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                else:
                    for obj in found_objects:
                        for target_obj in matched_groups[target_group]:
                            true_rels = geneval_relative_position(obj, target_obj)
                            if expected_rel not in true_rels:
                                correct = matched = False
                                break
                        if not matched:
                            break
        if matched:
            matched_groups.append(found_objects)
        else:
            matched_groups.append(None)
    for req in metadata.get("exclude", []):
        classname = req["class"]
        if len(objects.get(classname, [])) >= req["count"]:
            correct = False
    return correct


def geneval_correct(dets, meta):
    return geneval_evaluate(geneval_detected(dets, meta["tag"]), meta)


# --------------------------------------------------------------------------- helpers


def _img(*objs):
    return render(Scene(tuple(ShapeSpec(*o) for o in objs), 32))


def _bitten_circle(img, color, x, y):
    """A circle of side 10 with its bottom-right 6 x 6 corner cut away: still a circle to the detector, but a poor
    fit (IoU 0.61): present, yet below the counting threshold."""
    m = shape_mask("circle", 10).copy()
    m[4:, 4:] = False
    img[y:y + 10, x:x + 10][m] = np.asarray(COLORS[color], np.float32) / 255
    return img


def _meta(prompt):
    return next(r for r in load_prompts("eval") if r["prompt"] == prompt)


def _both(img, spec):
    """Our verdict and the GenEval transcription's on the same detections (they must agree)."""
    r = judge(img, spec)
    meta = spec if isinstance(spec, dict) else _meta_of(spec)
    assert geneval_correct(r.detail["detections"], meta) == r.strict
    return r


def _meta_of(prompt):
    from stepflow.shapes import parse_prompt

    return parse_prompt(prompt).to_meta()


# --------------------------------------------------------------------------- the confidence


def test_confidence_ranks_without_ties():
    """Distinct detections never share a confidence (GenEval's argsort order is then well defined): over thousands
    of rendered and degraded scenes, including same-shape same-size distractors."""
    rng = np.random.default_rng(0)
    imgs = []
    for i in range(1500):
        s = SHAPES[i % 3]
        items = [(s, list(COLORS)[rng.integers(6)]) for _ in range(rng.integers(2, 5))]
        items += [(SHAPES[rng.integers(3)], "white")]
        img = render(place(items, rng))
        if i % 2:
            img = np.clip(img + 0.06 * rng.standard_normal(img.shape), 0, 1).astype(np.float32)
        imgs.append(img)
    n = 0
    for dets in detect_batch(np.stack(imgs)):
        confs = [d.conf for d in dets]
        assert len(set(confs)) == len(confs)
        assert confs == sorted(confs, reverse=True)  # most confident first
        n += len(dets)
    assert n > 4000
    # same shape, same size, both crisp: the tie-break puts the top-left one first
    a, b = detect(_img(("circle", "red", 18, 18, 9), ("circle", "blue", 3, 3, 9)))
    assert (a.color, b.color) == ("blue", "red") and 0 < a.conf - b.conf < 1e-5
    # bigger is more confident at equal fit; a degraded shape is less confident than crisp ones
    big, small = detect(_img(("square", "red", 2, 2, 11), ("square", "red", 18, 18, 7)))
    assert big.box[2] - big.box[0] == 11 and big.conf > small.conf > 0.95
    d = next(d for d in detect(_bitten_circle(_img(("circle", "red", 20, 2, 7)), "red", 3, 16)) if d.fit < 1)
    assert MIN_FIT <= d.fit and d.conf < COUNTING_THRESHOLD


# --------------------------------------------------------------------------- one test per rule


def test_colour_is_judged_on_the_most_confident_detection():
    """GenEval: ``found_objects = objects.get(classname, [])[:req['count']]`` then ``colors.count(req['color']) <
    req['count']`` -> incorrect. A big blue circle (most confident) and a small red one: "a red circle" fails."""
    p = "a photo of a red circle"
    assert not _both(_img(("circle", "blue", 2, 2, 11), ("circle", "red", 20, 20, 7)), p).strict
    assert _both(_img(("circle", "red", 2, 2, 11), ("circle", "blue", 20, 20, 7)), p).strict
    # colour attribution: the same rule per named class
    p = "a photo of a red square and a blue circle"
    assert not _both(_img(("square", "red", 2, 2, 9), ("circle", "green", 18, 2, 11), ("circle", "blue", 18, 20, 7)), p).strict
    assert _both(_img(("square", "red", 2, 2, 9), ("circle", "blue", 18, 2, 11), ("circle", "green", 18, 20, 7)), p).strict
    # count > 1 (metadata): the top-2 circles must both be red; a third, smaller red one does not help
    meta = {"tag": "colors", "include": [{"class": "circle", "count": 2, "color": "red"}], "prompt": "two red circles"}
    assert not _both(_img(("circle", "red", 2, 2, 11), ("circle", "blue", 18, 2, 10), ("circle", "red", 10, 20, 7)), meta).strict
    assert _both(_img(("circle", "red", 2, 2, 11), ("circle", "red", 18, 2, 10), ("circle", "blue", 10, 20, 7)), meta).strict


def test_relation_is_judged_between_the_most_confident_objects():
    """GenEval: ``for obj in found_objects: for target_obj in matched_groups[target_group]: if expected_rel not in
    relative_position(obj, target_obj)`` -> incorrect, with both groups the top-``count`` detections."""
    p = "a photo of a circle left of a square"
    square = ("square", "red", 12, 12, 8)
    # the most confident circle (big) is right of the square; the small one left of it: fails
    assert not _both(_img(square, ("circle", "blue", 22, 11, 10), ("circle", "blue", 1, 13, 7)), p).strict
    assert _both(_img(square, ("circle", "blue", 1, 11, 10), ("circle", "blue", 23, 13, 7)), p).strict
    # the target too: the circle is left of the small square but right of the big (most confident) one
    circle = ("circle", "green", 12, 12, 8)
    assert not _both(_img(circle, ("square", "red", 1, 11, 10), ("square", "red", 23, 13, 7)), p).strict
    assert _both(_img(circle, ("square", "red", 22, 11, 10), ("square", "red", 1, 13, 7)), p).strict


def test_position_needs_a_matched_target():
    """GenEval: ``if matched_groups[target_group] is None`` -> incorrect ("no target"); a group that failed its colour
    check is None. The verdict is already "incorrect" through the target's own clause; what the rule decides is
    that the position clause fails too, i.e. its partial-credit check: square present 1, square red 0, circle
    present 1, circle left of the square 0 ("no target") -> 0.5, although the circle is left of the square."""
    meta = {"tag": "position", "prompt": "a circle left of a red square",
            "include": [{"class": "square", "count": 1, "color": "red"},
                        {"class": "circle", "count": 1, "position": ["left of", 0]}]}
    scene = [("circle", "blue", 2, 12, 8)]
    r = _both(_img(*scene, ("square", "blue", 20, 12, 8)), meta)
    assert not r.strict and r.partial == 0.5
    r = _both(_img(*scene, ("square", "red", 20, 12, 8)), meta)
    assert r.strict and r.partial == 1.0


def test_counting_uses_its_own_threshold():
    """GenEval: ``confidence_threshold = THRESHOLD if metadata['tag'] != "counting" else COUNTING_THRESHOLD``. A bitten
    circle (a poor fit, conf under the counting threshold) is a circle for presence, but not counted."""
    base = _img(("circle", "red", 2, 2, 9), ("circle", "blue", 20, 2, 9))
    img = _bitten_circle(base.copy(), "green", 11, 18)
    bitten = [d for d in detect(img) if d.fit < 1]
    assert len(bitten) == 1 and bitten[0].shape == "circle" and MIN_FIT <= bitten[0].fit
    assert bitten[0].conf <= COUNTING_THRESHOLD
    assert _both(img, "a photo of two circles").strict  # counted: the two crisp ones; exclude (3) not reached
    assert not _both(img, "a photo of three circles").strict
    r = _both(_bitten_circle(_img(), "green", 11, 11), "a photo of a circle")  # presence: it counts
    assert r.strict
    r = _both(_bitten_circle(_img(), "green", 11, 11), "a photo of a green circle")
    assert r.strict
    # partial credit counts the same way: found 2 of 3 -> 0.5
    assert judge(img, "a photo of three circles").partial == 0.5


def test_exclude_lines():
    """GenEval: ``for req in metadata.get('exclude', []): if len(objects.get(classname, [])) >= req['count']`` ->
    incorrect. Its counting prompts exclude count + 1; its other prompts have no exclude lines, so an extra object
    of a named class does not fail them."""
    three = _img(("circle", "red", 2, 2, 8), ("circle", "red", 20, 2, 8), ("circle", "red", 11, 20, 8))
    assert _meta("a photo of two circles")["exclude"] == [{"class": "circle", "count": 3}]
    assert not _both(three, "a photo of two circles").strict
    assert _both(three, "a photo of three circles").strict
    assert _both(three, "a photo of a circle").strict  # single object: no exclude
    assert "exclude" not in _meta("a photo of a circle and a square")
    img = _img(("circle", "red", 2, 2, 8), ("circle", "blue", 20, 2, 8), ("square", "red", 11, 20, 8))
    assert _both(img, "a photo of a circle and a square").strict  # two objects: no exclude either
    # an exclude line on a class that is not included (metadata)
    meta = {"tag": "single_object", "prompt": "a circle, no square",
            "include": [{"class": "circle", "count": 1}], "exclude": [{"class": "square", "count": 1}]}
    r = _both(img, meta)
    assert not r.strict and r.partial == 0.5
    assert _both(three, meta).strict


def test_max_objects_per_class():
    """GenEval: ``ordering = ordering[:MAX_OBJECTS]`` (16): a 17th detection of a class is not seen, by include
    counts or exclude lines."""
    assert MAX_OBJECTS == 16
    dets = [Detection("circle", "red", 1.0 + i, 1.0, 30, (i, 0, i + 6, 6), 0.9 - 0.01 * i, 0.95) for i in range(17)]
    meta = {"tag": "counting", "prompt": "17 circles",
            "include": [{"class": "circle", "count": 16}], "exclude": [{"class": "circle", "count": 17}]}
    assert evaluate(dets, meta).strict and geneval_correct(dets, meta)
    meta["include"][0]["count"] = 17
    assert not evaluate(dets, meta).strict and not geneval_correct(dets, meta)


def test_partial_credit_follows_the_same_rules():
    """partial = mean of the clause checks; counting 0.5 ** |count error| with the counting-threshold count; equals
    1 exactly when strict."""
    p = "a photo of a red circle"
    r = judge(_img(("circle", "blue", 2, 2, 11), ("circle", "red", 20, 20, 7)), p)
    assert r.partial == 0.5  # present, wrong colour on the most confident one
    p = "a photo of a circle left of a square"
    r = judge(_img(("square", "red", 12, 12, 8), ("circle", "blue", 22, 11, 10), ("circle", "blue", 1, 13, 7)), p)
    assert r.partial == pytest.approx(2 / 3)  # both present, relation fails
    vals = [judge(_img(*[("circle", "red", 1 + 8 * i, 12, 7) for i in range(n)]), "a photo of two circles").partial
            for n in range(5)]
    assert vals == [0.25, 0.5, 1.0, 0.5, 0.25]


# --------------------------------------------------------------------------- agreement at scale


def _distractor_scene(rng, req):
    """The prompt's scene plus 1-3 extra shapes, at least one of a named class (the case where the old any-object
    rule and GenEval's most-confident rule part)."""
    scene = scene_for_prompt(req, rng)
    named = [o.shape for o in req.objects]
    extra = [(named[rng.integers(len(named))], list(COLORS)[rng.integers(6)])]
    extra += [(SHAPES[rng.integers(3)], list(COLORS)[rng.integers(6)]) for _ in range(rng.integers(0, 3))]
    items = [(o.shape, o.color) for o in scene.objects] + extra
    try:
        return place(items, rng, max_tries=300)
    except RuntimeError:
        return scene


def test_agreement_with_geneval_transcription():
    """Our strict verdict == GenEval's decision code on the same detections, for every image: rendered prompt
    scenes, scenes with same-class distractors, degraded scenes; each against its prompt and a random one."""
    from stepflow.shapes import parse_prompt

    rng = np.random.default_rng(5)
    reqs = [r for c in CATEGORIES for r in all_requirements(c)]
    imgs, specs = [], []
    for i in range(2400):
        req = parse_prompt(sample_prompt(rng, CATEGORIES[i % 6])["prompt"])
        scene = _distractor_scene(rng, req) if i % 3 else scene_for_prompt(req, rng)
        img = render(scene)
        if i % 4 == 3:
            img = np.clip(img + 0.08 * rng.standard_normal(img.shape), 0, 1).astype(np.float32)
        imgs.append(img)
        specs.append(req if i % 2 else reqs[rng.integers(len(reqs))])
    results = judge_batch(np.stack(imgs), specs)
    n_true = 0
    for spec, r in zip(specs, results):
        meta = spec.to_meta()
        assert geneval_correct(r.detail["detections"], meta) == r.strict, (meta["prompt"], r.detail["checks"])
        assert (r.partial == 1.0) == r.strict
        n_true += r.strict
    assert 0.2 < n_true / len(specs) < 0.8
