"""Rollout, x̂0 estimates and stepwise rewards: the no-grad half of one GRPO iteration (method.md §10).

``rollout`` samples trajectories with the configured SDE under π_old; ``stepwise_rewards`` estimates the clean image
at every state (T′ Euler substeps, all B·T states in one batch per substep) and scores B·(T+1) images in one reward
call. The :class:`Trajectory` is the only object that crosses from rollout to update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from stepflow.data import seeded_normal
from stepflow.estimate import estimate_x0_with_nfe
from stepflow.policies.base import Cond, FlowPolicy
from stepflow.rewards.base import Reward
from stepflow.sde import SamplerConfig, sde_step


@dataclass
class Trajectory:
    """A batch of B trajectories of T steps.

    latents: (B, T+1, C, H, W) states X_0 (noise) .. X_T (final latent), fp32
    velocities: (B, T, C, H, W) the rollout's v at (X_k, τ_k) (reused by the T′=1 estimate)
    log_probs: (B, T) log π_old(X_{k+1} | X_k) under the sampler's convention (0 where untrainable)
    stds: (B, T) per-step std; trainable: (B, T) bool (std > 0)
    kl_scales: (B, T) the std Flow-GRPO's KL divides by (see ``stepflow.sde.StepOut``)
    times: (T+1,) the grid τ_0 = 1 .. τ_T = 0
    cond: B rows of prompt conditioning; prompts / meta: B entries; group_ids: (B,) long (global group ids)
    rewards: (B, T+1) R_k = R(decode(x̂0(X_k, τ_k))) for k < T and R_T = R(decode(X_T)); NaN where not computed
    x0_hat: (B, T+1, C, H, W) or None, the estimates themselves (distillation targets)
    """

    latents: Tensor
    velocities: Tensor
    log_probs: Tensor
    stds: Tensor
    trainable: Tensor
    kl_scales: Tensor
    times: Tensor
    cond: Cond
    prompts: list[str]
    meta: list[dict[str, Any]]
    group_ids: Tensor
    rewards: Tensor | None = None
    x0_hat: Tensor | None = None
    reward_components: dict[str, Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        return self.latents.shape[1] - 1


@torch.no_grad()
def rollout(policy: FlowPolicy, cond: Cond, prompts: Sequence[str], meta: Sequence[dict], group_ids: Tensor,
            sampler: SamplerConfig, num_steps: int, guidance: float, latent_seeds: Tensor, sample_seeds: Tensor,
            ) -> tuple[Trajectory, int]:
    """Sample B trajectories with ``sampler`` under the current weights (π_old). Returns (trajectory, NFEs).

    Noise is row-seeded (``latent_seeds`` for X_0, ``sample_seeds`` for the SDE noise), so a sample does not depend
    on the batch it is in. NFEs count sample-level transformer evaluations (CFG doubles them).
    """
    device = policy.device
    b = len(prompts)
    shape = tuple(policy.latent_shape)
    times = policy.time_grid(num_steps).to(device)
    x = seeded_normal(latent_seeds, shape, device)
    eps = seeded_normal(sample_seeds, (num_steps, *shape), device)  # (B, T, C, H, W)
    t_guard = times[1]
    lat, vel, lps, stds, trn, kls = [x], [], [], [], [], []
    for k in range(num_steps):
        v = policy.velocity(x, times[k], cond, guidance)
        out = sde_step(sampler, x, v, times[k], times[k + 1], t_guard=t_guard, noise=eps[:, k])
        x = out.next
        lat.append(x); vel.append(v); lps.append(out.log_prob); stds.append(out.std)
        trn.append(out.trainable); kls.append(out.kl_scale)
    nfe = b * num_steps * (2 if guidance != 1.0 else 1)
    traj = Trajectory(
        latents=torch.stack(lat, 1), velocities=torch.stack(vel, 1), log_probs=torch.stack(lps, 1),
        stds=torch.stack([s.expand(b) if s.ndim == 0 else s for s in stds], 1),
        trainable=torch.stack([s.expand(b) if s.ndim == 0 else s for s in trn], 1),
        kl_scales=torch.stack([s.expand(b) if s.ndim == 0 else s for s in kls], 1),
        times=times, cond=cond, prompts=list(prompts), meta=list(meta), group_ids=group_ids,
    )
    return traj, nfe


@torch.no_grad()
def estimate_states(policy: FlowPolicy, traj: Trajectory, substeps: int, guidance: float, adaptive: bool = False,
                    chunk_size: int | None = None) -> tuple[Tensor, int]:
    """x̂0 for every state X_0..X_{T-1} of every trajectory (method.md §4), batched over steps.

    Returns (x0_hat (B, T+1, C, H, W) with x0_hat[:, T] = X_T, NFEs). ``chunk_size`` bounds the number of states
    per model call (memory); the substep grid is per state, so chunking does not change the result.
    """
    b, t_steps = traj.batch_size, traj.num_steps
    states = traj.latents[:, :t_steps].flatten(0, 1)  # (B*T, C, H, W), row i*T + k
    times = traj.times[:t_steps].repeat(b)  # (B*T,)
    v0 = traj.velocities.flatten(0, 1)
    cond_rows = traj.cond.repeat(t_steps)  # (B*T) rows, row i*T + k -> cond i
    m = states.shape[0]
    chunk = chunk_size or m
    outs, nfe = [], 0
    for s in range(0, m, chunk):
        sl = slice(s, s + chunk)
        c = cond_rows.index(sl)

        def vfn(x: Tensor, t: Tensor, rows: Tensor, c=c) -> Tensor:  # compact mode: only unfinished rows
            return policy.velocity(x, t, c.index(rows.to("cpu") if c.tokens.device.type == "cpu" else rows), guidance)

        x0, n = estimate_x0_with_nfe(vfn, states[sl], times[sl], substeps, v0=v0[sl], adaptive=adaptive, compact=True)
        outs.append(x0)
        nfe += n * (2 if guidance != 1.0 else 1)
    x0_hat = torch.cat(outs).view(b, t_steps, *states.shape[1:])
    return torch.cat([x0_hat, traj.latents[:, -1:]], 1), nfe


@torch.no_grad()
def score_final(policy: FlowPolicy, reward: Reward, traj: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
    """R_T only (what uniform credit needs): rewards (B, T+1) with NaN except the last column."""
    out = reward(policy.decode(traj.latents[:, -1]), traj.prompts, traj.meta)
    r = torch.full((traj.batch_size, traj.num_steps + 1), float("nan"))
    r[:, -1] = out.scores
    return r, out.components


@torch.no_grad()
def score_states(policy: FlowPolicy, reward: Reward, traj: Trajectory, x0_hat: Tensor,
                 decode_chunk: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """R_0..R_T from the estimates (B, T+1, ...) in one reward call over B·(T+1) decoded images."""
    b, tp1 = x0_hat.shape[:2]
    flat = x0_hat.flatten(0, 1)
    chunk = decode_chunk or flat.shape[0]
    images = torch.cat([policy.decode(flat[s:s + chunk]) for s in range(0, flat.shape[0], chunk)])
    prompts = [p for p in traj.prompts for _ in range(tp1)]
    meta = [m for m in traj.meta for _ in range(tp1)]
    out = reward(images, prompts, meta)
    comps = {k: v.view(b, tp1) for k, v in out.components.items()}
    return out.scores.view(b, tp1), comps
