"""Branch rollouts: from a shared anchor trajectory, one SDE step at step k and an ODE completion of the rest.

The methods that give each step a *true* reward (TempFlow-GRPO, TurningPoint-GRPO, Granular-GRPO; league.md §3–§5)
branch off a deterministic anchor: at step k every branch draws its own SDE transition ``X_k → X_{k+1}^{(j)}`` and is
then completed to an image by the Euler ODE, so the branch's reward is the effect of that one stochastic step (plus
the completion's). This is what stepflow's Tweedie / T′-substep estimates stand in for at a fraction of the cost.

Index convention as in :mod:`stepflow.core.rollout`: ``X_0`` the initial noise, ``X_T`` the final latent, step k maps
``X_k → X_{k+1}`` on the grid ``τ_0 = 1 > … > τ_T = 0``.

NFE cost (sample-level transformer evaluations; CFG doubles each): the anchor costs T per sample; a branch at step k
costs 1 (the SDE step; its velocity at ``X_k`` is the anchor's, reused) plus the completion's steps: ``T − k − 1`` at
granularity 1, ``ceil((T − k − 2)/g) + 1`` at granularity g (:func:`completion_grid`). K branches at every step
0..T−2 of N anchors at granularity 1 cost ``N·K·Σ_{k<T−1}(T − k − 1) = N·K·T(T−1)/2`` NFEs (TempFlow-GRPO: 45·N·K
for T = 10), counted by the policy's NFE counter like every other phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stepflow.core.data import seeded_normal
from stepflow.core.rollout import model_velocity
from stepflow.math.sde import ode_step, sde_step
from stepflow.policies.base import Cond, FlowPolicy

if TYPE_CHECKING:
    from stepflow.samplers.base import Sampler

__all__ = ["completion_grid", "complete", "complete_states", "Branches", "branch_at", "completion_nfe"]


def completion_grid(times: Tensor, k: int, granularity: int = 1, jump_last: bool = False) -> Tensor:
    """The times an ODE completion of a branch at step k visits after ``τ_{k+1}``: Granular-GRPO's suffix
    ``σ[k+2::g]`` (every g-th remaining grid point), with the final ``τ_T = 0`` appended when the stride skips it
    (``jump_last``: put in place of the suffix's last time instead, FastVideo's loop as released in E-GRPO's
    VisualGRPO ``_run_ode_sample`` and Granular-GRPO's ``run_ode_sample_step``: it stops one time short of the
    suffix's end and returns the x̂0 of its last evaluation, i.e. an Euler step from there to 0).

    times: (T+1,) the grid. Returns (M,) times strictly after τ_{k+1}, ending at τ_T; empty when k + 1 = T.
    """
    t_steps = times.shape[0] - 1
    if not 0 <= k < t_steps:
        raise ValueError(f"k: must be in 0..{t_steps - 1}, got {k}")
    if granularity < 1:
        raise ValueError(f"granularity: must be >= 1, got {granularity}")
    suffix = times[k + 2::granularity]
    if k + 2 <= t_steps and (len(suffix) == 0 or float(suffix[-1]) != float(times[-1])):
        suffix = torch.cat([suffix[:-1] if jump_last else suffix, times[-1:]])
    return suffix


def completion_nfe(num_steps: int, k: int, granularity: int = 1, span: int = 1, jump_last: bool = False) -> int:
    """Velocity evaluations of one branch at step k spanning ``span`` grid intervals: the SDE step (0: it reuses the
    anchor's velocity at X_k) and one per completion step (after ``τ_{k+span}``)."""
    return len(completion_grid(torch.linspace(1, 0, num_steps + 1), k + span - 1, granularity, jump_last))


@torch.no_grad()
def complete(policy: FlowPolicy, x: Tensor, t_from: Tensor | float, suffix: Tensor, cond: Cond,
             guidance: float = 1.0) -> Tensor:
    """Euler ODE from states ``x`` (B, C, H, W) at time ``t_from`` through the times ``suffix`` (M,) to the last
    one (the final latent when it is 0). Returns the end states (B, C, H, W); one velocity per step."""
    t = torch.as_tensor(t_from, dtype=torch.float32)
    for s in suffix:
        v = policy.velocity(x, t, cond, guidance)
        x = ode_step(x, v, t, s).next
        t = s
    return x


@torch.no_grad()
def complete_states(policy: FlowPolicy, latents: Tensor, times: Tensor, cond: Cond, states: Sequence[int],
                    guidance: float = 1.0) -> Tensor:
    """The ODE completion of the states ``states`` of a rollout (``advantage.reward_source=completion``): X_k
    (``latents[:, k]``, latents (B, D+1, C, H, W)) by the Euler ODE over ``τ_{k+1} .. τ_T`` (T − k NFEs per sample;
    the state X_T is its own completion). Returns (B, T+1, C, H, W), zeros at the other states, like
    :func:`stepflow.core.rollout.estimate_states`."""
    b, t_steps = latents.shape[0], times.shape[0] - 1
    out = latents.new_zeros((b, t_steps + 1, *latents.shape[2:]))
    for k in sorted(set(states)):
        if k > latents.shape[1] - 1:
            raise ValueError(f"states: the rollout stopped at state {latents.shape[1] - 1}; cannot complete state {k}")
        out[:, k] = latents[:, k] if k == t_steps else complete(policy, latents[:, k], times[k], times[k + 1:], cond,
                                                                 guidance)
    return out


@dataclass(frozen=True)
class Branches:
    """K SDE branches at step k of B anchor trajectories, each completed by the ODE.

    span: the grid intervals the branch's SDE step covers (1; a merged step: m, from τ_k to τ_{k+m});
    next: (B, K, C, H, W) the branches' ``X_{k+span}^{(j)}``; log_probs: (B, K) ``log π(X_{k+1}^{(j)} | X_k)`` under the
    sampler; final: (B, K, G, C, H, W) the completed final latents at each granularity of ``granularities``;
    mean / std: (B, C, H, W) / (B,) the transition's mean and noise std (shared by the K branches)."""

    k: int
    next: Tensor
    log_probs: Tensor
    final: Tensor
    granularities: tuple[int, ...]
    mean: Tensor
    std: Tensor
    span: int = 1


@torch.no_grad()
def branch_at(policy: FlowPolicy, anchor_latents: Tensor, anchor_velocities: Tensor, times: Tensor, cond: Cond,
              k: int, sampler: Sampler, num_branches: int, seeds: Tensor, guidance: float = 1.0,
              granularities: Sequence[int] = (1,), span: int = 1, jump_last: bool = False) -> Branches:
    """From the anchor's state ``X_k`` (``anchor_latents[:, k]``, (B, T+1, C, H, W)) take ``num_branches`` SDE
    steps under ``sampler`` with the anchor's velocity at X_k (``anchor_velocities[:, k]``) and complete each by the
    Euler ODE at every granularity. ``seeds``: (B,) one per anchor row; branch j of row i draws its noise from
    seed ``seeds[i]·1009 + 31·k + j`` (a branch depends on its row, step and index only, not on the batch).

    ``span`` m (a merged step, E-GRPO): the SDE step goes from ``τ_k`` straight to ``τ_{k+m}`` (the sampler's one
    Gaussian transition over ``Δt = τ_k − τ_{k+m}``, its log-prob included), and the completion continues from
    there on ``σ[k+m+1::g]``; ``jump_last``: the completion's end rule of :func:`completion_grid`.
    """
    b, t_steps = anchor_latents.shape[0], times.shape[0] - 1
    if not 0 <= k < t_steps:
        raise ValueError(f"k: must be in 0..{t_steps - 1}, got {k}")
    if not (isinstance(span, int) and 1 <= span <= t_steps - k):
        raise ValueError(f"span: must be an integer in 1..{t_steps - k} at step {k}, got {span!r}")
    if num_branches < 1:
        raise ValueError(f"num_branches: must be >= 1, got {num_branches}")
    shape = tuple(anchor_latents.shape[2:])
    dev = anchor_latents.device
    x_k = anchor_latents[:, k].repeat_interleave(num_branches, 0)  # row i*K + j: branch j of anchor i
    v_k = anchor_velocities[:, k].repeat_interleave(num_branches, 0)
    branch_seeds = (seeds.long().view(b, 1) * 1009 + 31 * k + torch.arange(num_branches).view(1, -1)).flatten()
    noise = seeded_normal(branch_seeds, shape, dev)
    end = k + span
    rows = cond.repeat(num_branches)
    out = sde_step(sampler, x_k, v_k, times[k], times[end], t_guard=times[1], noise=noise,
                   velocity=model_velocity(policy, rows, guidance))
    finals = []
    for g in granularities:
        finals.append(complete(policy, out.next, times[end], completion_grid(times, end - 1, g, jump_last), rows,
                               guidance))
    final = torch.stack(finals, 1).view(b, num_branches, len(finals), *shape)
    std = out.std.view(b, num_branches)[:, 0]
    return Branches(k=k, next=out.next.view(b, num_branches, *shape), log_probs=out.log_prob.view(b, num_branches),
                    final=final, granularities=tuple(int(g) for g in granularities),
                    mean=out.mean.view(b, num_branches, *shape)[:, 0], std=std, span=span)
