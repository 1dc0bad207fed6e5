"""stepflow.math.advantage (method.md §5, §6) against hand-computed numbers, explicit sums and a numpy re-implementation of
Flow-GRPO's PerPromptStatTracker (flow_grpo/stat_tracking.py: np.mean / np.std (ddof 0) per prompt, + 1e-4)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stepflow.math.advantage import (
    AdvantageConfig,
    AdvantageEstimator,
    EmaBaseline,
    gae,
    gains,
    group_normalize,
    normalize_per_step,
    uniform_advantages,
)

EPS = 1e-4

# Worked example, T = 2.  Group 7 = rows 0, 2; group 3 = rows 1, 3 (interleaved on purpose).
#   row 0: R = [0, 1, 4]  -> g = [ 1, 3]      row 2: R = [0, -1, 0] -> g = [-1, 1]
#   row 1: R = [0, 2, 2]  -> g = [ 2, 0]      row 3: R = [0,  0, 0] -> g = [ 0, 0]
R_EX = torch.tensor([[0.0, 1.0, 4.0], [0.0, 2.0, 2.0], [0.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
GID_EX = torch.tensor([7, 3, 7, 3])


def test_gains_and_telescoping():
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(6, 11, generator=gen, dtype=torch.float64)
    g = gains(r)
    assert g.shape == (6, 10)
    torch.testing.assert_close(g[:, 3], r[:, 4] - r[:, 3])
    torch.testing.assert_close(g.sum(1), r[:, -1] - r[:, 0])
    torch.testing.assert_close(gains(R_EX), torch.tensor([[1.0, 3.0], [2.0, 0.0], [-1.0, 1.0], [0.0, 0.0]]))


def test_joint_normalization_worked_example():
    """Group 7: entries {1, 3, −1, 1}: μ = 1, s = sqrt(8/4) = √2.  Group 3: {2, 0, 0, 0}: μ = 0.5, s = sqrt(3/4)."""
    a = group_normalize(gains(R_EX), GID_EX, eps=EPS)
    s7, s3 = math.sqrt(2.0) + EPS, math.sqrt(0.75) + EPS
    ref = torch.tensor([[0.0, 2 / s7], [1.5 / s3, -0.5 / s3], [-2 / s7, 0.0], [-0.5 / s3, -0.5 / s3]])
    torch.testing.assert_close(a, ref)


def test_per_step_normalization_worked_example_differs_from_joint():
    """Group 7 columns: {1, −1} (μ 0, s 1) and {3, 1} (μ 2, s 1); group 3 columns {2, 0} (μ 1, s 1), {0, 0} (const)."""
    a = normalize_per_step(gains(R_EX), GID_EX, eps=EPS)
    u = 1 / (1 + EPS)
    ref = torch.tensor([[u, u], [u, 0.0], [-u, -u], [-u, 0.0]])
    torch.testing.assert_close(a, ref)
    assert not torch.allclose(a, group_normalize(gains(R_EX), GID_EX, eps=EPS))


def test_global_std_scope_worked_example():
    """Means per group (1 and 0.5) but one std over all 8 entries: mean 0.75, Σ dev² = 11.5, s = sqrt(11.5/8)."""
    a = group_normalize(gains(R_EX), GID_EX, std_scope="global", eps=EPS)
    s = math.sqrt(11.5 / 8) + EPS
    ref = torch.tensor([[0.0, 2 / s], [1.5 / s, -0.5 / s], [-2 / s, 0.0], [-0.5 / s, -0.5 / s]])
    torch.testing.assert_close(a, ref)
    # per-step + global: column k's std over all rows: col0 {1,2,−1,0} -> sqrt(5/4); col1 {3,0,1,0} -> sqrt(6/4)
    p = normalize_per_step(gains(R_EX), GID_EX, std_scope="global", eps=EPS)
    c0, c1 = math.sqrt(1.25) + EPS, math.sqrt(1.5) + EPS
    ref_p = torch.tensor([[1 / c0, 1 / c1], [1 / c0, 0.0], [-1 / c0, -1 / c1], [-1 / c0, 0.0]])
    torch.testing.assert_close(p, ref_p)


def test_eps_is_added_to_std():
    a = group_normalize(torch.tensor([1.0, -1.0]), torch.tensor([0, 0]), eps=0.5)
    torch.testing.assert_close(a, torch.tensor([1 / 1.5, -1 / 1.5]))


def _flow_grpo_tracker(prompts, rewards, global_std=False):
    """numpy re-implementation of Flow-GRPO's PerPromptStatTracker.update (grpo branch, fresh tracker)."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    adv = np.zeros_like(rewards)
    for p in np.unique(prompts):
        pr = rewards[prompts == p]
        mean = np.mean(pr, axis=0, keepdims=True)
        std = (np.std(rewards, axis=0, keepdims=True) if global_std else np.std(pr, axis=0, keepdims=True)) + 1e-4
        adv[prompts == p] = (pr - mean) / std
    return adv


