"""Pretraining: the data stream, the loss, checkpoint selection, and a 2-step Lightning run end to end."""

import json

import pytest
import torch

from stepflow.pretrain import ShapesStream, flow_matching_loss, sample_t, select_checkpoint
from stepflow.testing.harness import compose_config


def test_stream_batches():
    x0, prompts = next(iter(ShapesStream(batch_size=12, seed=1, empty_prompt_prob=0.5)))
    assert x0.shape == (12, 3, 32, 32) and x0.min() >= -1 and x0.max() <= 1
    assert len(prompts) == 12 and any(p == "" for p in prompts) and any(p for p in prompts)
    x1, p1 = next(iter(ShapesStream(batch_size=12, seed=1, empty_prompt_prob=0.5)))
    assert torch.equal(x0, x1) and prompts == p1  # seeded


def test_sample_t_and_loss():
    for kind in ("logit_normal", "uniform"):
        t = sample_t(1000, kind)
        assert t.min() > 0 and t.max() < 1
    with pytest.raises(ValueError, match="t_sampling"):
        sample_t(3, "cosine")
    # each kind is its own distribution (closed forms, drawn with the same generator): U(0, 1) and sigmoid(N(m, s))
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    torch.testing.assert_close(sample_t(64, "uniform", generator=gen()), torch.rand(64, generator=gen()))
    torch.testing.assert_close(sample_t(64, "logit_normal", 0.5, 2.0, generator=gen()),
                               torch.sigmoid(torch.randn(64, generator=gen()) * 2.0 + 0.5))

    class Exact:  # a "policy" that knows x0 and the noise: zero loss
        def __init__(self, x0, noise):
            self.v = noise - x0

        def encode(self, prompts):
            return None

        def velocity(self, x, t, cond):
            return self.v

    x0, noise = torch.rand(4, 3, 8, 8), torch.randn(4, 3, 8, 8)
    assert flow_matching_loss(Exact(x0, noise), x0, [""] * 4, torch.rand(4), noise).item() == 0


def test_select_checkpoint():
    cats = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
    row = lambda s, g, lo=0.2: {"step": s, "geneval": g, **{f"geneval_{c}": lo for c in cats}}  # noqa: E731
    rows = [row(100, 0.2), row(200, 0.45), row(300, 0.58), row(400, 0.52, lo=0.0), row(500, 0.8)]
    assert select_checkpoint(rows)["step"] == 200  # 400 is closer but has a category at 0
    assert select_checkpoint(rows, tolerance=0.1)["step"] == 300  # the latest one within 0.5 +- 0.1
    assert select_checkpoint([row(1, 0.9)]) is None


def test_one_pretraining_run_writes_checkpoints(tmp_path):
    from stepflow.policies.shapes import ShapesPolicy
    from stepflow.pretrain import run

    overrides = [
        f"out_dir={tmp_path}", "arch.num_layers=2", "arch.num_attention_heads=2", "arch.attention_head_dim=8",
        "arch.text_dim=16", "arch.text_layers=1", "arch.text_heads=2", "arch.pooled_dim=16", "data.batch_size=4",
        "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=1", "trainer.log_every_n_steps=1", "trainer.progress_bar=false",
        "trainer.max_time=null", "eval.every_n_steps=1", "eval.max_prompts=6", "eval.num_steps=2",
        "select.low=0.0", "select.high=1.0", "select.min_category=-1", "select.rescore_top_k=1",
        "select.rescore_max_prompts=6", "optim.warmup_steps=1",
    ]
    cfg = compose_config("pretrain", overrides)
    summary = run(cfg)
    assert summary["steps"] == 2
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    rows = [json.loads(line) for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("geneval_counting" in r for r in rows)
    metrics = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    assert "train/loss" in metrics
    # the selected EMA checkpoint loads as a policy and has a model card
    assert (tmp_path / "selected" / "README.md").is_file()
    pol = ShapesPolicy.from_pretrained(tmp_path / "selected")
    assert pol.config.num_layers == 2
    assert len(list((tmp_path / "grids").glob("*.png"))) == 2

    # resume from the Lightning checkpoint for one more step (fresh data, same run dir, whole history kept)
    cfg = compose_config("pretrain", [o for o in overrides if not o.startswith("trainer.max_steps")]
                         + ["trainer.max_steps=3", f"resume={tmp_path / 'checkpoints' / 'last.ckpt'}"])
    summary = run(cfg)
    assert summary["steps"] == 3
    assert [r["step"] for r in summary["history"] if "step" in r][-1] == 3
    assert len((tmp_path / "evals.jsonl").read_text().splitlines()) == 3
