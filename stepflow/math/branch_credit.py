"""Credit for branch rollouts: the released advantages of TempFlow-GRPO, TurningPoint-GRPO and Granular-GRPO.

Pure functions, tensors in and tensors out (league.md §3–§5); the rollouts that produce their rewards are
:mod:`stepflow.core.branch`'s (an anchor, K SDE branches at step k, ODE completions at granularities). Groups are the
rows sharing a ``group_ids`` value (the released code groups by prompt). Statistics are taken in float64 and the
results are float32, as in :mod:`stepflow.math.advantage`. A group whose entries are all equal gets exactly 0.

Each function names the released lines it transcribes (``repo@commit path:line``) and every deviation from them.
Line numbers of the TempFlow-GRPO and Granular-GRPO files are counted in their stored texts (those repositories
have no git snapshot here); TurningPoint-GRPO's are from its git snapshot.

- TempFlow-GRPO (Shredded-Pork/TempFlow-GRPO@e66824e): :func:`tempflow_advantages` (the per-timestep
  ``PerPromptStatTracker``) and :func:`tempflow_weights` (the noise-aware weight ``2.25·σ_t√Δt``).
- TurningPoint-GRPO (YunzeTong/TurningPoint-GRPO@994d26a): :func:`turning_point_rewards` (incremental rewards,
  turning points, the balanced bonus) and :func:`per_step_advantages` (one tracker per timestep column).
- Granular-GRPO (bcmi/Granular-GRPO@04ee954): :func:`g2rpo_advantages` (summed over granularities and reward
  models).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "TEMPFLOW_WEIGHT_SCALE",
    "tempflow_advantages",
    "tempflow_weights",
    "TurningPoints",
    "turning_point_rewards",
    "per_step_advantages",
    "g2rpo_advantages",
]

TEMPFLOW_WEIGHT_SCALE = 2.25
"""TempFlow-GRPO's constant in ``w_t = 2.25·σ_t√Δt`` (train_sd3_pr.py:954-955): 1/mean of σ√Δt over the 9
trained steps of SD3's 10-step shift-3 grid (2.252), rounded."""

WEIGHT_FORMS = ("released", "normalized")


# ---------------------------------------------------------------- shared statistics


