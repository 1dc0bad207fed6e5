"""One GRPO iteration (gain and uniform credit) of every new model through the public entry ``stepflow.train.run``
with Hydra compose on ``stepflow/conf``: the tiny FLUX.1-dev / -schnell, Qwen-Image and SD3.5-Large pipelines built
into ``$STEPFLOW_CACHE`` and loaded through the real loaders, with a tiny PickScore (test_rewards_clip) as reward.

The loop's API may be renamed while it is refactored: the call lives in :func:`run_one_iteration` only.
"""

from __future__ import annotations

import csv
import math

import pytest

pytest.importorskip("diffusers")

B = 8  # experiment=smoke: 2 prompts x 4 samples
STEPS = 3

# model config -> (CFG scale of rollouts and evaluation, the pipeline class its saved LoRA loads into)
MODELS = {
    "flux_tiny": (1.0, "FluxPipeline"),          # guidance-distilled: embedded guidance, no CFG
    "flux_schnell_tiny": (1.0, "FluxPipeline"),
    "qwen_image_tiny": (4.0, "QwenImagePipeline"),  # true CFG with " " and the norm rescale
    "sd35_large_tiny": (3.5, "StableDiffusion3Pipeline"),
}


def run_one_iteration(run_dir, *overrides):
    """Compose ``train`` with the smoke experiment and ``overrides``, run one iteration, return the module."""
    from stepflow.testing.harness import smoke_config
    from stepflow.train import run

    return run(smoke_config("loop.iterations=1", *overrides), run_dir)


@pytest.mark.parametrize("advantage", ["gain", "uniform"])
@pytest.mark.parametrize("model", list(MODELS))
def test_one_grpo_iteration(tmp_path, tiny_clip_dir, model, advantage, monkeypatch):
    import diffusers

    from stepflow.testing import tiny_policies as tiny

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    cfg_scale, pipeline_name = MODELS[model]
    module = run_one_iteration(
        tmp_path / "run", f"model={model}", "reward=pickscore", f"reward.model_path={tiny_clip_dir}",
        f"reward.processor_path={tiny_clip_dir}", f"advantage={advantage}", f"loop.guidance={cfg_scale}",
        f"eval.guidance={cfg_scale}", "eval.max_prompts=4", f"loop.num_steps={STEPS}", "lora.rank=2",
        "lora.alpha=4")
    assert module.iteration == 1
    with (tmp_path / "run" / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    train = [r for r in rows if r.get("train/reward_final")]
    assert len(train) == 1 and float(train[0]["train/steps_trained"]) > 0
    assert math.isfinite(float(train[0]["train/reward_final"])) and math.isfinite(float(train[0]["train/grad_norm"]))
    assert float(train[0]["cost/nfe_rollout"]) == B * STEPS * (2 if cfg_scale != 1.0 else 1)
    assert (float(train[0]["cost/nfe_estimate"]) > 0) == (advantage == "gain")
    assert rows[0].get("eval/pickscore")
    # the rollout ran on the model's own grid
    assert float(module.policy.time_grid(STEPS)[0]) == 1.0
    # the saved adapter loads into the model's diffusers pipeline
    lora = tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.is_file()
    cache = tmp_path / "cache"
    base = {"flux_tiny": lambda: tiny.tiny_flux_dir(0, cache, "dev"),
            "flux_schnell_tiny": lambda: tiny.tiny_flux_dir(0, cache, "schnell"),
            "qwen_image_tiny": lambda: tiny.tiny_qwen_image_dir(0, cache),
            "sd35_large_tiny": lambda: tiny.tiny_sd3_dir(0, cache, "large")}[model]()
    pipe = getattr(diffusers, pipeline_name).from_pretrained(str(base))
    pipe.load_lora_weights(str(lora.parent))
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
