"""Editing data and rewards (issue 45, editing): the edit data format (a .jsonl of instruction + source image path),
the condition that carries a source image (``Cond.image`` / ``Cond.negative``), rewards that receive the source
beside the edited image (``Reward.reads_source``; a reward that ignores it unchanged), and the one-line refusals: an
edit data set on a text-to-image model, a text-only data set on an editing model, a source-reading reward without
sources, a source image that cannot be read (naming the file and the field), before any model loads.
"""

from __future__ import annotations

import json

import pytest
import torch

from stepflow.core.data import load_prompt_file, source_images
from stepflow.errors import PromptFileError, StepflowError
from stepflow.policies.base import SOURCE_KEY, Cond
from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.edit import SourceSimilarity
from stepflow.testing.tiny_edit import write_edit_set


@pytest.fixture
def edit_set(tmp_path):
    return write_edit_set(tmp_path / "set", size=32)


def test_an_edit_set_resolves_each_source_relative_to_its_file(edit_set):
    recs = load_prompt_file(edit_set / "train.jsonl", "data.train_file", source_key="image")
    assert len(recs) == 8 and recs[0]["prompt"].startswith("make the")
    assert recs[0][SOURCE_KEY] == str((edit_set / recs[0]["image"]).resolve())
    assert SOURCE_KEY not in load_prompt_file(edit_set / "train.jsonl", "data.train_file")[0]  # text-only reading
    imgs = source_images(recs[:3], (16, 24))
    assert imgs.shape == (3, 3, 16, 24) and 0 <= imgs.min() and imgs.max() <= 1


@pytest.mark.parametrize("case", ["missing_file", "not_an_image", "no_field", "not_a_string", "txt"])
def test_an_unreadable_source_is_one_line_naming_the_file_and_field(edit_set, case):
    f = edit_set / "train.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    if case == "missing_file":
        rows[2]["image"] = "images/nowhere.png"
    elif case == "not_an_image":
        (edit_set / "images" / "junk.png").write_bytes(b"not a png")
        rows[2]["image"] = "images/junk.png"
    elif case == "no_field":
        del rows[2]["image"]
    elif case == "not_a_string":
        rows[2]["image"] = 3
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if case == "txt":
        f = edit_set / "prompts.txt"
        f.write_text("make it red\n")
    with pytest.raises(PromptFileError) as info:  # a prompt-file error, printed as one line by the entry points
        load_prompt_file(f, "data.train_file", source_key="image")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("data.train_file") and str(f) in msg
    if case != "txt":
        assert f"{f}:3" in msg and "'image'" in msg
    if case in ("missing_file", "not_an_image"):
        assert rows[2]["image"].split("/")[-1] in msg


# ---------------------------------------------------------------------------------------------- the condition
def test_cond_carries_its_image_and_negative_through_every_batch_operation():
    img = torch.arange(3 * 2 * 2 * 2, dtype=torch.float32).view(3, 2, 2, 2)
    neg = Cond(torch.zeros(3, 4, 5), torch.zeros(3, 0), image=img)
    c = Cond(torch.ones(3, 2, 5), torch.zeros(3, 0), image=img, negative=neg)
    r = c.repeat(2)
    assert torch.equal(r.image[1], img[0]) and torch.equal(r.negative.image[5], img[2])
    i = c.index([2, 0])
    assert torch.equal(i.image, img[[2, 0]]) and i.negative.tokens.shape == (2, 4, 5)
    both = Cond.cat([c, c.index([1])])  # padded tokens keep the image; negatives concatenate
    assert both.image.shape[0] == 4 and both.negative.tokens.shape[0] == 4
    mixed = Cond.cat([Cond(torch.zeros(1, 4, 5), torch.zeros(1, 0), image=img[:1]), c.index([0])])
    assert mixed.negative is None and mixed.mask is not None and mixed.mask.shape == (2, 4)
    with pytest.raises(ValueError):
        Cond.cat([c, Cond(torch.ones(1, 2, 5), torch.zeros(1, 0))])  # a source on some rows only


# ---------------------------------------------------------------------------------------------- rewards
class _Plain(Reward):
    name = "plain"

    def score(self, images, prompts, meta):
        return RewardOut(images.mean(dim=(1, 2, 3)))


def test_a_source_reading_reward_gets_the_source_and_a_plain_one_is_unchanged(edit_set):
    recs = load_prompt_file(edit_set / "train.jsonl", "data.train_file", source_key="image")[:2]
    src = source_images(recs, (32, 32))
    r = SourceSimilarity()
    assert torch.allclose(r(src, ["a", "b"], recs).scores, torch.ones(2))  # the source itself: similarity 1
    grey = torch.full_like(src, 0.5)
    expected = 1 - (grey - src).abs().mean(dim=(1, 2, 3))
    assert torch.allclose(r(grey, ["a", "b"], recs).scores, expected)
    assert torch.allclose(r(grey, ["a", "b"], None, source=src).scores, expected)  # an explicit source
    plain = _Plain()
    assert torch.allclose(plain(grey, ["a", "b"], recs).scores, plain(grey, ["a", "b"], None).scores)
    from stepflow.rewards.multi import MultiReward

    multi = MultiReward({"sim": r, "plain": plain}, {"sim": 1.0, "plain": 1.0})
    assert multi.reads_source and torch.allclose(multi(grey, ["a", "b"], recs).components["sim"], expected)