@pytest.mark.parametrize("global_std", [False, True])
def test_uniform_and_per_step_match_flow_grpo_tracker(global_std):
    gen = torch.Generator().manual_seed(1)
    prompts = ["a cat", "a dog", "a cat", "two mice", "a dog", "a cat", "two mice", "a dog", "two mice"]
    ids = torch.tensor([{"a cat": 0, "a dog": 5, "two mice": 2}[p] for p in prompts])
    scope = "global" if global_std else "group"
    final = torch.rand(9, generator=gen, dtype=torch.float64)
    ref = _flow_grpo_tracker(prompts, final.numpy(), global_std)
    ua = uniform_advantages(final, ids, 10, std_scope=scope)
    assert ua.shape == (9, 10)
    np.testing.assert_allclose(ua.numpy(), np.repeat(ref[:, None], 10, axis=1), rtol=1e-5, atol=1e-6)
    # method.md §5 pitfall: the tracker fed a (B, T) gain matrix does per-step normalisation
    g = torch.randn(9, 4, generator=gen, dtype=torch.float64)
    np.testing.assert_allclose(normalize_per_step(g, ids, std_scope=scope).numpy(),
                               _flow_grpo_tracker(prompts, g.numpy(), global_std), rtol=1e-5, atol=1e-6)


def test_gae_limits_and_explicit_sum():
    gen = torch.Generator().manual_seed(2)
    r = torch.rand(5, 11, generator=gen, dtype=torch.float64)
    g = gains(r)
    torch.testing.assert_close(gae(g, 1.0, 0.0), g)
    torch.testing.assert_close(gae(g, 0.0, 0.9), g)
    torch.testing.assert_close(gae(g, 1.0, 1.0), r[:, -1:] - r[:, :-1])  # R_T − R_k
    c = 0.9 * 0.5
    ref = torch.stack([sum(c**j * g[:, k + j] for j in range(10 - k)) for k in range(10)], dim=1)
    torch.testing.assert_close(gae(g, 0.9, 0.5), ref)


def test_ema_baseline_subtract_then_update_and_restore():
    gen = torch.Generator().manual_seed(3)
    gs = [torch.randn(6, 4, generator=gen, dtype=torch.float64) for _ in range(4)]
    e = EmaBaseline(0.8)
    out1 = e(gs[0])
    torch.testing.assert_close(out1, gs[0] - gs[0].mean(0))  # first call: b initialised to the batch mean
    out2 = e(gs[1])
    torch.testing.assert_close(out2, gs[1] - gs[0].mean(0))  # subtract the baseline *before* updating
    torch.testing.assert_close(e.b, 0.8 * gs[0].mean(0) + 0.2 * gs[1].mean(0))
    state = e.state_dict()
    cont = [e(gs[2]), e(gs[3])]
    fresh = EmaBaseline(0.3)
    fresh.load_state_dict(state)
    again = [fresh(gs[2]), fresh(gs[3])]
    for a, b in zip(cont, again):
        assert torch.equal(a, b)
    assert fresh.alpha == 0.8 and fresh.num_updates == 4
    # the saved state was a copy, not a view of the live baseline
    torch.testing.assert_close(state["b"], 0.8 * gs[0].mean(0) + 0.2 * gs[1].mean(0))


