"""model.estimate_vae: a cheap AutoencoderTiny decodes the x̂0 estimates of intermediate states; the final image
keeps the full VAE; the check of how well it preserves the within-group order runs end to end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from stepflow.testing.harness import compose_config

ROOT = Path(__file__).resolve().parents[1]


def test_estimates_use_the_tiny_decoder_and_the_final_image_the_vae(tmp_path, monkeypatch):
    from diffusers import AutoencoderTiny

    from stepflow.core.rollout import estimate_states, rollout, score
    from stepflow.testing.tiny_policies import tiny_taesd_dir
    from stepflow.train import build_module

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    taesd = tiny_taesd_dir()
    module = build_module(compose_config("train", ["experiment=smoke", "model=sd3_tiny", "reward=pickscore_tiny",
                                                   f"+model.estimate_vae={taesd}"]), tmp_path / "run")
    pol, lr = module.policy, module.learner
    assert isinstance(pol.estimate_vae, AutoencoderTiny)
    traj = rollout(pol, lr.plan.plan(0), lr.sampler, 4, 1.0)
    x0 = estimate_states(pol, traj, 2, 1.0)
    cheap = score(pol, lr.reward, traj, x0).rewards
    tiny = pol.estimate_vae
    pol.estimate_vae = None
    full = score(pol, lr.reward, traj, x0).rewards
    torch.testing.assert_close(cheap[:, -1], full[:, -1])  # the final image: the full VAE both times
    assert not torch.allclose(cheap[:, :-1], full[:, :-1])  # the estimates: the tiny decoder
    # the tiny decoder's own scaling: decode(z / scaling + shift), as diffusers' pipelines with AutoencoderTiny
    z = x0[:2, 1]
    want = (tiny.decode(z / tiny.config.scaling_factor + tiny.config.shift_factor, return_dict=False)[0] / 2 + 0.5)
    pol.estimate_vae = tiny
    torch.testing.assert_close(pol.decode(z, estimate=True), want.clamp(0, 1))
    torch.testing.assert_close(pol.decode(z), module.policy.decode(z))


def test_a_missing_estimate_vae_is_one_line(tmp_path, monkeypatch):
    from stepflow.errors import StepflowError
    from stepflow.train import build_module

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    with pytest.raises(StepflowError, match="cannot load model.estimate_vae '/no/taesd'.*set model.estimate_vae=DIR"):
        build_module(compose_config("train", ["experiment=smoke", "model=sd3_tiny", "+model.estimate_vae=/no/taesd"]),
                     tmp_path / "run")


def test_check_estimate_decoder_script(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("ced", ROOT / "experiments" / "check_estimate_decoder.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--tiny", "--batches", "1", "experiment=smoke"])
    assert len(res["reward_rank_corr"]) == 5 and res["reward_rank_corr"][-1] == pytest.approx(1.0)
    assert mod.spearman(torch.tensor([1.0, 2, 3]), torch.tensor([10.0, 30, 20])) == pytest.approx(0.5)
