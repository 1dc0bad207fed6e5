"""Branch rollouts (stepflow.core.branch): the completion grids, one SDE step from the anchor's state with its density,
the Euler completion against an independent loop and against the rollout itself, and the NFE count."""

from __future__ import annotations

import math

import pytest
import torch

from stepflow.core.branch import branch_at, complete, completion_grid, completion_nfe
from stepflow.math.sde import SamplerConfig
from stepflow.testing.harness import compose_config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from stepflow.core.rollout import rollout
    from stepflow.train import build_module

    m = build_module(compose_config("train", ["experiment=smoke"]), tmp_path_factory.mktemp("branch"))
    lr = m.learner
    plan = lr.plan.plan(0).rows(slice(0, 3))
    anchor = rollout(lr.policy, plan, SamplerConfig(name="ode"), lr.loop.num_steps, 1.0)
    return lr.policy, plan, anchor


def test_completion_grid_is_granular_grpos_suffix():
    times = torch.tensor([1.0, 0.9, 0.7, 0.5, 0.3, 0.1, 0.0])  # T = 6
    assert completion_grid(times, 0).tolist() == pytest.approx([0.7, 0.5, 0.3, 0.1, 0.0])  # σ[2:]
    assert completion_grid(times, 0, 2).tolist() == pytest.approx([0.7, 0.3, 0.0])  # σ[2::2] ends at 0
    assert completion_grid(times, 1, 2).tolist() == pytest.approx([0.5, 0.1, 0.0])  # σ[3::2] + the final 0
    assert completion_grid(times, 4).tolist() == [0.0]
    assert completion_grid(times, 5).numel() == 0  # the last step lands on X_T itself
    assert [completion_nfe(10, k) for k in range(10)] == [10 - k - 1 for k in range(9)] + [0]  # T − k − 1
    assert sum(completion_nfe(10, k) for k in range(9)) == 45  # TempFlow-GRPO: (9+8+…+1) per branch
    with pytest.raises(ValueError, match="granularity"):
        completion_grid(times, 0, 0)


def test_a_noise_free_branch_completes_to_the_anchors_image(setup):
    """With the ODE as the branch's sampler, the branch step is the anchor's own step and the completion follows the
    anchor's grid: the final latent is the anchor's X_T (bit for bit)."""
    pol, plan, anchor = setup
    for k in (0, 2, anchor.num_steps - 1):
        br = branch_at(pol, anchor.latents, anchor.velocities, anchor.times, anchor.cond, k, SamplerConfig(name="ode"),
                       2, plan.step_noise_seeds)
        for j in range(2):
            torch.testing.assert_close(br.final[:, j, 0], anchor.latents[:, -1], rtol=0, atol=1e-6)
        torch.testing.assert_close(br.next[:, 0], anchor.latents[:, k + 1], rtol=0, atol=1e-6)


def test_a_branch_is_one_sde_step_with_its_density_then_an_euler_completion(setup):
    pol, plan, anchor = setup
    k, kk = 1, 3
    sampler = SamplerConfig(name="flow_sde", a=0.7)
    br = branch_at(pol, anchor.latents, anchor.velocities, anchor.times, anchor.cond, k, sampler, kk,
                   plan.step_noise_seeds, granularities=(1, 2))
    assert br.next.shape[:2] == (3, kk) and br.final.shape[:3] == (3, kk, 2)
    assert len({tuple(br.next[0, j].flatten()[:4].tolist()) for j in range(kk)}) == kk  # branches differ
    # the transition's density: a Gaussian of the branch's mean and std, the mean over dims (Flow-GRPO's convention)
    normal = torch.distributions.Normal(br.mean[:, None], br.std.view(-1, 1, 1, 1, 1))
    want = normal.log_prob(br.next).flatten(2).mean(2)
    torch.testing.assert_close(br.log_probs, want, rtol=1e-5, atol=1e-5)
    # the completion: an Euler loop written here from X_{k+1} over τ_{k+2}..τ_T (g = 1) and every other point (g = 2)
    t = anchor.times
    for g, grid in ((0, t[k + 2:]), (1, torch.cat([t[k + 2::2], t[-1:]]) if float(t[k + 2::2][-1]) != 0 else t[k + 2::2])):
        x, tt = br.next[1].clone(), t[k + 1]
        cond = anchor.cond.index([1, 1, 1])
        with torch.no_grad():
            for s in grid:
                x = x + (s - tt) * pol.velocity(x, tt, cond, 1.0)
                tt = s
        torch.testing.assert_close(br.final[1, :, g], x, rtol=1e-5, atol=1e-6)
    # a branch depends on its row alone
    again = branch_at(pol, anchor.latents[1:2], anchor.velocities[1:2], anchor.times, anchor.cond.index([1]), k,
                      sampler, kk, plan.step_noise_seeds[1:2])
    torch.testing.assert_close(again.next[0], br.next[1], rtol=0, atol=0)


def test_branch_nfes_are_counted(setup):
    pol, plan, anchor = setup
    t_steps, kk, b = anchor.num_steps, 2, anchor.batch_size
    n0 = pol.nfe
    for k in range(t_steps - 1):
        branch_at(pol, anchor.latents, anchor.velocities, anchor.times, anchor.cond, k,
                  SamplerConfig(name="flow_sde"), kk, plan.step_noise_seeds)
    assert pol.nfe - n0 == b * kk * t_steps * (t_steps - 1) // 2
    n0 = pol.nfe
    complete(pol, anchor.latents[:, 0], anchor.times[0], anchor.times[1:], anchor.cond, guidance=4.5)
    assert pol.nfe - n0 == 2 * b * t_steps  # CFG: two evaluations per sample and step
    assert math.isfinite(float(anchor.latents[:, -1].abs().max()))