def _rewards(b=8, t=5, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(b, t + 1, generator=gen), torch.arange(b) // 4


def test_assigner_schemes_compose_the_primitives():
    r, ids = _rewards()
    g = gains(r.double())
    for scheme, ref in [
        ("gain", group_normalize(g, ids)),
        ("gain_per_step", normalize_per_step(g, ids)),
        ("gae", group_normalize(gae(g, 1.0, 0.9), ids)),
        ("uniform", uniform_advantages(r[:, -1], ids, 5)),
    ]:
        # each option as its YAML defines it, with the group std (uniform's YAML sets Flow-GRPO's global std)
        out = AdvantageEstimator(AdvantageConfig(scheme=scheme, std_scope="group"))(r, ids, 5)
        torch.testing.assert_close(out.advantages, ref.clamp(-5, 5), msg=scheme)
        assert out.advantages.dtype == torch.float32 and out.advantages.shape == (8, 5)
        assert (out.gains is None) == (scheme == "uniform")
    per = AdvantageEstimator(AdvantageConfig(scheme="gain", norm="per_step"))(r, ids, 5).advantages
    torch.testing.assert_close(per, normalize_per_step(g, ids))
    joint = AdvantageEstimator(AdvantageConfig(scheme="gain_per_step", norm="joint"))(r, ids, 5).advantages
    torch.testing.assert_close(joint, group_normalize(g, ids))
    glob = AdvantageEstimator(AdvantageConfig(scheme="gain", std_scope="global"))(r, ids, 5).advantages
    torch.testing.assert_close(glob, group_normalize(g, ids, std_scope="global"))


def test_assigner_ema_scheme_and_state_dict():
    r1, ids = _rewards(seed=5)
    r2, _ = _rewards(seed=6)
    r3, _ = _rewards(seed=7)
    a = AdvantageEstimator(AdvantageConfig(scheme="gain_ema", ema_alpha=0.5))
    a(r1, ids, 5)
    out2 = a(r2, ids, 5)
    b1 = gains(r1.double()).mean(0)
    torch.testing.assert_close(out2.advantages, group_normalize(gains(r2.double()) - b1, ids).clamp(-5, 5))
    state = a.state_dict()
    out3 = a(r3, ids, 5)
    b = AdvantageEstimator(AdvantageConfig(scheme="gain_ema", ema_alpha=0.5))
    b.load_state_dict(state)
    assert torch.equal(b(r3, ids, 5).advantages, out3.advantages)
    assert AdvantageEstimator(AdvantageConfig()).state_dict() == {}


def test_zero_groups_clip_and_stats():
    """Group 0: identical trajectories (all gains 0 under joint norm -> zero); group 1: one outlier among 40."""
    flat = torch.full((4, 3), 0.25)
    outl = torch.zeros(40, 3)
    outl[0, -1] = 1.0
    r = torch.cat([flat, outl])
    ids = torch.cat([torch.zeros(4), torch.ones(40)]).long()
    out = AdvantageEstimator(AdvantageConfig(scheme="uniform", adv_clip=5.0))(r, ids, 2)
    # outlier: (1 − 1/40) / sqrt(p(1−p)), p = 1/40  ≈ 6.24 > 5 -> clipped
    assert (1 - 1 / 40) / (math.sqrt(1 / 40 * 39 / 40) + EPS) > 5
    assert out.advantages[4, 0].item() == 5.0 and out.advantages.max().item() == 5.0
    assert out.stats["zero_groups"] == 1.0 and out.stats["zero_rows"] == 4.0
    assert out.stats["adv_clip_frac"] == pytest.approx(2 / (44 * 2))
    for k in range(2):
        assert out.stats[f"adv_abs_mean_step{k}"] == pytest.approx(out.advantages[:, k].abs().mean().item())
    # stepwise: identical trajectories in a group are zero only per-step (joint sees 2 different gain values)
    r2 = torch.tensor([[0.1, 0.5, 0.3], [0.1, 0.5, 0.3], [0.0, 0.2, 0.9], [0.0, 0.4, 0.1]])
    ids2 = torch.tensor([0, 0, 1, 1])
    per = AdvantageEstimator(AdvantageConfig(scheme="gain_per_step"))(r2, ids2, 2)
    joint = AdvantageEstimator(AdvantageConfig(scheme="gain"))(r2, ids2, 2)
    assert per.stats["zero_groups"] == 1.0 and joint.stats["zero_groups"] == 0.0
    assert torch.equal(per.advantages[:2], torch.zeros(2, 2))
    for k in range(2):
        assert joint.stats[f"gain_abs_mean_step{k}"] == pytest.approx(gains(r2)[:, k].abs().mean().item())


def test_uniform_reads_only_the_final_column():
    r, ids = _rewards()
    r_nan = r.clone()
    r_nan[:, :-1] = float("nan")
    a = AdvantageEstimator(AdvantageConfig(scheme="uniform"))
    assert not a.needs_stepwise_rewards and AdvantageEstimator(AdvantageConfig()).needs_stepwise_rewards
    torch.testing.assert_close(a(r_nan, ids, 5).advantages, a(r, ids, 5).advantages)
    with pytest.raises(ValueError, match="^rewards:"):
        AdvantageEstimator(AdvantageConfig(scheme="gain"))(r_nan, ids, 5)
    with pytest.raises(ValueError, match="^num_steps:"):
        a(r, ids, 4)


def test_gathered_rows_in_any_order():
    """Rows gathered from ranks arrive in any order: advantages are equivariant to row permutations."""
    r, ids = _rewards(b=12)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(9))
    for scheme in ("gain", "gain_per_step", "uniform", "gae"):
        a = AdvantageEstimator(AdvantageConfig(scheme=scheme))
        torch.testing.assert_close(a(r[perm], ids[perm], 5).advantages, a(r, ids, 5).advantages[perm])


