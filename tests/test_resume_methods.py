"""Resume is exact for the newer league methods whose own tests do not already check it (dgpo: test_objectives;
branchgrpo, e_grpo, gardo: their files): 3 iterations in one go and 2 + a resume to 3 end with the same trained
weights, the same objective state (online DPO's reference copy, refreshed every optimizer step here) and the same
training metrics."""

from __future__ import annotations

import math

import pytest
import torch

from stepflow.testing.harness import compose_config, last_train_metrics

BASE = ["experiment=smoke", "reward=pickscore_tiny", "eval.every=0", "eval.max_prompts=2"]
METHODS = {
    "online_dpo": ["objective=online_dpo", "advantage=uniform", "sampler=flow_sde", "loop.same_latent=false",
                   "loop.prompts_per_iter=1", "loop.group_size=8", "objective.ref_update_every=1"],
    "flow_dppo": ["objective=flow_dppo", "sampler=flow_sde", "loop.same_latent=false"],
    "pref_grpo": ["advantage=pref_grpo", "sampler=flow_sde", "loop.prompts_per_iter=1", "loop.group_size=8"],
    "lc_grpo": ["sampler=lc_langevin", "advantage=uniform", "loop.same_latent=false", "train.beta_kl=0.04"],
}


def _tensors(state):
    """Every tensor of a (nested) state dict, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


@pytest.mark.parametrize("method", list(METHODS))
def test_resume_is_exact(tmp_path, method):
    from stepflow.train import run

    args = [*BASE, *METHODS[method]]
    a = run(compose_config("train", [*args, "loop.iterations=3"]), tmp_path / "a")
    run(compose_config("train", [*args, "loop.iterations=2"]), tmp_path / "b")
    b = run(compose_config("train", [*args, "loop.iterations=3",
                                     f"ckpt_path={tmp_path / 'b' / 'checkpoints' / 'last.ckpt'}"]), tmp_path / "b")
    for p, q in zip(a.policy.trainable_parameters(), b.policy.trainable_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    sa, sb = _tensors(a.objective.state_dict()), _tensors(b.objective.state_dict())
    assert len(sa) == len(sb)
    for s, u in zip(sa, sb):
        torch.testing.assert_close(s, u, rtol=0, atol=1e-7)
    last = [last_train_metrics(a), last_train_metrics(b)]
    assert last[0].keys() == last[1].keys() and last[0]
    assert all(math.isclose(last[0][k], last[1][k], rel_tol=1e-5, abs_tol=1e-7) for k in last[0]), last