def _finite(name: str, x: Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: non-finite values")


def _group_index(group_ids: Tensor, batch: int, device: torch.device) -> tuple[Tensor, int]:
    """Dense group index (B,) in 0..k−1, and k."""
    group_ids = torch.as_tensor(group_ids)
    if group_ids.shape != (batch,):
        raise ValueError(f"group_ids: expected shape ({batch},), got {tuple(group_ids.shape)}")
    if batch == 0:
        return torch.zeros(0, dtype=torch.long, device=device), 0
    _, inv = torch.unique(group_ids, return_inverse=True)
    return inv.to(device), int(inv.max().item()) + 1


def _normalize_columns(v: Tensor, inv: Tensor, k: int, *, ddof: int, eps: float, global_std: bool = False) -> Tensor:
    """Each column of ``v`` (B, C) float64 within each group: ``(v − mean_c) / (std_c + eps)``.

    std with ``ddof`` 0 (population, ``np.std``) or 1 (sample, ``torch.std``; over a group of one entry it is taken
    as 0, the entry is constant anyway); ``global_std``: the std of the column over all B rows instead of the
    group's (``PerPromptStatTracker(global_std=True)``). A (group, column) whose entries are all equal gives
    exactly 0. Returns (B, C) float64.
    """
    b, c = v.shape
    count = torch.bincount(inv, minlength=k).to(v.dtype).view(k, 1)
    mean = torch.zeros(k, c, dtype=v.dtype, device=v.device).index_add_(0, inv, v) / count
    centred = v - mean[inv]
    if global_std:
        col_mean = v.mean(dim=0, keepdim=True)
        std = torch.sqrt(((v - col_mean) ** 2).sum(dim=0, keepdim=True) / max(b - ddof, 1)).expand(b, c)
    else:
        dev2 = torch.zeros(k, c, dtype=v.dtype, device=v.device).index_add_(0, inv, centred ** 2)
        std = torch.sqrt(dev2 / (count - ddof).clamp(min=1))[inv]
    idx = inv.view(b, 1).expand(b, c)
    vmax = torch.full((k, c), -torch.inf, dtype=v.dtype, device=v.device).scatter_reduce_(0, idx, v, "amax")
    vmin = torch.full((k, c), torch.inf, dtype=v.dtype, device=v.device).scatter_reduce_(0, idx, v, "amin")
    const = (vmax == vmin)[inv]
    return torch.where(const, torch.zeros_like(centred), centred) / (std + eps)


def _per_column(rewards: Tensor, group_ids: Tensor, eps: float, global_std: bool, name: str) -> Tensor:
    if rewards.ndim != 2:
        raise ValueError(f"{name}: expected shape (B, S), got {tuple(rewards.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps!r}")
    v = rewards.detach().to(torch.float64)
    _finite(name, v)
    inv, k = _group_index(group_ids, v.shape[0], v.device)
    if k == 0:
        return torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    return _normalize_columns(v, inv, k, ddof=0, eps=eps, global_std=global_std).to(torch.float32)


# ---------------------------------------------------------------- TempFlow-GRPO (league.md §3)


def tempflow_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-4, *, global_std: bool = False) -> Tensor:
    """TempFlow-GRPO's process-reward advantages: each trained step (column) normalised within each prompt group.

    rewards: (B·K, S) the reward of every branch at each of the S trained steps (column j: the K SDE branches at
    step j of every anchor, each completed by the ODE; the released S = T − 1 = 9 for T = 10); group_ids: (B·K,)
    the prompt of each row (all seeds × branches of a prompt form one group). Returns (B·K, S) float32::

        A[i, j] = (R[i, j] − mean_{i'∈c(i)} R[i', j]) / (std_{i'∈c(i)} R[i', j] + eps)

    with the population std (ddof 0, ``np.std``) and eps 1e-4; ``global_std``: the std of column j over all rows
    (the ``_pr`` configs set ``global_std=False``).

    Released (Shredded-Pork/TempFlow-GRPO@e66824e): scripts/train_sd3_pr.py:567 builds
    ``PerPromptStatTracker(config.sample.global_std)``, :813 calls ``stat_tracker.update(prompts,
    gathered_rewards['avg'])`` once on the (B·K, S) rewards (columns = the branch points of
    ``sd3_pipeline_with_logprob_perstep.py``'s loop ``for i, t in enumerate(timesteps[:-1])``, rows = prompts
    repeated ``exploration_k = 6`` times, :676, :686), :830 clears it. config/dgx.py ``geneval_sd3_pr`` /
    ``pickscore_sd3_pr`` set ``global_std=False``. TempFlow's own ``flow_grpo/stat_tracking.py`` is not stored
    here; the tracker quoted is Flow-GRPO's (yifan123/flow_grpo@94e23ee flow_grpo/stat_tracking.py, the same
    lines as TurningPoint-GRPO's copy, YunzeTong/TurningPoint-GRPO@994d26a flow_grpo/stat_tracking.py:25-31):
    ``mean = np.mean(stats, axis=0)``, ``std = np.std(stats, axis=0) + 1e-4``, ``(r − mean) / std``, in float64.

    Deviations: (1) a constant (group, column) gives exactly 0; the tracker gives ``(r − np.mean(r))/1e-4``,
    which is 0 only when the mean rounds back to r (a 1-ulp error becomes ~1e-12, and train_sd3_pr.py:849 drops
    a row only if all its advantages are exactly 0). (2) The groups are what ``group_ids`` says; the released
    script does not gather rewards across processes (train_sd3_pr.py:791-792, the gather commented out), so its
    group is a prompt's rows on one process.
    """
    return _per_column(rewards, group_ids, eps, global_std, "rewards")


