"""The editing families' random-weight builds (``model=flux_kontext_random`` / ``qwen_image_edit_random``,
:mod:`stepflow.testing.random_edit`): tiny on the CPU and at the published size on the meta device, through the CLI's
own path; the memory table's rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.testing import random_policies as rp  # noqa: E402
from stepflow.testing.harness import base_parameters, random_config_policies  # noqa: E402
from stepflow.testing.random_edit import EDIT_MODELS, EDIT_SPECS, edit_memory_table  # noqa: E402

POLICY = {"flux_kontext": "FluxKontextPolicy", "qwen_image_edit": "QwenImageEditPolicy"}


@pytest.mark.parametrize("model", EDIT_MODELS)
def test_random_edit_config_builds_tiny_and_full_size(model):
    pol, big = random_config_policies(f"{model}_random")
    assert POLICY[model] in {c.__name__ for c in type(pol).__mro__} and pol.takes_source and pol.has_lora
    src = torch.rand(3, 40, 56)  # any size: resized as the family does
    cond = pol.encode(["make it red", "a cat"], [src, src])
    assert cond.image.shape[0] == 2 and cond.image.shape[1] == 16
    with torch.no_grad():
        v = pol.velocity(torch.randn(2, *pol.latent_shape), 0.5, cond, guidance=2.0)
    assert v.shape == (2, *pol.latent_shape) and torch.isfinite(v).all()
    assert base_parameters(big.transformer) == rp.param_counts(EDIT_SPECS[model])["transformer"]
    assert big.latent_shape == (16, 64, 64)


@pytest.mark.slow
def test_the_memory_table_has_the_editing_rows():
    table = edit_memory_table()
    assert "| flux_kontext | 11.90 B | LoRA r=32" in table and "| qwen_image_edit | 20.43 B | full" in table
