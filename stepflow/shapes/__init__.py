"""The embedded world: a procedural miniature of text-to-image generation.

Pictures of coloured shapes (:mod:`.world`), prompts in GenEval's six categories with versioned train/eval files
(:mod:`.prompts`), and a deterministic judge that detects the shapes and applies GenEval's rules to them
(:mod:`.detector`).
"""

from stepflow.shapes.detector import (
    Detection,
    JudgeResult,
    detect,
    detect_batch,
    evaluate,
    geneval_meta,
    judge,
    judge_batch,
)
from stepflow.shapes.prompts import (
    CATEGORIES,
    DISJOINT_CATEGORIES,
    ObjectReq,
    Requirement,
    all_requirements,
    load_prompts,
    parse_prompt,
    prompt_file,
    prompt_space_sizes,
    sample_prompt,
    scene_for_prompt,
    split_requirements,
)
from stepflow.shapes.world import (
    BACKGROUND,
    COLORS,
    RELATIONS,
    SHAPES,
    Scene,
    ShapeSpec,
    relative_position,
    render,
    render_batch,
    shape_mask,
    side_range,
)

__all__ = [
    "BACKGROUND", "CATEGORIES", "COLORS", "DISJOINT_CATEGORIES", "RELATIONS", "SHAPES", "Detection", "JudgeResult",
    "ObjectReq", "Requirement", "Scene", "ShapeSpec", "all_requirements", "detect", "detect_batch", "evaluate",
    "geneval_meta", "judge", "judge_batch",
    "load_prompts", "parse_prompt", "prompt_file", "prompt_space_sizes", "relative_position", "render",
    "render_batch", "sample_prompt", "scene_for_prompt", "shape_mask", "side_range", "split_requirements",
]