def tempflow_weights(stds: Tensor, *, form: str = "released", grid_stds: Tensor | None = None) -> Tensor:
    """TempFlow-GRPO's noise-aware weights of the trained steps, from their step stds ``σ_t√Δt``.

    stds: (..., S) the full step std ``σ_t·√Δt`` of each trained step (the std of the SDE transition, not σ_t).
    ``form="released"`` (what the code does): ``w = 2.25·σ_t√Δt``. ``form="normalized"``: ``w = σ_t√Δt /
    mean_grid σ√Δt``, the mean over ``grid_stds`` (..., S') when given (the released fixed grid of trained steps,
    so that a subset of steps keeps the grid's weights), else over the last axis of ``stds``. On SD3's 10-step
    shift-3 grid with Flow-GRPO's σ_t = 0.7·sqrt(t/(1−t)) the 9 trained steps give 1/mean = 2.252, so the two
    forms agree to 0.1% there and nowhere else in general. Returns float32 of the shape of ``stds``.

    Released (Shredded-Pork/TempFlow-GRPO@e66824e): scripts/train_sd3_pr.py:954-955 ``unclipped_loss = - 2.25 *
    std_dev_t * advantages * ratio`` and the same factor on the clipped term (the weight scales the whole clipped
    surrogate); ``std_dev_t`` is what ``compute_log_prob`` (:189-222) gets from
    flow_grpo/diffusers_patch/sd3_sde_with_logprob.py: σ_t = ``sqrt(sigma / (1 − where(sigma == 1, sigmas[1],
    sigma))) * 0.7`` (:44, :47) and the returned ``std_dev_t * sqrt(-dt)`` (:81); the trained steps are
    ``range(int(num_steps * timestep_fraction))`` = 0..8 of 10 (:366, :932; the time axis cut by ``perms[:,:-1]``,
    :896).
    """
    if form not in WEIGHT_FORMS:
        raise ValueError(f"form: must be one of {WEIGHT_FORMS}, got {form!r}")
    s = stds.detach().to(torch.float64)
    _finite("stds", s)
    if form == "released":
        if grid_stds is not None:
            raise ValueError("grid_stds: only the normalized form reads it")
        return (TEMPFLOW_WEIGHT_SCALE * s).to(torch.float32)
    if s.ndim == 0:
        raise ValueError("stds: expected shape (..., S), got a scalar")
    grid = s if grid_stds is None else torch.as_tensor(grid_stds).detach().to(torch.float64)
    _finite("grid_stds", grid)
    mean = grid.mean(dim=-1, keepdim=True)
    if not bool((mean > 0).all()):
        raise ValueError("stds: the mean over the grid must be > 0")
    return (s / mean).to(torch.float32)


# ---------------------------------------------------------------- TurningPoint-GRPO (league.md §4)


@dataclass(frozen=True)
class TurningPoints:
    """What :func:`turning_point_rewards` returns (B rows, n SDE steps; column j is step j + 1 of the paper).

    rewards: (B, n) float32 the per-step rewards; turning: (B, n) bool the turning points that got the bonus
    (after balancing); increments: (B, n) float32 ``d_t = R_t − R_{t−1}``; bonus: (B, n) float32 ``η·(R_sde −
    R_{t−1})`` at the turning points, 0 elsewhere; delta_global: (B,) float32 ``R_sde − R_ode``."""

    rewards: Tensor
    turning: Tensor
    increments: Tensor
    bonus: Tensor
    delta_global: Tensor


def _balance(turning: Tensor, cand: Tensor) -> Tensor:
    """The balanced bonus of one sampling batch: turning (b, n) bool, cand (b, n) the signed candidates. With
    both signs present keep, of each sign, the ``min(#pos, #neg)`` largest ``|cand|``; otherwise leave
    ``turning`` as it is."""
    flat_t = turning.flatten()
    idx = torch.nonzero(flat_t).flatten()  # row-major (row, step) order, as torch.where(mask.flatten())
    vals = cand.flatten()[idx]
    pos, neg = idx[vals > 0], idx[vals < 0]
    if len(pos) == 0 or len(neg) == 0:
        return turning
    keep = min(len(pos), len(neg))

    def top(ix: Tensor) -> Tensor:
        mag = cand.flatten()[ix].abs()
        order = torch.sort(-mag, stable=True).indices  # ties: the earlier turning point first
        return ix[order[:keep]]

    out = torch.zeros_like(flat_t)
    out[top(pos)] = True
    out[top(neg)] = True
    return out.view_as(turning)