@pytest.mark.parametrize("kwargs,field", [
    (dict(scheme="ppo"), "scheme"), (dict(std_scope="batch"), "std_scope"), (dict(norm="global"), "norm"),
    (dict(eps=-1.0), "eps"), (dict(adv_clip=0.0), "adv_clip"), (dict(scheme="gain_ema", ema_alpha=1.0), "ema_alpha"),
    (dict(scheme="gae", gamma=1.5), "gamma"), (dict(scheme="gae", lam=-0.1), "lam"),
])
def test_bad_credit_config(kwargs, field):
    with pytest.raises(ValueError) as err:
        AdvantageConfig(**kwargs)
    assert str(err.value).startswith(f"{field}:") and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="^std_scope:"):
        group_normalize(torch.zeros(2), torch.zeros(2).long(), std_scope="x")


def test_over_trained_normalises_the_trained_steps_jointly_and_reads_only_their_states():
    """advantage.over=trained: G_k of the trained steps, normalised jointly over (group × trained steps), 0 at the
    other steps; only R_k, R_{k+1} of trained k are read (the rest may be NaN). Reference: numpy, by hand."""


    g = torch.Generator().manual_seed(3)
    r = torch.rand(6, 6, generator=g, dtype=torch.float64)  # B = 6, T = 5
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    trained = [1, 3]
    est = AdvantageEstimator(AdvantageConfig(scheme="gain", over="trained", eps=1e-4))
    assert est.states_needed(trained, 5) == [1, 2, 3, 4]
    masked = r.clone()
    masked[:, [0, 5]] = float("nan")  # states the trained steps do not need
    out = est(masked, gid, 5, trained)
    rn = r.numpy()
    gains = np.stack([rn[:, 2] - rn[:, 1], rn[:, 4] - rn[:, 3]], 1)  # (B, 2)
    ref = np.zeros((6, 5))
    for c in (0, 1):
        rows = gid.numpy() == c
        v = gains[rows]
        ref[np.ix_(rows, trained)] = (v - v.mean()) / (v.std() + 1e-4)
    np.testing.assert_allclose(out.advantages.numpy(), ref, rtol=1e-5, atol=1e-6)
    # one trained step: the same as per-step normalisation of that step (gain_per_step)
    one = AdvantageEstimator(AdvantageConfig(scheme="gain", over="trained"))(r, gid, 5, [2]).advantages
    per = AdvantageEstimator(AdvantageConfig(scheme="gain_per_step"))(r, gid, 5).advantages
    torch.testing.assert_close(one[:, 2], per[:, 2])
    assert float(one[:, [0, 1, 3, 4]].abs().max()) == 0.0
    # schemes that read every step's gain keep the normalisation over all steps
    with pytest.raises(ValueError, match="^over: advantage=gae takes no field 'over'"):
        AdvantageConfig(scheme="gae", over="trained")
    gae_cfg = AdvantageConfig(scheme="gae")
    assert getattr(gae_cfg, "over", "all") == "all" and AdvantageEstimator(gae_cfg).states_needed([1], 5) == list(range(6))
