"""The shapes_geneval reward: API, components, config, geneval_table."""

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from stepflow.cli import CONF_DIR
from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.shapes_geneval import ShapesGenEvalReward, geneval_table
from stepflow.shapes import CATEGORIES, Scene, ShapeSpec, render, sample_prompt, scene_for_prompt

ROOT = Path(__file__).resolve().parents[1]


def _batch(n, seed=0, categories=CATEGORIES):
    rng = np.random.default_rng(seed)
    recs = [sample_prompt(rng, categories[i % len(categories)]) for i in range(n)]
    imgs = np.stack([render(scene_for_prompt(r["prompt"], rng)) for r in recs])
    return torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous(), [r["prompt"] for r in recs], recs


def test_reward_api_and_components():
    r = ShapesGenEvalReward()
    assert isinstance(r, Reward) and r.name == "shapes_geneval"
    imgs, prompts, recs = _batch(12)
    imgs[0] = torch.from_numpy(render(Scene())).permute(2, 0, 1)  # an empty picture fails its prompt
    out = r(imgs, prompts, recs)
    assert isinstance(out, RewardOut)
    assert out.scores.shape == (12,) and out.scores.dtype == torch.float32
    assert {"strict", "partial", "n_objects"} <= set(out.components)
    for v in out.components.values():
        assert v.shape == (12,)
    assert set(out.components["strict"].tolist()) <= {0.0, 1.0}
    assert ((out.scores >= 0) & (out.scores <= 1)).all()
    assert out.components["strict"][0] == 0 and out.scores[0] < 1
    assert out.components["strict"][1:].eq(1).all() and out.scores[1:].eq(1).all()
    # strict mode scores with the strict component
    s = ShapesGenEvalReward(mode="strict")(imgs, prompts)
    assert torch.equal(s.scores, out.components["strict"])


def test_reward_chunks_and_meta_none():
    r = ShapesGenEvalReward(batch_size=5)
    imgs, prompts, _ = _batch(11, seed=1)
    assert r(imgs, prompts).scores.shape == (11,)


def test_unknown_prompt_raises():
    r = ShapesGenEvalReward()
    imgs, _, _ = _batch(1)
    with pytest.raises(ValueError, match="a photo of a dog"):
        r(imgs, ["a photo of a dog"])
    with pytest.raises(ValueError):
        ShapesGenEvalReward(mode="fuzzy")


def test_geneval_table_keys_and_mean():
    imgs, prompts, recs = _batch(24, seed=2)
    t = geneval_table(imgs, prompts)
    assert set(t) == {"geneval"} | {f"geneval_{c}" for c in CATEGORIES}
    assert t["geneval"] == 1.0
    # break every counting sample: that category drops to 0, overall = mean over categories = 5/6
    for i, rec in enumerate(recs):
        if rec["category"] == "counting":
            imgs[i] = torch.from_numpy(render(Scene((ShapeSpec("square", "red", 2, 2, 9),)))).permute(2, 0, 1)
    t = ShapesGenEvalReward().geneval_table(imgs, prompts)
    assert t["geneval_counting"] == 0.0 and t["geneval"] == pytest.approx(5 / 6)
    # numpy channels-last input works too
    assert geneval_table(imgs.permute(0, 2, 3, 1).numpy(), prompts) == t


def test_config_instantiates():
    cfg = OmegaConf.load(CONF_DIR / "reward" / "shapes_geneval.yaml")
    assert cfg._target_ == "stepflow.rewards.shapes_geneval.ShapesGenEvalReward"
    from hydra.utils import instantiate

    r = instantiate(cfg)
    assert isinstance(r, ShapesGenEvalReward) and r.mode == "partial"


def test_reward_judges_from_metadata():
    """With GenEval metadata (as serve_reward passes it through) the reward judges the metadata, not the prompt
    text: a red circle sent with the metadata of a blue square fails, whatever the prompt string says."""
    img = torch.from_numpy(render(Scene((ShapeSpec("circle", "red", 10, 10, 10),)))).permute(2, 0, 1)[None]
    blue_square = {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "blue"}],
                   "prompt": "a photo of a blue square"}
    red_circle = {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "red"}],
                  "prompt": "a photo of a red circle"}
    r = ShapesGenEvalReward()
    for prompt in ("a photo of a red circle", "a photo of a blue square"):
        out = r(img, [prompt], [blue_square])
        assert out.components["strict"].item() == 0.0 and out.scores.item() == 0.0
        assert r(img, [prompt], [red_circle]).components["strict"].item() == 1.0
    # no metadata, or a record without include: the prompt text is judged
    assert r(img, ["a photo of a red circle"], [{"prompt": "a photo of a red circle"}]).scores.item() == 1.0
    assert r(img, ["a photo of a blue square"]).scores.item() == 0.0
    # metadata needs no prompt of the grammar; malformed metadata is a one-line error naming it
    assert r(img, ["a red disc"], [red_circle]).scores.item() == 1.0
    with pytest.raises(ValueError, match="a photo of a dog"):
        r(img, ["x"], [{"tag": "colors", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"}])
    # the table groups by the metadata's tag
    assert ShapesGenEvalReward().geneval_table(img, ["x"], [red_circle]) == {"geneval": 1.0, "geneval_colors": 1.0}


def test_training_records_judged_alike_from_metadata_and_text():
    """Every record of the world's prompt files carries metadata equal to its prompt's: same verdicts either way."""
    from stepflow.shapes import load_prompts

    recs = load_prompts("train")[::3] + load_prompts("eval")[::5]
    rng = np.random.default_rng(4)
    imgs = np.stack([render(scene_for_prompt(sample_prompt(rng)["prompt"], rng)) for _ in recs])
    imgs = torch.from_numpy(imgs).permute(0, 3, 1, 2)
    prompts = [r["prompt"] for r in recs]
    a, b = ShapesGenEvalReward()(imgs, prompts, recs), ShapesGenEvalReward()(imgs, prompts)
    assert torch.equal(a.scores, b.scores) and torch.equal(a.components["strict"], b.components["strict"])


@pytest.mark.parametrize("bad, match", [
    ({"include": [{"class": "circle", "count": 1}]}, "without a 'tag'"),
    ({"tag": "colors", "include": [{"class": "circle", "count": 0}]}, "count >= 1"),
    ({"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "orange"}]}, "unknown colour"),
    ({"tag": "position", "include": [{"class": "circle", "count": 1, "position": ["left of", 1]},
                                     {"class": "square", "count": 1}]}, "earlier clause"),
    ({"tag": "position", "include": [{"class": "circle", "count": 1},
                                     {"class": "square", "count": 1, "position": ["near", 0]}]}, "position must be"),
    ({"tag": "counting", "include": [{"class": "circle", "count": 2}], "exclude": {"class": "circle"}}, "must be a list"),
])
def test_malformed_metadata_is_a_one_line_error(bad, match):
    imgs, _, _ = _batch(1)
    with pytest.raises(ValueError, match=match) as e:
        ShapesGenEvalReward()(imgs, ["a photo of a circle"], [{**bad, "prompt": "my prompt"}])
    assert "\n" not in str(e.value) and "my prompt" in str(e.value)
