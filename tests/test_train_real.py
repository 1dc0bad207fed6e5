"""The loop on the real-model code paths: the tiny SD3 pipeline (diffusers) with a tiny PickScore (transformers),
both built, saved and loaded through the same loaders a user's SD3.5-Medium / PickScore_v1 go through."""

from __future__ import annotations

import csv

import pytest

from stepflow.testing.harness import smoke_config


@pytest.mark.parametrize("advantage", ["gain", "uniform"])
def test_one_iteration_sd3_tiny_with_tiny_pickscore(tmp_path, tiny_clip_dir, advantage, monkeypatch):
    from stepflow.train import run

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))  # the tiny pipeline is built, saved, loaded here
    cfg = smoke_config("model=sd3_tiny", "reward=pickscore", f"reward.model_path={tiny_clip_dir}",
                   f"reward.processor_path={tiny_clip_dir}", f"advantage={advantage}", "loop.iterations=1",
                   "loop.guidance=4.5", "eval.max_prompts=4", "eval.guidance=4.5", "loop.num_steps=3",
                   "lora.rank=2", "lora.alpha=4")
    run(cfg, tmp_path / "run")
    with (tmp_path / "run" / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    train = [r for r in rows if r.get("train/reward_final")]
    assert len(train) == 1 and float(train[0]["train/steps_trained"]) > 0
    assert "eval/pickscore" in rows[0] and rows[0]["eval/pickscore"] != ""
    assert float(train[0]["cost/nfe_rollout"]) == 8 * 3 * 2  # B * T, doubled by CFG
    lora = tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.is_file()
    # the adapter loads into diffusers' own pipeline
    from diffusers import StableDiffusion3Pipeline

    from stepflow.testing.tiny_policies import tiny_sd3_dir

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir(0)))
    pipe.load_lora_weights(str(lora.parent))
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