def test_a_source_reading_reward_on_text_prompts_is_one_line():
    with pytest.raises(StepflowError) as info:
        SourceSimilarity()(torch.rand(1, 3, 8, 8), ["a cat"], [{"prompt": "a cat"}])
    assert "\n" not in str(info.value) and "reward=source_similarity" in str(info.value)


# ---------------------------------------------------------------------------------------------- refusals (CLI)
@pytest.mark.parametrize("overrides,field", [
    (["model=flux_tiny", "data=edit_tiny"], "data.source_key=image"),
    (["model=flux_kontext", "data=edit_tiny", "model=sd35_medium"], "data.source_key=image"),
    (["model=flux_kontext"], "data=shapes"),
    (["model=qwen_image_edit_tiny"], "data=shapes"),
    (["model=flux_kontext_random"], "data=shapes"),
    (["model=shapes_tiny", "reward=source_similarity"], "reward:"),
])
def test_data_model_and_reward_mismatches_are_one_line_before_the_model_loads(compose, overrides, field):
    """Settings (no model built): the located ``_target_``'s flags; model=flux_tiny's factory does not say, so its
    refusal comes once the policy is built (build_module), still before the reward loads."""
    from stepflow.train import build_module, settings

    cfg = compose("train", overrides)
    with pytest.raises(StepflowError) as info:
        if overrides[0] == "model=flux_tiny":
            build_module(cfg, run_dir=None)
        else:
            settings(cfg)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(field), msg


def test_an_edit_set_on_an_editing_model_passes_the_rows(compose):
    from stepflow.train import settings

    s = settings(compose("train", ["model=qwen_image_edit", "data=edit_tiny", "reward=source_similarity"]))
    assert s.data.source_key == "image" and s.model_name == "qwen_image_edit"


def test_the_cli_refuses_a_missing_source_in_one_line(cli, tmp_path):
    write_edit_set(tmp_path / "set", size=32)
    (tmp_path / "set" / "images" / "red_circle.png").unlink()
    res = cli("stepflow.train", "experiment=smoke_flux_kontext", f"data.train_file={tmp_path}/set/train.jsonl",
                  f"data.eval_file={tmp_path}/set/eval.jsonl")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert "data.train_file" in last and "red_circle.png" in last and "'image'" in last


# ---------------------------------------------------------------------------------------------- the loop's phases
def test_a_rollout_of_an_edit_plan_carries_each_groups_source_through_estimates_and_scores(compose, edit_set):
    """rollout -> estimate_states -> score on the tiny Kontext twin: each row's condition holds its record's source
    latents (the same within a group), the x̂0 estimates and the reward use them."""
    from stepflow.core.data import PromptPlanner
    from stepflow.core.parts import from_option
    from stepflow.core.rollout import estimate_states, rollout, score
    from stepflow.train import build_policy

    pol = build_policy(compose("train", ["model=flux_kontext_tiny", "lora.rank=2"]))
    recs = load_prompt_file(edit_set / "train.jsonl", "data.train_file", source_key="image")
    plan = PromptPlanner(recs, prompts_per_iter=2, group_size=2, seed=0).plan(0)
    traj = rollout(pol, plan, from_option("sampler", "flow_sde"), num_steps=2, guidance=1.0)
    assert traj.cond.image.shape == (4, 16, 8, 8)  # 32 px sources resized to the 64 px output
    expect = pol.encode(plan.prompts, [m[SOURCE_KEY] for m in plan.meta]).image
    assert torch.equal(traj.cond.image, expect) and torch.equal(traj.cond.image[0], traj.cond.image[1])
    x0 = estimate_states(pol, traj, substeps=2, guidance=1.0)  # substep 1 evaluates the model on every state
    import dataclasses

    for i in range(4):  # batched over rows and states == each trajectory alone (its own source only)
        one = dataclasses.replace(traj, latents=traj.latents[i:i + 1], velocities=traj.velocities[i:i + 1],
                                  log_probs=traj.log_probs[i:i + 1], trainable=traj.trainable[i:i + 1],
                                  cond=traj.cond.index([i]), prompts=traj.prompts[i:i + 1], meta=traj.meta[i:i + 1])
        assert torch.allclose(estimate_states(pol, one, substeps=2, guidance=1.0)[0], x0[i], atol=1e-5)
    sc = score(pol, SourceSimilarity(), traj)
    assert torch.isfinite(sc.rewards[:, -1]).all() and "l1" in sc.components
