"""The no-grad half of a GRPO iteration: rollout, x̂0 estimates, stepwise rewards (docs/method.md §4, §10).

Data flows one way: :func:`rollout` returns a frozen :class:`Trajectory` (the only object that crosses from the
rollout to the update); :func:`estimate_states` and :func:`score` read it and return their own results
(:class:`Scores`). Nothing writes back into the trajectory.

Index convention (docs/method.md §1): array index ``k = 0..T`` with ``X_0`` the initial noise (the paper's ``x_T``)
and ``X_T`` the final latent (the paper's ``x_0``); step ``k`` maps ``X_k → X_{k+1}`` (the paper's ``t = T − k``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from stepflow.data import IterationPlan, seeded_normal
from stepflow.estimate import estimate_x0_with_nfe
from stepflow.policies.base import Cond, FlowPolicy
from stepflow.rewards.base import Reward
from stepflow.sde import SamplerConfig, sde_step

__all__ = ["Trajectory", "Scores", "rollout", "estimate_states", "score"]


@dataclass(frozen=True)
class Trajectory:
    """A batch of B trajectories of T steps, as sampled under π_old.

    latents: (B, T+1, C, H, W) states X_0 (the initial noise) .. X_T (the final latent), fp32
    velocities: (B, T, C, H, W) the rollout's v at (X_k, τ_k) (reused by substep 0 of the x̂0 estimate)
    log_probs: (B, T) log π_old(X_{k+1} | X_k) under the sampler's convention (0 where untrainable)
    trainable: (B, T) bool, the step's noise std > 0
    times: (T+1,) the grid τ_0 = 1 .. τ_T = 0
    cond: B rows of prompt conditioning; prompts / meta: B prompt strings and records
    """

    latents: Tensor
    velocities: Tensor
    log_probs: Tensor
    trainable: Tensor
    times: Tensor
    cond: Cond
    prompts: list[str]
    meta: list[dict[str, Any]]

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        return self.latents.shape[1] - 1


@dataclass(frozen=True)
class Scores:
    """What the reward said about a trajectory batch.

    rewards: (B, T+1) R_k = R(decode(x̂0(X_k, τ_k))) for k < T and R_T = R(decode(X_T)); NaN where not computed
    (uniform credit scores only R_T). components: named (B,) reward parts of the final image (for logging).
    images: how many images were scored.
    """

    rewards: Tensor
    components: dict[str, Tensor] = field(default_factory=dict)
    images: int = 0


@torch.no_grad()
def rollout(policy: FlowPolicy, plan: IterationPlan, sampler: SamplerConfig, num_steps: int,
            guidance: float) -> Trajectory:
    """Encode the plan's prompts and sample its B trajectories with ``sampler`` under the current weights (π_old).

    Noise is row-seeded (``plan.init_noise_seeds`` for X_0, ``plan.step_noise_seeds`` for the SDE noise ε of every
    step), so a sample does not depend on the batch it is in (one process vs DDP, resume).
    """
    device = policy.device
    b = len(plan)
    cond = policy.encode(plan.prompts)
    shape = tuple(policy.latent_shape)
    times = policy.time_grid(num_steps).to(device)
    x = seeded_normal(plan.init_noise_seeds, shape, device)
    eps = seeded_normal(plan.step_noise_seeds, (num_steps, *shape), device)  # (B, T, C, H, W)
    lat, vel, lps, trn = [x], [], [], []
    for k in range(num_steps):
        v = policy.velocity(x, times[k], cond, guidance)
        out = sde_step(sampler, x, v, times[k], times[k + 1], t_guard=times[1], noise=eps[:, k])
        x = out.next
        lat.append(x); vel.append(v); lps.append(out.log_prob)
        trn.append(out.trainable.expand(b) if out.trainable.ndim == 0 else out.trainable)
    return Trajectory(latents=torch.stack(lat, 1), velocities=torch.stack(vel, 1), log_probs=torch.stack(lps, 1),
                      trainable=torch.stack(trn, 1), times=times, cond=cond, prompts=list(plan.prompts),
                      meta=list(plan.meta))


@torch.no_grad()
def estimate_states(policy: FlowPolicy, traj: Trajectory, substeps: int, guidance: float, adaptive: bool = False,
                    chunk_size: int | None = None) -> Tensor:
    """x̂0 for every state X_0..X_{T-1} of every trajectory (docs/method.md §4), batched over steps.

    Returns x0_hat (B, T+1, C, H, W) with ``x0_hat[:, T] = X_T``. ``chunk_size`` bounds the states per model call
    (memory); the substep grid is per state, so chunking does not change the result.
    """
    b, t_steps = traj.batch_size, traj.num_steps
    states = traj.latents[:, :t_steps].flatten(0, 1)  # (B*T, C, H, W), row i*T + k
    times = traj.times[:t_steps].repeat(b)  # (B*T,)
    v0 = traj.velocities.flatten(0, 1)
    cond_rows = traj.cond.repeat(t_steps)  # (B*T) rows, row i*T + k -> cond i
    m = states.shape[0]
    chunk = chunk_size or m
    outs = []
    for s in range(0, m, chunk):
        sl = slice(s, s + chunk)
        c = cond_rows.index(sl)

        def vfn(x: Tensor, t: Tensor, rows: Tensor, c=c) -> Tensor:  # compact mode: only unfinished rows
            return policy.velocity(x, t, c.index(rows.to("cpu") if c.tokens.device.type == "cpu" else rows), guidance)

        outs.append(estimate_x0_with_nfe(vfn, states[sl], times[sl], substeps, v0=v0[sl], adaptive=adaptive,
                                         compact=True)[0])
    x0_hat = torch.cat(outs).view(b, t_steps, *states.shape[1:])
    return torch.cat([x0_hat, traj.latents[:, -1:]], 1)


def _decode(policy: FlowPolicy, latents: Tensor, chunk: int | None) -> Tensor:
    n = latents.shape[0]
    chunk = chunk or n
    return torch.cat([policy.decode(latents[s:s + chunk]) for s in range(0, n, chunk)])


def _repeat(items: Sequence, n: int) -> list:
    return [x for x in items for _ in range(n)]


@torch.no_grad()
def score(policy: FlowPolicy, reward: Reward, traj: Trajectory, x0_hat: Tensor | None = None,
          decode_chunk: int | None = None) -> Scores:
    """Decode and score in one reward call: R_0..R_T from the estimates ``x0_hat`` (B, T+1, ...) when given
    (B·(T+1) images), else only R_T of the final latents (B images; what uniform credit reads)."""
    b, tp1 = traj.batch_size, traj.num_steps + 1
    if x0_hat is None:
        out = reward(_decode(policy, traj.latents[:, -1], decode_chunk), traj.prompts, traj.meta)
        rewards = torch.full((b, tp1), float("nan"))
        rewards[:, -1] = out.scores
        return Scores(rewards, dict(out.components), images=b)
    images = _decode(policy, x0_hat.flatten(0, 1), decode_chunk)
    out = reward(images, _repeat(traj.prompts, tp1), _repeat(traj.meta, tp1))
    comps = {k: v.view(b, tp1)[:, -1] for k, v in out.components.items()}
    return Scores(out.scores.view(b, tp1), comps, images=b * tp1)