def _turning_point_inputs(r_ode: Tensor, r_steps: Tensor, r_sde: Tensor | None,
                          eta: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`turning_point_rewards`' inputs checked (shapes, finite, ``eta`` a float) and in float64: ``R_t``
    (B, n), ``R_0`` (B,) and ``R_sde`` (B,) (``r_sde`` None: the last column of ``r_steps``)."""
    if r_steps.ndim != 2 or r_steps.shape[1] < 1:
        raise ValueError(f"r_steps: expected shape (B, n) with n >= 1, got {tuple(r_steps.shape)}")
    b = r_steps.shape[0]
    steps = r_steps.detach().to(torch.float64)
    ode = torch.as_tensor(r_ode).detach().to(device=steps.device, dtype=torch.float64)
    if ode.shape != (b,):
        raise ValueError(f"r_ode: expected shape ({b},), got {tuple(ode.shape)}")
    sde = steps[:, -1] if r_sde is None else torch.as_tensor(r_sde).detach().to(device=steps.device,
                                                                                 dtype=torch.float64)
    if sde.shape != (b,):
        raise ValueError(f"r_sde: expected shape ({b},), got {tuple(sde.shape)}")
    for name, x in (("r_ode", ode), ("r_steps", steps), ("r_sde", sde)):
        _finite(name, x)
    if not (isinstance(eta, (int, float)) and eta == eta):
        raise ValueError(f"eta: must be a float, got {eta!r}")
    return steps, ode, sde


def _turning_mask(steps: Tensor, d: Tensor, delta: Tensor, sde: Tensor, first_step: bool, first_consistent: bool,
                  inter_consistent: bool) -> Tensor:
    """The turning points (B, n) bool before balancing, from ``R_t`` (B, n), ``d_t`` (B, n), ``Δ`` (B,) and
    ``R_sde`` (B,): with ``s_t = sign(d_t)·sign(Δ)``, step 1 when ``first_step`` (``s_1 > 0``, or consistent when
    ``first_consistent``), step t ≥ 2 when ``s_{t−1} < 0`` and ``s_t > 0`` (and consistent when
    ``inter_consistent``); consistent: ``sign(d_t)·sign(R_sde − R_t) > 0``."""
    b, n = steps.shape
    s = torch.sign(d) * torch.sign(delta).view(b, 1)
    consistent = (torch.sign(d) * torch.sign(sde.view(b, 1) - steps)) > 0  # sign(d_t)·sign(R_sde − R_t) > 0
    turning = torch.zeros(b, n, dtype=torch.bool, device=steps.device)
    if first_step:
        turning[:, 0] = consistent[:, 0] if first_consistent else s[:, 0] > 0
    if n > 1:
        inter = (s[:, :-1] < 0) & (s[:, 1:] > 0)
        if inter_consistent:
            inter = inter & consistent[:, 1:]
        turning[:, 1:] = inter
    return turning


def _balance_batches(turning: Tensor, cand: Tensor, balance_ids: Tensor | None) -> Tensor:
    """:func:`_balance` of each sampling batch (the rows sharing a ``balance_ids`` value; None: all rows at once)."""
    if balance_ids is None:
        return _balance(turning, cand)
    inv, k = _group_index(balance_ids, turning.shape[0], turning.device)
    out = turning.clone()
    for g in range(k):
        rows = torch.nonzero(inv == g).flatten()
        out[rows] = _balance(turning[rows], cand[rows])
    return out


def turning_point_rewards(r_ode: Tensor, r_steps: Tensor, r_sde: Tensor | None = None, *, eta: float = 1.0,
                          apply_first_step_bonus: bool = True,
                          select_first_step_only_from_consistent_trajectory: bool = True,
                          select_inter_step_only_from_consistent_trajectory: bool = True,
                          use_balanced_bonus: bool = True, use_sde_minus_rt: bool = True,
                          drop_original_reward_when_having_bonus: bool = True,
                          balance_ids: Tensor | None = None) -> TurningPoints:
    """TurningPoint-GRPO's per-step rewards with the released script's flags (scripts/single_node/common_op3.sh).

    r_ode: (B,) ``R_0`` the reward of the pure-ODE image from the same initial noise; r_steps: (B, n) ``R_t``,
    t = 1..n, the reward after the first t SDE steps of the window and an ODE completion; r_sde: (B,) the reward of
    the trajectory's own image (None: ``r_steps[:, -1]``; the released pipeline reuses that image as ``R_n``,
    sd3_pipeline_with_logprob_fast_my.py:338-346). Column j of the outputs is SDE step t = j + 1::

        Δ = R_sde − R_0;   d_t = R_t − R_{t−1};   s_t = sign(d_t)·sign(Δ)
        turning point:  t = 1: s_1 > 0 (apply_first_step_bonus); t ≥ 2: s_{t−1} < 0 and s_t > 0;
                        consistent filter: sign(d_t)·sign(R_sde − R_t) > 0 (for t = 1 this implies s_1 > 0)
        balanced:       when both signs of Δ occur among the turning points of a sampling batch, keep of each sign
                        the min(#pos, #neg) with the largest |Δ|; with one sign (or none) keep them all
        r_t = η·(R_sde − R_{t−1}) at a kept turning point (use_sde_minus_rt; else η·Δ), d_t elsewhere;
              without drop_original_reward_when_having_bonus the turning point gets d_t + bonus

    ``balance_ids``: (B,) rows balanced together share an id (the released code balances each sampling batch of
    one process separately: ``for sample in samples``, one ``sample.train_batch_size`` = 9 rows for SD3); None:
    all B rows at once. Returns :class:`TurningPoints`.

    Released (YunzeTong/TurningPoint-GRPO@994d26a scripts/my_train_sd3_fast_with_op3.py): Δ :868; ``R_0 = R_ode``
    :876; d_t :883-885; s_t :890-892; first-step indicator :903-914 (consistent: ``sign(d_list[0]) *
    sign(sde_reward − reward_sequence[1]) > 0``, :907-909); turning point ``(s_last < 0) * (s_t > 0)`` :917-919
    and its consistent filter ``sign(d_list[t]) * sign(sde_reward − reward_sequence[t+1]) > 0`` :925-930;
    balanced bonus :935-1004: the candidates are ``delta_global`` (:945, since use_delta_global=True and
    take_delta_global_as_main=False; use_sde_minus_rt is *not* applied there), positives and negatives among the
    turning points :953-961, ``keep_count = min`` :965, ``torch.topk(abs(values), keep_count)`` per sign
    :980-992, the new mask :998-1003, and "if all same sign or no turning points, keep original indicators"
    (:1004); bonus ``B_t = sde_reward − reward_sequence[t]`` :1073-1074, ``eta * indicator * B_t`` :1084; the main
    term ``d_list[t]`` :1071 zeroed where ``B_t != 0`` :1087-1091; ``R_t = main_t + B_t`` :1096. Flags:
    scripts/single_node/common_op3.sh (apply_first_step_bonus, use_delta_global, select_first_step_only_from_
    consistent_trajectory, select_inter_step_only_from_consistent_trajectory, use_balanced_bonus,
    use_sde_minus_rt, drop_original_reward_when_having_bonus = true; take_delta_global_as_main,
    propagate_bonus_to_future_steps, indicator_wo_delta_global_constraint = false; eta = 1.0);
    config/my_grpo.py:349, :351 turn_on_bonus_global_step = 0, select_only_positive_intermediate_step = False.

    Not implemented (off in the released script): take_delta_global_as_main, propagate_bonus_to_future_steps,
    indicator_wo_delta_global_constraint, select_only_positive_intermediate_step, a delayed
    turn_on_bonus_global_step. Deviations: (1) ties in ``|Δ|`` (common: the turning points of one row share its
    Δ) go to the earlier turning point in row-major (row, step) order; ``torch.topk``'s choice among ties is
    unspecified. (2) float64 arithmetic (the released is float32); the signs are the same (a float32
    difference rounds to 0 only when the two are equal).
    """
    steps, ode, sde = _turning_point_inputs(r_ode, r_steps, r_sde, eta)
    b, n = steps.shape
    prev = torch.cat([ode.view(b, 1), steps[:, :-1]], dim=1)  # R_{t-1}, (B, n)
    d = steps - prev
    delta = sde - ode
    turning = _turning_mask(steps, d, delta, sde, apply_first_step_bonus,
                            select_first_step_only_from_consistent_trajectory,
                            select_inter_step_only_from_consistent_trajectory)
    if use_balanced_bonus:
        turning = _balance_batches(turning, delta.view(b, 1).expand(b, n), balance_ids)

    raw = (sde.view(b, 1) - prev) if use_sde_minus_rt else delta.view(b, 1).expand(b, n)
    bonus = float(eta) * turning.to(torch.float64) * raw
    main = d
    if drop_original_reward_when_having_bonus:
        main = torch.where(bonus != 0, torch.zeros_like(d), d)
    f32 = torch.float32
    return TurningPoints(rewards=(main + bonus).to(f32), turning=turning, increments=d.to(f32),
                         bonus=bonus.to(f32), delta_global=delta.to(f32))


def per_step_advantages(r: Tensor, group_ids: Tensor, eps: float = 1e-4, *, global_std: bool = False) -> Tensor:
    """TurningPoint-GRPO's advantages: one ``PerPromptStatTracker`` per timestep column.

    r: (B, n) per-step rewards (:attr:`TurningPoints.rewards`); group_ids: (B,) the prompt of each row. Returns
    (B, n) float32 ``A[i, t] = (r[i, t] − mean_{c(i)} r[·, t]) / (std_{c(i)} r[·, t] + eps)``, population std
    (ddof 0), eps 1e-4; ``global_std``: the std of column t over all rows.

    Released (YunzeTong/TurningPoint-GRPO@994d26a): scripts/my_train_sd3_fast_with_op3.py:614-617 one
    ``PerPromptStatTracker(config.sample.global_std)`` per trained timestep, :1402-1411 ``advantages_t =
    stat_trackers_per_timestep[t].update(prompts, rewards_t)`` on the process rewards gathered over all
    processes (:1312, :1395) and stacked; flow_grpo/stat_tracking.py:25-31 ``np.mean`` / ``np.std(...) + 1e-4``;
    config/my_grpo.py:322 ``global_std = False`` (pickscore_sd3_fast_op3). Deviation: a constant (group,
    column) gives exactly 0 (the tracker: 0 up to the round-off of ``np.mean``).
    """
    return _per_column(r, group_ids, eps, global_std, "r")


# ---------------------------------------------------------------- Granular-GRPO (league.md §5)


def g2rpo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-8) -> Tensor:
    """Granular-GRPO's multi-granularity advantage, summed over granularities (and reward models).

    rewards: (B, S, G) the reward of row i's branch at trained step k completed at granularity g, or (M, B, S, G)
    with a leading reward-model axis; group_ids: (B,) the prompt of each row. Returns (B, S) float32::

        A[i, k] = Σ_m Σ_g (R[m, i, k, g] − mean_{c(i)} R[m, ·, k, g]) / (std_{c(i)} R[m, ·, k, g] + eps)

    with the sample std (ddof 1, ``torch.Tensor.std``'s default) and eps 1e-8. The scale grows with G·M.

    Released (bcmi/Granular-GRPO@04ee954 fastvideo/train_g2rpo_hps.py, ``train_one_step``): :657 the groups are
    the consecutive blocks of ``num_generations`` rows; :660-674 for each granularity's (B, S) rewards
    ``group_mean = group_rewards.mean(dim=0)``, ``group_std = group_rewards.std(dim=0) + 1e-8``, ``(group_rewards
    − group_mean) / group_std``, summed into ``hps_advantages``; :677-691 the same for the CLIP score; :693
    ``samples["advantages"] = hps_advantages + clip_advantages``. The (B, S) per granularity come from
    ``sample_reference_model`` (:313): one SDE step at each ``eta_step`` from the anchor (:436), completed on
    ``σ[:k+2]`` + ``σ[k+2::g]`` (:456-457), stacked over the steps (:518). The version at ef6ec9f of the same
    file has the HPS sum only (M = 1). Released flags (scripts/finetune/finetune_g2rpo_hps.sh):
    num_generations 12, eta_step_list 0..7, granular_list 1 2, train_batch_size 1 (one prompt per process).

    Deviations: (1) a constant (group, step, granularity) gives exactly 0; the released ``(r − mean)/(std +
    1e-8)`` in float32 can give an O(1) value when the mean is off by an ulp (both the numerator and the std are
    then ~1 ulp). (2) a group of one row gives 0; torch's unbiased std of one value is NaN. (3) statistics in
    float64 (the released: float32).
    """
    if rewards.ndim == 3:
        v = rewards.unsqueeze(0)
    elif rewards.ndim == 4:
        v = rewards
    else:
        raise ValueError(f"rewards: expected shape (B, S, G) or (M, B, S, G), got {tuple(rewards.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps!r}")
    v = v.detach().to(torch.float64)
    _finite("rewards", v)
    m, b, s, g = v.shape
    inv, k = _group_index(group_ids, b, v.device)
    if k == 0:
        return torch.zeros(b, s, dtype=torch.float32, device=v.device)
    cols = v.permute(1, 0, 2, 3).reshape(b, m * s * g)  # one column per (model, step, granularity)
    adv = _normalize_columns(cols, inv, k, ddof=1, eps=eps).view(b, m, s, g)
    return adv.sum(dim=(1, 3)).to(torch.float32)
