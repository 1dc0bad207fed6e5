"""The pieces of the branch rollout (:class:`stepflow.rollouts.branches.BranchRollout`): TempFlow-GRPO and
Granular-GRPO (``advantage=tempflow | g2rpo``; docs/method.md §13).

Where the trajectory strategy rolls out B trajectories and credits their own steps, these methods
roll out a deterministic **anchor** (the Euler ODE) and, at every trained step k, let each rollout row draw K SDE
transitions ``X_k → X_{k+1}^{(j)}`` from the anchor's state, each completed to an image by the ODE
(:func:`stepflow.core.branch.branch_at`). A branch's reward is then the effect of its one stochastic step, so it is
credited to that step alone: the update trains each **branch row** (anchor state X_k, branch X_{k+1}^{(j)}, its
log-prob under the sampler) at its own step only, through the per-row term mask of :func:`stepflow.core.update.update`.

Rows of the plan that share their prompt and initial noise share one anchor (computed once): ``loop.same_latent=
false`` gives every row its own anchor (TempFlow-GRPO: N seeds × K branches per prompt), ``true`` one anchor per
prompt whose G rows are its branches (Granular-GRPO: ``--init_same_noise``, one branch per row, ``branches=1``).
Branch j of row i at step k draws its noise from the row's step-noise seed, its step and j
(:func:`stepflow.core.branch.branch_at`): a branch does not depend on the batch, the rank or the resume point.

Phases: ``rollout`` the anchors (T NFEs each), ``estimate`` the branches and their completions (the rewards'
cost: ``Σ_k (T − k − 1)`` NFEs per branch at granularity 1), ``reward`` one call for every branch image and the
anchors' own final images (``train/reward_final``: the current policy's ODE image, what the evaluation sees),
``advantage`` :meth:`stepflow.credits.branched.BranchCredit.branch_advantages` over every rank's rows, ``update``.
The logged ``train/reward_step{k}`` is the mean reward of the branches at step k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stepflow.core.branch import Branches
from stepflow.core.data import IterationPlan
from stepflow.core.rollout import Scores, Trajectory, _decode
from stepflow.errors import NonFiniteRewardsError

__all__ = ["anchor_rows", "branch_trajectory", "score_branches", "branch_advantages"]


def anchor_rows(plan: IterationPlan) -> tuple[IterationPlan, Tensor]:
    """The distinct anchors of a plan: one per (prompt, initial-noise seed), in order of first appearance.
    Returns the anchors' plan (U rows) and ``amap`` (B,) long, the anchor of each row."""
    seen: dict[tuple[str, int], int] = {}
    first, amap = [], []
    for i, (p, s) in enumerate(zip(plan.prompts, plan.init_noise_seeds.tolist())):
        key = (p, int(s))
        if key not in seen:
            seen[key] = len(first)
            first.append(i)
        amap.append(seen[key])
    idx = torch.tensor(first, dtype=torch.long)
    sub = IterationPlan([plan.prompts[i] for i in first], [plan.meta[i] for i in first], plan.group_ids[idx],
                        plan.step_noise_seeds[idx], plan.init_noise_seeds[idx])
    return sub, torch.tensor(amap, dtype=torch.long)


def branch_trajectory(anchor: Trajectory, amap: Tensor, branches: list[Branches], adv: Tensor,
                      prompts: list[str], meta: list) -> tuple[Trajectory, Tensor, Tensor]:
    """The branch rows as one :class:`~stepflow.core.rollout.Trajectory` the update trains from.

    anchor: the U anchors (an ODE rollout); amap: (B,) the anchor of each rollout row; branches: one
    :class:`~stepflow.core.branch.Branches` per trained step (S of them, over the B rows, K branches each); adv: (B, K, S)
    the branches' advantages. Row ``(i·K + j)·S + s`` is branch j of row i at step ``k_s = branches[s].k``: its
    states are the anchor's but ``X_{k_s+1}`` (the branch's), its log-prob, trainable flag and advantage are set at
    step k_s only, and its velocity at X_{k_s} is the anchor's (the behaviour policy's, what GRPO-Guard reads). A
    merged branch (``branches[s].span`` m > 1) holds its state at ``X_{k_s+m}`` instead, and the trajectory's
    ``spans`` say that step k_s lands there (``Trajectory.step_end``); None when every span is 1.
    Returns (the trajectory of B·K·S rows, its advantages (B·K·S, T), its term mask (B·K·S, S): row r trains the
    term of its own step)."""
    b, k_br, s_n = adv.shape
    t_steps = anchor.num_steps
    n = b * k_br * s_n
    per = k_br * s_n
    lat = anchor.latents[amap].repeat_interleave(per, 0).clone()
    vel = anchor.velocities[amap].repeat_interleave(per, 0)
    lps = torch.zeros(n, t_steps, dtype=anchor.log_probs.dtype, device=anchor.log_probs.device)
    trn = torch.zeros(n, t_steps, dtype=torch.bool, device=anchor.trainable.device)
    a = torch.zeros(n, t_steps, dtype=torch.float32)
    mask = torch.zeros(n, s_n, dtype=torch.bool)
    base = torch.arange(b * k_br) * s_n  # the rows of (i, j) at s = 0
    spans = torch.ones(t_steps, dtype=torch.long)
    for s, br in enumerate(branches):
        rows = base + s
        spans[br.k] = br.span
        lat[rows, br.k + br.span] = br.next.reshape(b * k_br, *br.next.shape[2:]).to(lat.dtype)
        lps[rows, br.k] = br.log_probs.reshape(b * k_br).to(lps.dtype)
        trn[rows, br.k] = True
        a[rows, br.k] = adv[:, :, s].reshape(b * k_br).float()
        mask[rows, s] = True
    traj = Trajectory(latents=lat, velocities=vel, log_probs=lps, trainable=trn, times=anchor.times,
                      cond=anchor.cond.index(amap).repeat(per),
                      prompts=[p for p in prompts for _ in range(per)], meta=[m for m in meta for _ in range(per)],
                      spans=spans if bool((spans > 1).any()) else None)
    return traj, a, mask