def _credit_quality():
    from helpers.experiments import load_experiment

    return load_experiment("credit_quality")


def test_credit_quality_spearman_is_scipys():
    from scipy.stats import spearmanr

    mod = _credit_quality()
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        a = torch.randint(0, 4, (12,), generator=g).double()  # ties, as the judge's discrete rewards give
        b = a + torch.randint(-2, 3, (12,), generator=g).double()
        assert mod.spearman(a, b) == pytest.approx(float(spearmanr(a.numpy(), b.numpy()).statistic), abs=1e-12)
    assert math.isnan(mod.spearman(torch.ones(4), torch.arange(4.0)))
    est = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 1.0], [1.0, 5.0], [2.0, 5.0], [3.0, 5.0]])
    ref = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [3.0, 1.0], [2.0, 2.0], [1.0, 3.0]])
    rho, frac = mod.group_correlations(est, ref, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert rho[0] == pytest.approx(0.0) and frac[0] == 1.0  # +1 in group 0, −1 in group 1
    assert frac[1] == 0.5 and rho[1] == pytest.approx(spearmanr([0, 0, 1], [1, 2, 3]).statistic)


def test_credit_quality_end_to_end(tmp_path):
    import json

    mod = _credit_quality()
    res = mod.main(["--batches", "1", "--substeps", "1,2", "--out", str(tmp_path), "experiment=smoke",
                    "reward=pickscore_tiny"])
    saved = json.loads((tmp_path / "credit_quality.json").read_text())
    assert saved["samples"] == 8 and set(saved["estimates"]) == {"1", "2"}
    assert saved["nfe_completion"] == 8 * 4 * 5 // 2  # T(T+1)/2 per sample, T = 4
    assert saved["estimates"]["1"]["nfe"] == 0 and saved["estimates"]["2"]["nfe"] > 0  # Tweedie reuses the rollout's v
    assert (tmp_path / "credit_quality.png").stat().st_size > 1000 and res["num_steps"] == 4


def test_credit_quality_curves_accumulate_each_runs_nfes(tmp_path):
    """--curves: the NFEs at an evaluation are the sum of the iterations' forward-equivalent NFEs up to it (a metrics
    row per iteration, evaluations on rows of their own), per source and seed; and the plot is written."""
    mod = _credit_quality()
    rows = ["iteration,cost/nfe_fwd_equiv,eval/geneval", "0,,0.30", "1,10,", "2,12,", "2,,0.40", "3,7,0.50"]
    (tmp_path / "tweedie_seed0.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "tweedie_seed1.csv").write_text("\n".join(rows[:4]) + "\n")
    (tmp_path / "completion_seed0.csv").write_text("iteration,cost/nfe_fwd_equiv,eval/geneval\n0,,0.3\n1,100,0.35\n")
    c = mod.read_curves(tmp_path)
    assert c["tweedie"][0] == [(0.0, 0.0, 0.30), (2.0, 22.0, 0.40), (3.0, 29.0, 0.50)]
    assert c["tweedie"][1] == [(0.0, 0.0, 0.30)] and c["completion"] == [[(0.0, 0.0, 0.3), (1.0, 100.0, 0.35)]]
    assert mod.main(["--curves", str(tmp_path)]) == {} and (tmp_path / "curves.png").stat().st_size > 1000


def test_completion_rewards_are_the_rewards_of_ode_completed_states(tmp_path):
    """advantage.reward_source=completion: the estimate phase completes each needed state by the Euler ODE on the
    rest of the grid; on an ODE rollout every state's completion is the rollout's own final image (so every gain is
    0), and on an SDE rollout it equals an Euler loop written here."""
    from stepflow.core.rollout import rollout
    from stepflow.rollouts.trajectory import estimate, states_needed
    from stepflow.train import build_module

    for sampler in ("ode", "flow_sde"):
        m = build_module(compose_config("train", ["experiment=smoke", "advantage.reward_source=completion",
                                                  "advantage.over=all", f"sampler={sampler}"]), tmp_path / sampler)
        lr = m.learner
        plan = lr.plan.plan(0)
        traj = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance)
        need = states_needed(lr, [0, 1, 2, 3], 0)
        assert need == [0, 1, 2, 3, 4]
        n0 = lr.policy.nfe
        x0 = estimate(lr, traj, need, lr.advantage.completes_states)
        assert lr.policy.nfe - n0 == traj.batch_size * (4 + 3 + 2 + 1)  # T − k per state
        if sampler == "ode":
            for k in need:
                torch.testing.assert_close(x0[:, k], traj.latents[:, -1], rtol=0, atol=1e-5)
        else:
            k, x, t = 1, traj.latents[:, 1].clone(), traj.times
            with torch.no_grad():
                for j in range(k, 4):
                    x = x + (t[j + 1] - t[j]) * lr.policy.velocity(x, t[j], traj.cond, lr.guidance)
            torch.testing.assert_close(x0[:, k], x, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(x0[:, 1], traj.latents[:, -1])  # the SDE's later noise is not in it


def test_a_bad_reward_source_is_one_line(cli):
    r = cli("stepflow.train", "experiment=smoke", "advantage.reward_source=bogus")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("stepflow: error: advantage.reward_source")
