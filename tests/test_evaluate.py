"""Evaluation: deterministic ODE sampling, LoRA loading, and the ``stepflow.evaluate`` CLI on a tiny random model."""

import json

import pytest
import torch

from stepflow.core.heldout import balanced_subset, sample_ode, save_grid
from stepflow.policies.base import read_lora
from stepflow.policies.shapes import ShapesPolicy
from stepflow.testing.harness import compose_config

TINY = dict(num_layers=2, num_attention_heads=2, attention_head_dim=8, text_dim=16, text_layers=1, text_heads=2,
            pooled_dim=16, init="default")
KEYS = {"geneval", *(f"geneval_{c}" for c in ("single_object", "two_object", "counting", "colors", "position",
                                               "color_attr"))}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny") / "model"
    ShapesPolicy.build(**TINY).save_pretrained(d)
    return d


def test_sample_ode_is_deterministic_and_batch_independent(tiny_dir):
    pol = ShapesPolicy.from_pretrained(tiny_dir)
    prompts = ["a photo of a circle", "a photo of a red square", "", "a photo of three triangles", "a photo of a square"]
    a = sample_ode(pol, prompts, num_steps=3, seed=7, batch_size=5)
    b = sample_ode(pol, prompts, num_steps=3, seed=7, batch_size=2)
    c = sample_ode(pol, prompts, num_steps=3, seed=8, batch_size=5)
    assert a.shape == (5, 3, 32, 32) and a.min() >= 0 and a.max() <= 1
    assert torch.allclose(a, b, atol=1e-5) and not torch.allclose(a, c)
    assert sample_ode(pol, prompts[:2], num_steps=2, guidance=2.0).shape == (2, 3, 32, 32)


def test_balanced_subset_covers_categories():
    from stepflow.shapes import load_prompts

    sub = balanced_subset(load_prompts("eval"), 12)
    assert len(sub) == 12 and len({r["category"] for r in sub}) == 6


def test_lora_diffusers_format_round_trip(tiny_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    pol = ShapesPolicy.from_pretrained(tiny_dir)
    pol.add_lora(rank=4, alpha=8)
    with torch.no_grad():
        for n, p in pol.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.3)
    StableDiffusion3Pipeline.save_lora_weights(str(tmp_path / "lora"), transformer_lora_layers=pol.lora_state_dict(),
                                               safe_serialization=True)
    state, info = read_lora(tmp_path / "lora")
    adapted = sorted({n.split(".lora_A.")[0] for n, _ in pol.transformer.named_parameters() if ".lora_A." in n})
    assert info["rank"] == 4 and info["targets"] == adapted  # every adapted module, by its full name
    pol2 = ShapesPolicy.from_pretrained(tiny_dir)
    pol2.load_lora(tmp_path / "lora")
    x, c = torch.randn(2, 3, 32, 32), pol.encode(["a photo of a circle", "a photo of a red square"])
    with torch.no_grad():
        v1, v2 = pol.velocity(x, 0.4, c), pol2.velocity(x, 0.4, c)
    if info["alpha"] == 8:  # diffusers kept the LoraConfig in the file's metadata
        assert torch.allclose(v1, v2, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="lora_path"):
        read_lora(tmp_path / "missing")


def test_save_grid(tmp_path):
    p = save_grid(torch.rand(5, 3, 32, 32), ["a photo of a circle"] * 5, tmp_path / "g.png", ncol=3, title="t")
    assert p.is_file() and p.stat().st_size > 1000


def _compose(overrides):
    return compose_config("evaluate", overrides)


def test_evaluate_cli_writes_table_and_grids(tiny_dir, tmp_path):
    from stepflow.evaluate import evaluate

    cfg = _compose([f"ckpt_path={tiny_dir}", "max_prompts=6", "sampler.num_steps=2", "grid.per_category=1",
                    f"out_dir={tmp_path}"])
    table = evaluate(cfg, tmp_path)
    data = json.loads((tmp_path / "eval.json").read_text())
    assert set(data) == KEYS and data == pytest.approx(table)
    assert all(0 <= v <= 1 for v in data.values())
    assert len(list(tmp_path.glob("samples_*.png"))) == 6
    assert len(json.loads((tmp_path / "samples.json").read_text())["samples"]) == 6


@pytest.mark.parametrize("field,value", [("lora_path", "/nonexistent/lora"), ("prompt_file", "/nonexistent/p.jsonl"),
                                         ("ckpt_path", "/nonexistent/model")])
def test_evaluate_bad_path_is_one_line_error(tiny_dir, tmp_path, capsys, field, value):
    from stepflow.evaluate import main

    overrides = [f"{field}={value}", f"out_dir={tmp_path}"]
    if field != "ckpt_path":
        overrides.append(f"ckpt_path={tiny_dir}")
    with pytest.raises(SystemExit) as e:
        main.task(_compose(overrides))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err


def test_training_evaluation_table_and_its_shards(tiny_dir):
    """evaluate_reward: the GenEval table from the reward's own strict verdicts equals geneval_table on the same
    images, and two ranks that each sample half (gathered) give the one-process numbers and images."""
    from stepflow.core.heldout import evaluate_reward
    from stepflow.rewards.shapes_geneval import ShapesGenEvalReward, geneval_table
    from stepflow.shapes import load_prompts

    pol = ShapesPolicy.from_pretrained(tiny_dir)
    reward = ShapesGenEvalReward()
    recs = balanced_subset(load_prompts("eval"), 13)  # odd: the last rank's shard is padded
    one, imgs, prompts = evaluate_reward(pol, reward, recs, num_steps=2, seed=5)
    table = geneval_table(imgs, prompts)
    assert {k[len("eval/"):]: v for k, v in one.items() if k.startswith("eval/geneval")} == pytest.approx(table)

    class Shard:  # a 2-rank Dist: rank 1's rows were computed before rank 0 gathers
        def __init__(self, rank, other=None):
            self.rank, self.world, self.other, self.rows = rank, 2, other, None

        def gather_rows(self, x):
            self.rows = x
            return x if self.other is None else torch.cat([x, self.other])

        def stop_requested(self):  # the ranks agree on stopping before every batch (none asked here)
            return False

    r1 = Shard(1)
    _, imgs1, _ = evaluate_reward(pol, reward, recs, num_steps=2, seed=5, dist=r1)
    two, imgs0, _ = evaluate_reward(pol, reward, recs, num_steps=2, seed=5, dist=Shard(0, r1.rows))
    assert two == pytest.approx(one)
    torch.testing.assert_close(torch.cat([imgs0, imgs1]), imgs)
