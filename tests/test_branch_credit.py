"""Branch credit (stepflow.math.branch_credit): TempFlow-GRPO's per-step advantages and noise-aware weights,
TurningPoint-GRPO's turning-point rewards and per-step advantages, Granular-GRPO's summed advantages. Each is checked
on a hand-worked example (the numbers in the comments) and against an inline transcription of the released lines;
then the edge cases (constant groups, no turning point, one sign only) and the 2.252 figure of TempFlow's weight."""

from __future__ import annotations

import ast
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from stepflow.math.branch_credit import (
    TEMPFLOW_WEIGHT_SCALE,
    g2rpo_advantages,
    per_step_advantages,
    tempflow_advantages,
    tempflow_weights,
    turning_point_rewards,
)


def test_the_module_imports_torch_only():
    src = (Path(__file__).resolve().parents[1] / "stepflow" / "math" / "branch_credit.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert names <= {"__future__", "dataclasses", "torch"}, names


# ---------------------------------------------------------------- the released tracker, transcribed


def released_tracker(prompts, rewards, global_std=False):
    """Flow-GRPO's PerPromptStatTracker.update, type 'grpo' (flow_grpo/stat_tracking.py:11-31, one call after a
    clear()): numpy float64, np.std (ddof 0) + 1e-4, per column for 2-D rewards."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    stats = {}
    for prompt in np.unique(prompts):
        stats[prompt] = np.stack(list(rewards[prompts == prompt]))
        mean = np.mean(stats[prompt], axis=0, keepdims=True)
        if global_std:
            std = np.std(rewards, axis=0, keepdims=True) + 1e-4
        else:
            std = np.std(stats[prompt], axis=0, keepdims=True) + 1e-4
        advantages[prompts == prompt] = (rewards[prompts == prompt] - mean) / std
    return advantages


# ---------------------------------------------------------------- TempFlow-GRPO


def test_tempflow_advantages_by_hand():
    # rows of two prompts, interleaved; 2 trained steps (columns)
    rewards = torch.tensor([[1.0, 5.0], [0.0, 1.0], [2.0, 5.0], [0.0, 3.0], [3.0, 5.0], [6.0, 2.0]])
    groups = torch.tensor([7, 9, 7, 9, 7, 9])
    a = tempflow_advantages(rewards, groups)
    assert a.dtype == torch.float32 and a.shape == (6, 2)
    s = math.sqrt(2 / 3)  # population std of {1, 2, 3} and of {1, 3, 2}
    # prompt 7, step 0: {1, 2, 3}: mean 2 -> (−1, 0, 1)/(s + 1e-4)
    assert a[[0, 2, 4], 0].tolist() == pytest.approx([-1 / (s + 1e-4), 0.0, 1 / (s + 1e-4)], rel=1e-6)
    # prompt 7, step 1: {5, 5, 5} constant -> exactly 0
    assert a[[0, 2, 4], 1].tolist() == [0.0, 0.0, 0.0]
    # prompt 9, step 0: {0, 0, 6}: mean 2, deviations (−2, −2, 4), variance 24/3 = 8
    r8 = math.sqrt(8)
    assert a[[1, 3, 5], 0].tolist() == pytest.approx([-2 / (r8 + 1e-4), -2 / (r8 + 1e-4), 4 / (r8 + 1e-4)],
                                                     rel=1e-6)
    # prompt 9, step 1: {1, 3, 2}: mean 2
    assert a[[1, 3, 5], 1].tolist() == pytest.approx([-1 / (s + 1e-4), 1 / (s + 1e-4), 0.0], rel=1e-6, abs=1e-7)
    # global_std: the std of each column over all six rows
    g = tempflow_advantages(rewards, groups, global_std=True)
    sd0 = float(np.std([1, 0, 2, 0, 3, 6]))
    assert g[0, 0].item() == pytest.approx(-1 / (sd0 + 1e-4), rel=1e-6)


def test_tempflow_advantages_match_the_released_tracker():
    gen = torch.Generator().manual_seed(0)
    for global_std in (False, True):
        rewards = torch.randn(24, 9, generator=gen, dtype=torch.float64)  # 4 prompts × 6 branches, 9 steps
        ids = torch.randint(0, 4, (24,), generator=gen)
        ref = released_tracker([f"p{int(i)}" for i in ids], rewards.numpy(), global_std)
        got = tempflow_advantages(rewards, ids, global_std=global_std)
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-6, atol=1e-6)


def test_tempflow_weights_released_and_normalized():
    stds = torch.tensor([0.7, 0.5, 0.3])
    assert tempflow_weights(stds).tolist() == pytest.approx([2.25 * 0.7, 2.25 * 0.5, 2.25 * 0.3])
    assert TEMPFLOW_WEIGHT_SCALE == 2.25
    assert tempflow_weights(stds, form="normalized").tolist() == pytest.approx([1.4, 1.0, 0.6])  # mean 0.5
    # a window of the grid keeps the grid's weights when the grid is given
    sub = tempflow_weights(stds[1:], form="normalized", grid_stds=stds)
    assert sub.tolist() == pytest.approx([1.0, 0.6])
    assert tempflow_weights(stds[1:], form="normalized").tolist() == pytest.approx([1.25, 0.75])  # its own mean
    with pytest.raises(ValueError, match="form"):
        tempflow_weights(stds, form="noise")
    with pytest.raises(ValueError, match="grid_stds"):
        tempflow_weights(stds, grid_stds=stds)


def test_the_2252_figure_on_sd3s_10_step_shift_3_grid():
    from stepflow.math.sde import time_grid

    grid = time_grid(10, 3.0).to(torch.float64)  # [1, .9601, …, .0089, 0]
    t, t_next = grid[:-1], grid[1:]
    # sd3_sde_with_logprob.py:44-47, :81: σ = 0.7·sqrt(t/(1 − t̃)), t̃ = sigmas[1] where t == 1; std = σ·sqrt(−dt)
    sigma = 0.7 * torch.sqrt(t / (1 - torch.where(t == 1, grid[1], t)))
    stds = sigma * torch.sqrt(t - t_next)
    assert stds[:9].tolist() == pytest.approx([0.700, 0.743, 0.536, 0.446, 0.392, 0.353, 0.319, 0.282, 0.225],
                                              abs=5e-4)
    trained = stds[: int(10 * 0.99)]  # train_sd3_pr.py:366: the first 9 steps
    assert 1 / trained.mean().item() == pytest.approx(2.252, abs=5e-4)
    released = tempflow_weights(trained)
    normalized = tempflow_weights(trained, form="normalized")
    assert released.mean().item() == pytest.approx(0.999, abs=2e-4)  # 2.25 / 2.2522
    torch.testing.assert_close(released, normalized, rtol=1.2e-3, atol=0)  # the two forms agree to 0.1%
    # over all 10 steps the two forms part (1/mean = 2.499): the constant belongs to the 9-step grid
    assert 1 / stds.mean().item() == pytest.approx(2.4986, abs=5e-4)


# ---------------------------------------------------------------- TurningPoint-GRPO


def example():
    """Four rows, n = 3 SDE steps; R_sde = R_3 (the released pipeline's last intermediate is the image itself).

    row 0: R_0 = 0, R = (−2, 1, 2), Δ = 2:   d = (−2, 3, 1), s = (−1, 1, 1); step 2 flips towards Δ and
           sign(d_2)·sign(R_sde − R_2) = sign(3)·sign(1) > 0: turning point, bonus R_sde − R_1 = 2 − (−2) = 4
    row 1: R_0 = 1, R = (2, 0, −1), Δ = −2:  d = (1, −2, −1), s = (−1, 1, 1); step 2: sign(−2)·sign(−1) > 0:
           turning point, bonus −1 − 2 = −3
    row 2: R_0 = 0, R = (1, 1.5, 3), Δ = 3:  d = (1, .5, 1.5), s = (1, 1, 1); step 1 consistent (sign(1)·sign(2)):
           first-step turning point, bonus 3 − 0 = 3
    row 3: R_0 = 0, R = (−.5, .5, 1), Δ = 1: d = (−.5, 1, .5), s = (−1, 1, 1); step 2: sign(1)·sign(.5) > 0:
           turning point, bonus 1 − (−.5) = 1.5
    Step 1 of rows 0, 1, 3 is inconsistent (sign(d_1)·sign(R_sde − R_1) < 0); no step 3 is (R_sde − R_3 = 0).
    """
    r_ode = torch.tensor([0.0, 1.0, 0.0, 0.0])
    r_steps = torch.tensor([[-2.0, 1.0, 2.0], [2.0, 0.0, -1.0], [1.0, 1.5, 3.0], [-0.5, 0.5, 1.0]])
    return r_ode, r_steps


def test_turning_points_by_hand_unbalanced():
    r_ode, r_steps = example()
    tp = turning_point_rewards(r_ode, r_steps, use_balanced_bonus=False)
    assert tp.delta_global.tolist() == [2.0, -2.0, 3.0, 1.0]
    assert tp.increments.tolist() == [[-2.0, 3.0, 1.0], [1.0, -2.0, -1.0], [1.0, 0.5, 1.5], [-0.5, 1.0, 0.5]]
    assert tp.turning.tolist() == [[False, True, False], [False, True, False], [True, False, False],
                                   [False, True, False]]
    # turning point: η·(R_sde − R_{t−1}) in place of d_t; elsewhere d_t
    assert tp.rewards.tolist() == [[-2.0, 4.0, 1.0], [1.0, -3.0, -1.0], [3.0, 0.5, 1.5], [-0.5, 1.5, 0.5]]
    assert tp.bonus.tolist() == [[0.0, 4.0, 0.0], [0.0, -3.0, 0.0], [3.0, 0.0, 0.0], [0.0, 1.5, 0.0]]
    # r_sde given explicitly is the same as R_n
    same = turning_point_rewards(r_ode, r_steps, r_steps[:, -1], use_balanced_bonus=False)
    assert same.rewards.tolist() == tp.rewards.tolist()
    # eta scales the bonus; keeping the original reward adds d_t to it
    half = turning_point_rewards(r_ode, r_steps, use_balanced_bonus=False, eta=0.5)
    assert half.rewards[0].tolist() == [-2.0, 2.0, 1.0]
    kept = turning_point_rewards(r_ode, r_steps, use_balanced_bonus=False, drop_original_reward_when_having_bonus=False)
    assert kept.rewards[1].tolist() == [1.0, -2.0 - 3.0, -1.0]
    # use_sde_minus_rt off: the bonus is η·Δ
    delta = turning_point_rewards(r_ode, r_steps, use_balanced_bonus=False, use_sde_minus_rt=False)
    assert delta.rewards[:, :2].tolist() == [[-2.0, 2.0], [1.0, -2.0], [3.0, 0.5], [-0.5, 1.0]]
    # no first-step bonus: row 2 keeps d_1
    nofirst = turning_point_rewards(r_ode, r_steps, use_balanced_bonus=False, apply_first_step_bonus=False)
    assert nofirst.turning[2].tolist() == [False, False, False] and nofirst.rewards[2, 0].item() == 1.0


def test_turning_points_by_hand_balanced():
    r_ode, r_steps = example()
    tp = turning_point_rewards(r_ode, r_steps)
    # turning points' Δ: +2 (row 0), −2 (row 1), +3 (row 2), +1 (row 3): 3 positive, 1 negative -> keep 1 of each;
    # the positive one with the largest |Δ| is row 2 (|Δ| = 3), not row 0 (the largest bonus, 4): the balance
    # ranks by Δ (my_train_sd3_fast_with_op3.py:945), the bonus is R_sde − R_{t−1} (:1074)
    assert tp.turning.tolist() == [[False, False, False], [False, True, False], [True, False, False],
                                   [False, False, False]]
    assert tp.rewards.tolist() == [[-2.0, 3.0, 1.0], [1.0, -3.0, -1.0], [3.0, 0.5, 1.5], [-0.5, 1.0, 0.5]]


def test_one_sign_only_keeps_every_turning_point():
    # released :963 balances only when both signs occur; :1004 "if all same sign ... keep original indicators"
    r_ode, r_steps = example()
    rows = [0, 2, 3]  # three positive turning points, no negative one
    tp = turning_point_rewards(r_ode[rows], r_steps[rows])
    assert tp.turning.sum().item() == 3
    assert tp.rewards.tolist() == [[-2.0, 4.0, 1.0], [3.0, 0.5, 1.5], [-0.5, 1.5, 0.5]]


def test_no_turning_point():
    # row 0: d = (2, −1, 0), Δ = 1, s = (1, −1, 0): step 1 inconsistent (sign(2)·sign(1 − 2) < 0), no flip back;
    # row 1: a constant trajectory (Δ = 0, every s = 0)
    r_ode = torch.tensor([0.0, 0.5])
    r_steps = torch.tensor([[2.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    tp = turning_point_rewards(r_ode, r_steps)
    assert not tp.turning.any()
    assert tp.rewards.tolist() == [[2.0, -1.0, 0.0], [0.0, 0.0, 0.0]]
    # a one-step window: R_1 = R_sde, so sign(R_sde − R_1) = 0 and the first step is never consistent
    one = turning_point_rewards(torch.tensor([0.0, 1.0]), torch.tensor([[1.0], [0.0]]))
    assert not one.turning.any() and one.rewards.tolist() == [[1.0], [-1.0]]


def test_balance_within_sampling_batches_and_ties():
    r_ode, r_steps = example()
    # rows {0, 1} (one positive, one negative) and {2, 3} (two positive): no row loses its bonus
    tp = turning_point_rewards(r_ode, r_steps, balance_ids=torch.tensor([0, 0, 1, 1]))
    assert tp.turning.sum().item() == 4
    # ties in |Δ|: rows 0 and 3 both Δ = +1, one negative (row 1, Δ = −1): the earlier row keeps its bonus
    r_ode = torch.tensor([0.0, 1.0, 0.0])
    r_steps = torch.tensor([[-2.0, 0.0, 1.0], [2.0, 1.0, 0.0], [-1.0, 0.0, 1.0]])
    tp = turning_point_rewards(r_ode, r_steps)
    assert tp.delta_global.tolist() == [1.0, -1.0, 1.0]
    assert tp.turning.tolist() == [[False, True, False], [False, True, False], [False, False, False]]


def released_turning_point_rewards(r_ode, r_steps):
    """my_train_sd3_fast_with_op3.py:861-1100 with common_op3.sh's flags, transcribed (torch.topk's unspecified
    order among ties replaced by a stable sort, the one documented deviation)."""
    sde_reward, ode_reward = r_steps[:, -1], r_ode
    delta_global = sde_reward - ode_reward
    reward_sequence = [ode_reward] + [r_steps[:, j] for j in range(r_steps.shape[1])]
    d_list = [reward_sequence[t] - reward_sequence[t - 1] for t in range(1, len(reward_sequence))]
    s_list = [torch.sign(d_t) * torch.sign(delta_global) for d_t in d_list]
    indicator_list = []
    for t in range(len(s_list)):
        if t == 0:
            indicator = ((torch.sign(d_list[0]) * torch.sign(sde_reward - reward_sequence[1])) > 0).float()
        else:
            indicator = (s_list[t - 1] < 0).float() * (s_list[t] > 0).float()
            consistent_judge = ((torch.sign(d_list[t]) * torch.sign(sde_reward - reward_sequence[t + 1])) > 0).float()
            indicator = indicator * consistent_judge
        indicator_list.append(indicator)
    all_indicators = torch.stack(indicator_list, dim=1)
    all_B_t = torch.stack([delta_global for _ in range(len(s_list))], dim=1)
    turning_point_mask = all_indicators > 0
    B_at = all_B_t[turning_point_mask]
    if B_at.numel() > 0:
        pos, neg = B_at > 0, B_at < 0
        num_positive, num_negative = pos.sum().item(), neg.sum().item()
        if num_positive > 0 and num_negative > 0:
            keep_count = min(num_positive, num_negative)
            flat = torch.where(turning_point_mask.flatten())[0]
            chosen = []
            for mask, n_sign in ((pos, num_positive), (neg, num_negative)):
                ix, vals = flat[mask], B_at[mask]
                if n_sign > keep_count:
                    top = torch.sort(-torch.abs(vals), stable=True).indices[:keep_count]  # torch.topk in the release
                    chosen.append(ix[top])
                else:
                    chosen.append(ix)
            balanced = torch.zeros_like(all_indicators.flatten())
            balanced[torch.cat(chosen)] = 1.0
            balanced = balanced.reshape(all_indicators.shape)
            indicator_list = [balanced[:, t] for t in range(len(s_list))]
    out = []
    for t in range(len(s_list)):
        main_t = d_list[t]
        B_t = 1.0 * indicator_list[t] * (sde_reward - reward_sequence[t])
        main_t = main_t.clone()
        main_t[B_t != 0] = 0
        out.append(main_t + B_t)
    return torch.stack(out, dim=1), torch.stack(indicator_list, dim=1) > 0


def test_turning_points_match_the_released_loop():
    gen = torch.Generator().manual_seed(1)
    balanced_somewhere = False
    for _ in range(40):
        r_ode = torch.randn(9, generator=gen, dtype=torch.float64)  # one SD3 sampling batch: 9 rows, window 9
        r_steps = r_ode.view(9, 1) + torch.randn(9, 9, generator=gen, dtype=torch.float64).cumsum(1)
        ref_r, ref_mask = released_turning_point_rewards(r_ode, r_steps)
        tp = turning_point_rewards(r_ode, r_steps)
        torch.testing.assert_close(tp.rewards, ref_r.float())
        assert tp.turning.tolist() == ref_mask.tolist()
        plain = turning_point_rewards(r_ode, r_steps, use_balanced_bonus=False)
        balanced_somewhere |= int(plain.turning.sum()) > int(tp.turning.sum())
    assert balanced_somewhere  # the draws exercise the balance, not only the one-sign branch


def test_per_step_advantages_by_hand_and_against_the_tracker():
    r_ode, r_steps = example()
    r = turning_point_rewards(r_ode, r_steps).rewards  # [[-2, 3, 1], [1, -3, -1], [3, .5, 1.5], [-.5, 1, .5]]
    groups = torch.tensor([0, 1, 0, 1])
    a = per_step_advantages(r, groups)
    # prompt 0, step 0: {−2, 3}: mean .5, population std 2.5 -> ∓2.5/(2.5 + 1e-4)
    assert a[[0, 2], 0].tolist() == pytest.approx([-2.5 / 2.5001, 2.5 / 2.5001], rel=1e-6)
    # prompt 1, step 1: {−3, 1}: mean −1, std 2
    assert a[[1, 3], 1].tolist() == pytest.approx([-2 / 2.0001, 2 / 2.0001], rel=1e-6)
    # stat_trackers_per_timestep[t].update(prompts, rewards_t) per column (:1402-1411)
    prompts = ["a", "b", "a", "b"]
    ref = np.stack([released_tracker(prompts, r[:, t].numpy()) for t in range(3)], axis=1)
    np.testing.assert_allclose(a.numpy(), ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- Granular-GRPO


def released_g2rpo(all_rewards_per_model, num_generations):
    """train_g2rpo_hps.py:657-693 transcribed: per model, per granularity (B, S) rewards, consecutive groups of
    num_generations rows, (r − mean)/(std (unbiased) + 1e-8), summed."""
    total = 0
    for all_rewards in all_rewards_per_model:
        n = all_rewards[0].shape[0] // num_generations
        adv = torch.zeros_like(all_rewards[0])
        for rewards in all_rewards:
            group_advantages = torch.zeros_like(rewards)
            for i in range(n):
                s, e = i * num_generations, (i + 1) * num_generations
                group_rewards = rewards[s:e]
                group_mean = group_rewards.mean(dim=0)
                group_std = group_rewards.std(dim=0) + 1e-8
                group_advantages[s:e] = (group_rewards - group_mean) / group_std
            adv += group_advantages
        total = total + adv
    return total


def test_g2rpo_by_hand():
    # one prompt, 3 generations, 1 trained step, granularities (1, 2)
    rewards = torch.tensor([[[1.0, 0.0]], [[2.0, 0.0]], [[3.0, 3.0]]])  # (B=3, S=1, G=2)
    a = g2rpo_advantages(rewards, torch.zeros(3, dtype=torch.long))
    # g = 1: {1, 2, 3}: mean 2, unbiased std 1 -> (−1, 0, 1)
    # g = 2: {0, 0, 3}: mean 1, deviations (−1, −1, 2), unbiased variance 6/2 = 3 -> (−1, −1, 2)/√3
    r3 = math.sqrt(3)
    expect = [-1 - 1 / r3, 0 - 1 / r3, 1 + 2 / r3]  # (−1.577, −0.577, 2.155)
    assert a.shape == (3, 1) and a.dtype == torch.float32
    assert a[:, 0].tolist() == pytest.approx(expect, rel=1e-6)
    # a second reward model (CLIP), {3, 2, 1} at both granularities: adds 2·(1, 0, −1)
    two = torch.stack([rewards, torch.tensor([[[3.0, 3.0]], [[2.0, 2.0]], [[1.0, 1.0]]])])
    a2 = g2rpo_advantages(two, torch.zeros(3, dtype=torch.long))
    assert a2[:, 0].tolist() == pytest.approx([expect[0] + 2, expect[1], expect[2] - 2], rel=1e-6)


def test_g2rpo_matches_the_released_loop():
    gen = torch.Generator().manual_seed(2)
    rewards = torch.rand(2, 24, 8, 2, generator=gen, dtype=torch.float64)  # HPS + CLIP, 2 prompts × 12, 8 steps
    ids = torch.arange(24) // 12
    ref = released_g2rpo([[rewards[m, :, :, g] for g in range(2)] for m in range(2)], 12)
    torch.testing.assert_close(g2rpo_advantages(rewards, ids), ref.float())
    torch.testing.assert_close(g2rpo_advantages(rewards[0], ids), released_g2rpo([[rewards[0, :, :, g]
                                                                                    for g in range(2)]], 12).float())


def test_constant_groups_give_exactly_zero():
    # a constant group is 0 in all three; a lone row too (Granular's unbiased std of one value is NaN). 0.1 three
    # times: its float64 mean is 0.1 + 1.4e-17, so the released (r − mean)/(std + eps) is not exactly 0
    const = torch.full((6, 3), 0.1, dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    assert tempflow_advantages(const, ids).abs().sum().item() == 0.0
    assert per_step_advantages(const, ids).abs().sum().item() == 0.0
    assert g2rpo_advantages(const.view(6, 3, 1).expand(6, 3, 2), ids).abs().sum().item() == 0.0
    assert np.abs(released_tracker(["a"] * 3 + ["b"] * 3, const.numpy())).max() == pytest.approx(1.4e-13, rel=0.1)
    assert released_g2rpo([[const, const]], 3).abs().max().item() > 0
    lone = torch.tensor([[[0.3]], [[0.1]], [[0.2]]])
    out = g2rpo_advantages(lone, torch.tensor([0, 1, 1]))
    assert out[0, 0].item() == 0.0 and out[1, 0].item() == pytest.approx(-math.sqrt(0.5), rel=1e-6)  # {.1, .2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns of the 0 degrees of freedom
        assert torch.isnan(torch.tensor([0.3]).std())  # what the released loop would divide by


def test_shape_and_value_checks():
    with pytest.raises(ValueError, match="group_ids"):
        tempflow_advantages(torch.zeros(4, 2), torch.zeros(3))
    with pytest.raises(ValueError, match="rewards"):
        tempflow_advantages(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="non-finite"):
        per_step_advantages(torch.tensor([[float("nan")]]), torch.zeros(1))
    with pytest.raises(ValueError, match="r_ode"):
        turning_point_rewards(torch.zeros(3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="r_steps"):
        turning_point_rewards(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="rewards"):
        g2rpo_advantages(torch.zeros(4, 2), torch.zeros(4))


# ------------------------------------------------------------------------------ Granular-GRPO's completion, as released
def _g2rpo_released_completion(velocity, z, eta_step, sigma_schedule, g):
    """bcmi/Granular-GRPO@ef6ec9f fastvideo/train_g2rpo_hps.py, ``sample_reference_model``'s loop over
    ``granular_list`` with ``run_ode_sample_step`` and ``flow_grpo_step`` at eta 0: the schedule is
    ``cat(σ[:eta_step+2], σ[eta_step+2::g])``, the Euler loop runs ``range(eta_step+1, len-1)`` and the image is the
    x̂0 (``latents - sigma * model_output``) of its last evaluation. ``z``: the SDE step's output at σ[eta_step+1]."""
    schedule = torch.cat((sigma_schedule[:eta_step + 2], sigma_schedule[eta_step + 2::g]))
    pred_original = None
    for i in range(eta_step + 1, len(schedule) - 1):
        sigma, sigma_prev = schedule[i], schedule[i + 1]
        out = velocity(z, sigma)
        pred_original = z - sigma * out
        z = z + out * (sigma_prev - sigma)  # prev_sample_mean with std_dev_t = 0
    return pred_original


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("g", [1, 2, 3])
def test_g2rpo_completes_each_branch_as_released(k, g):
    """The g2rpo credit's branch completion (``advantage.jump_last`` true, its default) gives the released image at
    every trained step and stride of the league's 10-step grid, where the stride misses 0 too (odd k at g = 2); the
    rule that visits the suffix's last time first does not, there."""
    from stepflow.core.branch import complete, completion_grid
    from stepflow.credits.g2rpo import G2rpo

    def velocity(x, t):
        t = torch.as_tensor(t, dtype=torch.float32)
        return torch.sin(3.0 * x) * (1.0 + t) - 0.5 * t * x + 0.2

    class Field:
        def velocity(self, x, t, cond, guidance=1.0):
            return velocity(x, t)

    credit = G2rpo(branches=1, granularities=[1, 2])
    strategy = credit.rollout_strategy()
    assert credit.jump_last is True and strategy.jump_last is True
    sigmas = torch.linspace(1, 0, 11)
    z = torch.randn(3, 4, generator=torch.Generator().manual_seed(k * 10 + g))
    want = _g2rpo_released_completion(velocity, z.clone(), k, sigmas, g)
    ours = complete(Field(), z.clone(), sigmas[k + 1], completion_grid(sigmas, k, g, strategy.jump_last), None)
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-6)
    misses_zero = float(sigmas[k + 2::g][-1]) != 0.0
    visited = complete(Field(), z.clone(), sigmas[k + 1], completion_grid(sigmas, k, g, False), None)
    assert torch.allclose(visited, want, atol=1e-6) != misses_zero