def score_branches(learner, anchor: Trajectory, amap: Tensor, branches: list[Branches], plan: IterationPlan):
    """One reward call over every branch's completed image (row i, branch j, step s, granularity g) and the
    anchors' final images. Returns the rows' :class:`~stepflow.core.rollout.Scores` ((B, T+1): the mean reward of the
    branches at each trained step over the first granularity, R_T the row's anchor image, components the anchor
    image's) and the branch rewards (B, K, S, G)."""
    pol, steps = learner.policy, learner.loop.num_steps
    b, n_s = len(plan), len(branches)
    if n_s:
        finals = torch.stack([br.final for br in branches], 2)  # (B, K, S, G, C, H, W)
        k_br, g_n = finals.shape[1], finals.shape[3]
        flat = finals.flatten(0, 3)
    else:
        k_br, g_n, flat = int(learner.advantage.cfg.branches), len(learner.advantage.cfg.granularities), None
    per = k_br * n_s * g_n
    lat = anchor.latents[:, -1] if flat is None else torch.cat([flat, anchor.latents[:, -1]])
    images = _decode(pol, lat, learner.loop.decode_chunk)
    prompts = [p for p in plan.prompts for _ in range(per)] + list(anchor.prompts)
    meta = [m for m in plan.meta for _ in range(per)] + list(anchor.meta)
    out = learner.reward(images, prompts, meta)
    sc = out.scores.float()
    branch_r = sc[:b * per].view(b, k_br, n_s, g_n)
    own = sc[b * per:][amap]  # each row's anchor image
    rewards = torch.full((b, steps + 1), float("nan"))
    for s, br in enumerate(branches):
        rewards[:, br.k] = branch_r[:, :, s, 0].mean(1)
    rewards[:, steps] = own
    comps = {name: v.float()[b * per:][amap] for name, v in out.components.items()}
    return Scores(rewards, comps, images=len(images)), branch_r


def branch_advantages(learner, rewards: Tensor, group_ids: Tensor, it: int, trained: list[int], steps: int):
    """The branch advantages (B, K, S) of every rank's rows; a row with a NaN / inf branch reward is dropped (all its
    branches get advantage 0 and leave the statistics); more than ``loop.max_nonfinite_frac`` dropped rows stop the
    run. Returns (advantages, dropped (B,) bool, stats)."""
    b = rewards.shape[0]
    dropped = ~torch.isfinite(rewards.flatten(1)).all(1) if rewards.numel() else torch.zeros(b, dtype=torch.bool)
    n = int(dropped.sum())
    if n > learner.loop.max_nonfinite_frac * b:
        raise NonFiniteRewardsError(f"{n} of {b} samples of iteration {it} have a NaN / inf branch reward (more than "
                                    f"loop.max_nonfinite_frac={learner.loop.max_nonfinite_frac}); check the reward "
                                    f"({_describe(learner.reward)})")
    adv = torch.zeros(rewards.shape[:3], dtype=torch.float32)
    stats: dict[str, float] = {}
    keep = ~dropped
    if trained and bool(keep.any()):
        adv[keep], stats = learner.advantage.branch_advantages(rewards[keep], group_ids[keep])
    absm = adv.abs().double().mean(dim=(0, 1)) if trained else torch.zeros(0)
    for s, k in enumerate(trained):
        stats[f"adv_abs_mean_step{k}"] = float(absm[s])
    return adv, dropped, stats


def _describe(reward) -> str:
    """The reward in a message (:meth:`stepflow.rewards.base.Reward.describe`; a plain callable: its type)."""
    describe = getattr(reward, "describe", None)
    return describe() if callable(describe) else f"reward {type(reward).__name__}"
