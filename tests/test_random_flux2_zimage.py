"""The random builders of FLUX.2-dev and Z-Image (``stepflow.testing.random_flux2_zimage``): full size on the meta
device at the published size (no memory), the ``model=flux2_random`` / ``zimage_random`` configs through the CLI's
own build (tiny and full size), one CLI iteration at tiny size (the gpu_check.sh ``img2`` command line), and the
memory table of docs/guide.md, "Video, editing and the newest image models"."""

from __future__ import annotations

import csv

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.testing import random_flux2_zimage as rz  # noqa: E402
from stepflow.testing.harness import compose_config, run_cli  # noqa: E402

TINY = ["model.tiny=true", "model.dtype=float32", "model.device=cpu"]
POLICY = {"flux2": "Flux2Policy", "zimage": "ZImagePolicy"}
#: latent shape at 512 px, text token width, transformer config entries of the published model
FULL = {"flux2": ((128, 32, 32), 15360, dict(num_layers=8, num_single_layers=48, num_attention_heads=48,
                                                 attention_head_dim=128, joint_attention_dim=15360, in_channels=128,
                                                 guidance_embeds=True)),
        "zimage": ((16, 64, 64), 2560, dict(dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, cap_feat_dim=2560,
                                            in_channels=16))}


@pytest.mark.parametrize("model", rz.MODELS)
def test_full_size_builds_on_the_meta_device_at_the_published_size(model):
    counts = rz.param_counts(model)
    size = (counts["transformer"] + counts["buffers"]) / 1e9
    assert abs(size - rz.SPECS[model]["published_b"]) / rz.SPECS[model]["published_b"] < 0.01, size
    pol = rz.random_policy(model, device="meta", lora={"rank": 32, "alpha": 64, "targets": rz.lora_targets(model)})
    latent, width, want = FULL[model]
    assert pol.device.type == "meta" and next(pol.transformer.parameters()).dtype == torch.bfloat16
    assert pol.latent_shape == latent and POLICY[model] in {c.__name__ for c in type(pol).__mro__}
    assert sum(p.numel() for p in pol.lora_parameters()) == counts["lora"]
    assert {k: pol.transformer.config[k] for k in want} == want
    c = pol.encode(["a photo of a cat", "a dog"])
    assert c.tokens.shape[2] == width and c.pooled.shape == (2, 0)
    if model == "flux2":
        assert c.tokens.shape[1] == 512 and c.mask is None
    else:
        assert c.mask is not None and c.tokens.shape[1] == 13  # per-prompt lengths (template + words): 13 and 10


@pytest.mark.parametrize("model", rz.MODELS)
def test_random_config_composes_and_builds_tiny_and_full_size(model):
    from stepflow.train import build_policy

    cfg = compose_config("train", [f"model={model}_random", *TINY])
    pol = build_policy(cfg)
    assert POLICY[model] in {c.__name__ for c in type(pol).__mro__} and pol.has_lora
    assert set(cfg.lora.targets) == set(rz.lora_targets(model))  # recipe/<model>_random.yaml = the real recipe
    assert set(compose_config("train", [f"model={model}"]).lora.targets) == set(rz.lora_targets(model))
    full = build_policy(compose_config("train", [f"model={model}_random", "model.finetune=full", *TINY]))
    assert full.finetune == "full" and not full.has_lora
    big = build_policy(compose_config("train", [f"model={model}_random", "model.device=meta"]))
    n = sum(p.numel() for n_, p in big.transformer.named_parameters() if "lora_" not in n_)
    assert n == rz.param_counts(model)["transformer"] and big.latent_shape == FULL[model][0]


def test_memory_table_prints_both_models(capsys):
    assert rz.main(["--world", "8"]) == 0
    out = capsys.readouterr().out
    assert "| flux2 | 32.22 B | LoRA r=32" in out and "| zimage | 6.15 B | full (6.15 B)" in out


@pytest.mark.slow
@pytest.mark.parametrize("model,finetune", [("zimage", "lora"), ("flux2", "full")])
def test_random_config_trains_one_iteration_through_the_cli(tmp_path, model, finetune):
    """gpu_check.sh's img2 command line at tiny size on the CPU: stand-in reward, memory.csv."""
    extra = ["model.save_weights=false", "callbacks.checkpoint=null"] if finetune == "full" else []
    r = run_cli("stepflow.train", f"model={model}_random", *TINY, f"model.finetune={finetune}", *extra,
                "~reward=shapes_geneval", "+reward._target_=stepflow.testing.random_policies.StandInReward",
                "+callbacks.memory._target_=stepflow.testing.random_policies.peak_memory_callback",
                "loop.iterations=1", "loop.prompts_per_iter=1", "loop.group_size=4", "loop.num_steps=3",
                "loop.substeps=1", "train.micro_batch_size=4", "train.beta_kl=0.04", "advantage=gain",
                "sampler=flow_sde", "eval.max_prompts=2", "eval.num_steps=2", "eval.grid_prompts=2",
                f"hydra.run.dir={tmp_path}", timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [x for x in csv.DictReader((tmp_path / "metrics.csv").open()) if x.get("time/iteration_s")]
    assert len(rows) == 1 and float(rows[0]["train/steps_trained"]) > 0
    mem = list(csv.DictReader((tmp_path / "memory.csv").open()))
    assert [m["iteration"] for m in mem] == ["start", "1"]
    if finetune == "full":
        assert (tmp_path / "transformer" / "NOT_SAVED.txt").is_file()
    else:
        assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
