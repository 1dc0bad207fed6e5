"""The random builders of FLUX.2-dev and Z-Image (``stepflow.testing.random_flux2_zimage``): full size on the meta
device at the published size (no memory), the ``model=flux2_random`` / ``zimage_random`` configs through the CLI's
own build (tiny and full size), one CLI iteration at tiny size (the gpu_check.sh ``img2`` command line), and the
memory table of docs/guide.md, "Video, editing and the newest image models"."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.testing import random_flux2_zimage as rz  # noqa: E402
from stepflow.testing.harness import (  # noqa: E402
    RANDOM_TINY,
    base_parameters,
    compose_config,
    random_config_policies,
    train_random_config_once,
)

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
    pol, big = random_config_policies(f"{model}_random")
    assert POLICY[model] in {c.__name__ for c in type(pol).__mro__} and pol.has_lora
    assert set(compose_config("train", [f"model={model}_random", *RANDOM_TINY]).lora.targets) == \
        set(rz.lora_targets(model))  # recipe/<model>_random.yaml = the real recipe
    assert set(compose_config("train", [f"model={model}"]).lora.targets) == set(rz.lora_targets(model))
    full, _ = random_config_policies(f"{model}_random", "model.finetune=full", full_size=False)
    assert full.finetune == "full" and not full.has_lora
    assert base_parameters(big.transformer) == rz.param_counts(model)["transformer"]
    assert big.latent_shape == FULL[model][0]


def test_memory_table_prints_both_models(capsys):
    assert rz.main(["--world", "8"]) == 0
    out = capsys.readouterr().out
    assert "| flux2 | 32.22 B | LoRA r=32" in out and "| zimage | 6.15 B | full (6.15 B)" in out


@pytest.mark.slow
@pytest.mark.parametrize("model,finetune", [("zimage", "lora"), ("flux2", "full")])
def test_random_config_trains_one_iteration_through_the_cli(tmp_path, model, finetune):
    """gpu_check.sh's img2 command line at tiny size on the CPU: stand-in reward, memory.csv."""
    train_random_config_once(tmp_path, f"{model}_random", finetune)
