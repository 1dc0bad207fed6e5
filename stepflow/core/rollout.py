"""The no-grad half of a GRPO iteration: rollout, x̂0 estimates, stepwise rewards (docs/method.md §4, §10).

Data flows one way: :func:`rollout` returns a frozen :class:`Trajectory` (the only object that crosses from the
rollout to the update); :func:`estimate_states` and :func:`score` read it and return their own results
(:class:`Scores`). Nothing writes back into the trajectory.

Index convention (docs/method.md §1): array index ``k = 0..T`` with ``X_0`` the initial noise (the paper's ``x_T``)
and ``X_T`` the final latent (the paper's ``x_0``); step ``k`` maps ``X_k → X_{k+1}`` (the paper's ``t = T − k``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from stepflow.core.data import IterationPlan, seeded_normal
from stepflow.math.estimate import estimate_x0_with_nfe
from stepflow.math.sde import TIME_GRIDS, fastvideo_time_grid
from stepflow.math.solvers import flash_tail, x0_from_v
from stepflow.policies.base import Cond, FlowPolicy, check_time_grid, encode_rows
from stepflow.rewards.base import Reward
from stepflow.samplers.base import Sampler
from stepflow.samplers.ode import Ode

__all__ = ["Trajectory", "Scores", "sampling_grid", "rollout", "estimate_states", "score", "model_velocity"]

_ODE = Ode()  #: the step outside the SDE window


@dataclass(frozen=True)
class Trajectory:
    """A batch of B trajectories of T steps, as sampled under π_old.

    latents: (B, D+1, C, H, W) states X_0 (the initial noise) .. X_D, fp32; D = T (the final latent) unless the
        rollout stopped early at depth D because the credit needs no later state
    velocities: (B, D, C, H, W) the rollout's v at (X_k, τ_k) (reused by substep 0 of the x̂0 estimate)
    log_probs: (B, D) log π_old(X_{k+1} | X_k) under the sampler's convention (0 where untrainable)
    trainable: (B, D) bool, the step's noise std > 0
    times: (T+1,) the whole grid τ_0 = 1 .. τ_T = 0
    cond: B rows of prompt conditioning; prompts / meta: B prompt strings and records
    tail_start, tail_times: MixGRPO-Flash (``rollout(tail=)``; else None): the rollout left the grid after state
        ``s = tail_start`` (the state after the window, at ``times[s] = tail_times[0]``) and ran the DPM-Solver++(2M)
        tail over ``tail_times`` to the final latent ``X_T`` (at ``tail_times[-1]``: 0, or ``times[s]`` itself when
        the tail has no step). States ``s+1 .. T−1`` do not exist (:attr:`absent_states`; NaN, log-prob 0,
        untrainable), nor the velocities of :attr:`absent_velocities`; :func:`estimate_states` and :func:`score`
        refuse them.
    """

    latents: Tensor
    velocities: Tensor
    log_probs: Tensor
    trainable: Tensor
    times: Tensor
    cond: Cond
    prompts: list[str]
    meta: list[dict[str, Any]]
    tail_start: int | None = None
    tail_times: Tensor | None = None
    #: ``loop.retain_graph`` (:mod:`stepflow.core.retain`): step k -> the rollout's velocity at (X_k, τ_k) (B, C, H, W)
    #: with its autograd graph, for the on-policy update to back-propagate through; None: the update recomputes
    kept: dict[int, Tensor] | None = None
    kept_gib: float = 0.0  #: the activations those graphs hold (GiB, measured by :class:`stepflow.core.retain.SavedBytes`)
    kept_refused: str | None = None  #: why a retained rollout fell back to recomputation (``retain_graph=auto``)
    #: (T,) long, the grid intervals each step spans (None: 1 each). A step k with span m > 1 is one transition from
    #: ``X_k`` at ``τ_k`` to ``X_{k+m}`` at ``τ_{k+m}`` (a merged step, E-GRPO's branches: one SDE step across m grid
    #: intervals); the states between are not that transition's. Every reader of a step's transition takes its end
    #: from :meth:`step_end` (the GRPO objective's ``x_next`` and ``t_next``), never ``k + 1``.
    spans: Tensor | None = None

    def step_end(self, k: int) -> int:
        """The state index where step ``k``'s transition lands: ``k + spans[k]`` (``k + 1`` without spans)."""
        return k + 1 if self.spans is None else k + int(self.spans[k])

    @property
    def absent_states(self) -> list[int]:
        """The states the rollout did not produce (MixGRPO-Flash: ``tail_start + 1 .. T − 1``; else none)."""
        if self.tail_start is None:
            return []
        return list(range(self.tail_start + 1, self.num_steps))

    @property
    def absent_velocities(self) -> list[int]:
        """The steps whose velocity ``velocities[:, k]`` was not evaluated (NaN): the absent states', and the tail
        start's when the tail has no step (the released ``num_post = 1`` corner, which evaluates nothing there)."""
        if self.tail_start is None:
            return []
        first = self.tail_start + (1 if self.tail_times is not None and len(self.tail_times) > 1 else 0)
        return list(range(first, self.num_steps))

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        """T, the grid's number of steps."""
        return self.times.shape[0] - 1

    @property
    def depth(self) -> int:
        """D, the number of steps rolled out (T unless stopped early)."""
        return self.latents.shape[1] - 1

    @staticmethod
    def cat(parts: Sequence[Trajectory]) -> Trajectory:
        """Trajectories of the same grid, depth and tail, concatenated along the batch."""
        first = parts[0]
        for p in parts[1:]:
            if (p.spans is None) != (first.spans is None) or (p.spans is not None and not torch.equal(p.spans, first.spans)):
                raise ValueError("Trajectory.cat: the parts' steps span different grid intervals")
            if p.tail_start != first.tail_start or (p.tail_times is None) != (first.tail_times is None) or (
                    p.tail_times is not None and not torch.equal(p.tail_times, first.tail_times)):
                raise ValueError("Trajectory.cat: the parts ran different MixGRPO-Flash tails")
        kept = None  # every part kept the same steps, or none is kept (the graphs of the others are let go)
        if all(p.kept is not None for p in parts) and len({tuple(sorted(p.kept)) for p in parts}) == 1:
            kept = {k: torch.cat([p.kept[k] for p in parts]) for k in first.kept}
        refused = next((p.kept_refused for p in parts if p.kept_refused), None)
        return Trajectory(latents=torch.cat([p.latents for p in parts]), velocities=torch.cat([p.velocities for p in parts]),
                          log_probs=torch.cat([p.log_probs for p in parts]), trainable=torch.cat([p.trainable for p in parts]),
                          times=first.times, cond=Cond.cat([p.cond for p in parts]),
                          prompts=[x for p in parts for x in p.prompts], meta=[x for p in parts for x in p.meta],
                          tail_start=first.tail_start, tail_times=first.tail_times, kept=kept,
                          kept_gib=sum(p.kept_gib for p in parts) if kept is not None else 0.0, kept_refused=refused,
                          spans=first.spans)


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


def sampling_grid(policy: FlowPolicy, num_steps: int, kind: str = "model", shift: float | None = None) -> Tensor:
    """The T-step σ grid (T+1,) of ``loop.time_grid``: ``model`` = ``policy.time_grid(num_steps)`` (the scheduler's);
    ``fastvideo`` = :func:`stepflow.math.sde.fastvideo_time_grid` with ``shift`` (None: ``policy.shift``), DanceGRPO's.
    Both run from exactly 1 to exactly 0 (checked), so the steps without noise are the same on either grid."""
    if kind == "model":
        return policy.time_grid(num_steps)
    if kind != "fastvideo":
        raise ValueError(f"time_grid: must be one of {', '.join(TIME_GRIDS)}, got {kind!r}")
    return check_time_grid(fastvideo_time_grid(num_steps, float(policy.shift if shift is None else shift)),
                           "loop.time_grid=fastvideo")


def model_velocity(policy: FlowPolicy, cond: Cond, guidance: float):
    """The model as a sampler's ``velocity(z, t, guided=True) -> v`` (:attr:`stepflow.samplers.base.Sampler.nfe_per_step`):
    the policy's velocity for the rows of ``cond``, under the run's CFG scale ``guidance`` (or none: ``guided`` False),
    with the weights and the autograd mode in force where the step calls it."""

    def velocity(z: Tensor, t, guided: bool = True) -> Tensor:
        return policy.velocity(z, t, cond, guidance if guided else 1.0)

    return velocity


def _check_tail(tail: Tensor | None, sde_steps: list[int] | None, depth: int | None, num_steps: int,
                times: Tensor) -> tuple[int | None, Tensor | None]:
    """``(last, tail)`` of a MixGRPO-Flash rollout (``last`` the window's last step, ``tail`` on the grid's device),
    checked against the window, the depth and the grid; ``(None, None)`` without a tail."""
    if tail is None:
        return None, None
    if not sde_steps:
        raise ValueError("tail: MixGRPO-Flash's tail follows the SDE window, but sde_steps is "
                         f"{sde_steps!r}; roll an empty window out without a tail (all Euler)")
    if depth not in (None, num_steps):
        raise ValueError(f"tail: a Flash rollout has no states between the window and the end; depth must be the "
                         f"whole grid ({num_steps}), got {depth}")
    last = max(sde_steps)
    tail = tail.to(times.device)
    if tail.ndim != 1 or len(tail) < 1 or float(tail[0]) != float(times[last + 1]):
        raise ValueError(f"tail: must be a (n,) grid starting at grid[{last + 1}] = {float(times[last + 1])} (the "
                         f"state after the window's last step {last}; stepflow.math.solvers.flash_grid(...)[last + 1:]), "
                         f"got {tail.tolist()}")
    return last, tail


class _Keeper:
    """``loop.retain_graph``: evaluates the velocity of the steps ``keep`` with gradients and keeps it with its graph
    (``kept``); the activations are measured on the first kept step and projected to all of ``keep``; over
    ``budget_gib`` the graphs are let go (``kept`` None, ``refused`` says why)."""

    def __init__(self, policy: FlowPolicy, keep: Sequence[int] | None, budget_gib: float | None):
        self.keep = sorted({int(k) for k in keep}) if keep else []
        self.kept: dict[int, Tensor] | None = {} if keep else None
        self.step_bytes, self.refused, self.budget_gib = 0, None, budget_gib
        self.weights = list(policy.parameters()) if keep and isinstance(policy, torch.nn.Module) else []

    def wants(self, k: int) -> bool:
        return self.kept is not None and k in self.keep

    def velocity(self, policy: FlowPolicy, k: int, x: Tensor, t: Tensor, cond: Cond, guidance: float) -> Tensor:
        """The velocity of kept step ``k`` (detached; its graph goes to ``kept[k]``)."""
        from stepflow.core.retain import SavedBytes

        # the activations are measured on the first kept step only: every kept step is the same forward at the
        # same batch, and the measuring hook (a Python call per saved tensor) cost the rollout 0.1-0.3 s of 2
        # on the every-step recipe
        first = not self.kept
        with torch.enable_grad(), (SavedBytes(self.weights) if first else contextlib.nullcontext()) as saved:
            v_graph = policy.velocity(x, t, cond, guidance)
        self.kept[k] = v_graph
        if first:
            self.step_bytes = saved.bytes
            projected = self.step_bytes * len(self.keep) / 2**30
            if self.budget_gib is not None and projected > self.budget_gib:
                self.refused = (f"the kept activations would take {projected:.2f} GiB (measured on the first of "
                                f"{len(self.keep)} kept steps) > loop.retain_max_gib={self.budget_gib:g}")
                self.kept = None
        return v_graph.detach()


def _complete_tail(policy: FlowPolicy, x: Tensor, tail: Tensor, cond: Cond, guidance: float, x0_prev: Tensor,
                   t_last: Tensor, num_steps: int, last: int, lat: list, vel: list, lps: list, trn: list) -> None:
    """MixGRPO-Flash: ``X_{last+1} -> X_T`` by the DPM++ tail, appended to the rollout's lists; the states
    ``last+2 .. T-1`` (off the compressed grid, never computed) are NaN, log-prob 0, untrainable."""
    final, _, tail_v = flash_tail(x, tail, lambda z, t: policy.velocity(z, t, cond, guidance), x0_prev, t_last)
    b = x.shape[0]
    gap = num_steps - last - 2
    nan = torch.full_like(x, float("nan"))
    lat.extend([nan] * gap + [final.to(x.dtype)])
    vel.extend([tail_v[0] if tail_v else nan] + [nan] * gap)
    zero = torch.zeros(b, device=x.device, dtype=lps[-1].dtype)
    lps.extend([zero] * (gap + 1))
    trn.extend([torch.zeros(b, dtype=torch.bool, device=x.device)] * (gap + 1))


@torch.no_grad()
def rollout(policy: FlowPolicy, plan: IterationPlan, sampler: Sampler, num_steps: int,
            guidance: float, depth: int | None = None, sde_steps: list[int] | None = None,
            grid: Tensor | None = None, tail: Tensor | None = None, keep: Sequence[int] | None = None,
            keep_budget_gib: float | None = None) -> Trajectory:
    """Encode the plan's prompts and sample its B trajectories with ``sampler`` under the current weights (π_old),
    for ``depth`` steps of the T-step grid (default all T): ``grid`` (T+1,) (default ``policy.time_grid(num_steps)``;
    :func:`sampling_grid`), stored as ``Trajectory.times``, which is what the update steps on.

    Noise is row-seeded (``plan.init_noise_seeds`` for X_0, ``plan.step_noise_seeds`` for the SDE noise ε of every
    step), so a sample does not depend on the batch it is in (one process vs DDP, resume), nor on the depth.
    ``sde_steps``: the steps that follow ``sampler`` (an SDE window); the others take the deterministic Euler step
    (no density, untrainable). None: every step. Step k is ``sampler.rollout_step`` (k, grid).

    A ``sampler.multistep`` sampler (dpm2, DiffusionNFT's deterministic DPM-Solver++(2M), :mod:`stepflow.math.solvers`):
    the loop keeps the x̂0 = X_k − τ_k·v of every state it passes for its next step (dpm2 takes :func:`dpm_order`
    (k, T) of the T-step grid: first order at k = 0 and k = T − 1, second order with the previous state's x̂0
    elsewhere; log-probs 0, nothing trainable). With ``sde_steps`` the steps outside it take the Euler step, and a
    dpm2 step inside it still uses the x̂0 of the state before it (whichever step made that state) and the order of
    its grid index.

    ``tail`` (MixGRPO-Flash; :meth:`stepflow.windows.base.Window.tail`): the compressed grid after the window, from
    ``tail[0] = grid[last + 1]`` (``last = max(sde_steps)``) down to its end. The loop stops after step ``last`` and
    :func:`stepflow.math.solvers.flash_tail` runs DPM-Solver++(2M) from ``X_{last+1}`` over ``tail``, its first step
    second order with the x̂0 of ``X_last`` (released sampling_utils.py L112-144); its result is stored as ``X_T``.
    States ``last + 2 .. T − 1`` do not exist: NaN, with NaN velocities, log-prob 0, untrainable
    (``Trajectory.absent_states``); the velocity of ``X_{last+1}`` is the tail's first evaluation. Needs a non-empty
    ``sde_steps`` and the whole depth. NFEs: ``last + 1`` grid steps + ``len(tail) − 1`` tail steps.

    ``keep`` (``loop.retain_graph``, :mod:`stepflow.core.retain`): the steps whose velocity is evaluated with gradients
    and kept with its graph in ``Trajectory.kept`` (the trajectory itself is built from the detached values, so it is
    the same as without). The activations are measured (:class:`stepflow.core.retain.SavedBytes`) on the first kept step
    and counted the same for the others. ``keep_budget_gib``: when they, projected from the first kept step to all of
    ``keep``, exceed it, the graphs are let go and the rollout goes on without (``Trajectory.kept`` None,
    ``kept_refused`` says why).
    """
    device = policy.device
    b = len(plan)
    cond = encode_rows(policy, plan.prompts, plan.meta)
    shape = tuple(policy.latent_shape)
    times = (policy.time_grid(num_steps) if grid is None else grid).to(device)
    if times.shape != (num_steps + 1,):
        raise ValueError(f"grid: expected shape ({num_steps + 1},) for {num_steps} steps, got {tuple(times.shape)}")
    last, tail = _check_tail(tail, sde_steps, depth, num_steps, times)
    x = seeded_normal(plan.init_noise_seeds, shape, device)
    eps = seeded_normal(plan.step_noise_seeds, (num_steps, *shape), device)  # (B, T, C, H, W)
    lat, vel, lps, trn = [x], [], [], []
    x0_prev = None  # a multistep sampler's (and the Flash tail's): the x̂0 of the previous state
    keeper = _Keeper(policy, keep, keep_budget_gib)
    for k in range(num_steps if depth is None else depth):
        if keeper.wants(k):
            v = keeper.velocity(policy, k, x, times[k], cond, guidance)
        else:
            v = policy.velocity(x, times[k], cond, guidance)
        cfg = sampler if sde_steps is None or k in sde_steps else _ODE
        extra = {"velocity": model_velocity(policy, cond, guidance)} if cfg.nfe_per_step > 1 else {}
        out = cfg.rollout_step(x, v, k, times, noise=eps[:, k], x0_prev=x0_prev, **extra)
        if sampler.multistep or k == last:
            x0_prev = x0_from_v(x, v, times[k])
        x = out.next
        lat.append(x); vel.append(v); lps.append(out.log_prob)
        trn.append(out.trainable.expand(b) if out.trainable.ndim == 0 else out.trainable)
        if k == last:
            break
    if last is not None and last + 1 < num_steps:  # MixGRPO-Flash: X_{last+1} -> X_T by the DPM++ tail
        _complete_tail(policy, x, tail, cond, guidance, x0_prev, times[last], num_steps, last, lat, vel, lps, trn)
    kept = keeper.kept
    return Trajectory(latents=torch.stack(lat, 1), velocities=torch.stack(vel, 1), log_probs=torch.stack(lps, 1),
                      trainable=torch.stack(trn, 1), times=times, cond=cond, prompts=list(plan.prompts),
                      meta=list(plan.meta), tail_start=None if last is None else last + 1,
                      tail_times=tail, kept=kept, kept_gib=keeper.step_bytes * len(kept) / 2**30 if kept else 0.0,
                      kept_refused=keeper.refused)


@torch.no_grad()
def estimate_states(policy: FlowPolicy, traj: Trajectory, substeps: int, guidance: float, adaptive: bool = False,
                    chunk_size: int | None = None, states: list[int] | None = None) -> Tensor:
    """x̂0 of the states ``states`` (default every state X_0..X_{T-1}) of every trajectory (docs/method.md §4),
    batched over steps.

    Returns x0_hat (B, T+1, C, H, W): the estimates at the chosen states, ``x0_hat[:, T] = X_T`` when the rollout
    reached it, zeros elsewhere. ``chunk_size`` bounds the states per model call (memory); the substep grid is per
    state, so chunking does not change the result.
    """
    b, t_steps = traj.batch_size, traj.num_steps
    ks = [k for k in (range(t_steps) if states is None else states) if k < t_steps]
    if ks and max(ks) > traj.depth:
        raise ValueError(f"states: the rollout stopped at state {traj.depth}; cannot estimate state {max(ks)}")
    off = sorted(set(ks) & {*traj.absent_states, *traj.absent_velocities})
    if off:
        raise ValueError(f"states: the MixGRPO-Flash rollout (window.post_solver=dpmpp2m) left the grid after state "
                         f"{traj.tail_start}, so states {off} (or their velocities) do not exist; use "
                         "advantage=uniform (which reads only the final image)")
    n = len(ks)
    states_ = traj.latents[:, ks].flatten(0, 1)  # (B*n, C, H, W), row i*n + j -> state ks[j] of trajectory i
    times = traj.times[ks].repeat(b)  # (B*n,)
    vel = traj.velocities
    if ks and max(ks) == traj.depth:  # the rollout stopped at this state: its velocity (substep 0) is new
        v_last = policy.velocity(traj.latents[:, -1], traj.times[traj.depth], traj.cond, guidance)
        vel = torch.cat([vel, v_last[:, None]], 1)
    v0 = vel[:, ks].flatten(0, 1)
    cond_rows = traj.cond.repeat(n)  # row i*n + j -> cond i
    m = states_.shape[0]
    chunk = chunk_size or max(m, 1)
    outs = []
    for s in range(0, m, chunk):
        sl = slice(s, s + chunk)
        c = cond_rows.index(sl)

        def vfn(x: Tensor, t: Tensor, rows: Tensor, c=c) -> Tensor:  # compact mode: only unfinished rows
            return policy.velocity(x, t, c.index(rows.to("cpu") if c.tokens.device.type == "cpu" else rows), guidance)

        outs.append(estimate_x0_with_nfe(vfn, states_[sl], times[sl], substeps, v0=v0[sl], adaptive=adaptive,
                                         compact=True)[0])
    x0_hat = traj.latents.new_zeros((b, t_steps + 1, *traj.latents.shape[2:]))
    if ks:
        x0_hat[:, ks] = torch.cat(outs).view(b, n, *states_.shape[1:])
    if traj.depth == t_steps:
        x0_hat[:, t_steps] = traj.latents[:, -1]
    return x0_hat


def _decode(policy: FlowPolicy, latents: Tensor, chunk: int | None, estimate: bool = False) -> Tensor:
    n = latents.shape[0]
    chunk = chunk or n
    if not estimate:
        return torch.cat([policy.decode(latents[s:s + chunk]) for s in range(0, n, chunk)])
    return torch.cat([policy.decode(latents[s:s + chunk], estimate=True) for s in range(0, n, chunk)])


def _repeat(items: Sequence, n: int) -> list:
    return [x for x in items for _ in range(n)]


@torch.no_grad()
def score(policy: FlowPolicy, reward: Reward, traj: Trajectory, x0_hat: Tensor | None = None,
          decode_chunk: int | None = None, states: list[int] | None = None, executor=None, finished: bool = False):
    """Decode and score in one reward call: R_k of the states ``states`` (default 0..T) from the estimates
    ``x0_hat`` (B, T+1, ...) when given (B·len(states) images), else only R_T of the final latents (B images; what
    uniform credit reads). Rewards not computed are NaN; components are those of R_T (NaN when it was not scored).

    ``executor`` (a ``concurrent.futures`` executor): the images are decoded here and the reward call runs there;
    returns a future of the :class:`Scores` (the caller goes on, e.g. rolling out the next chunk). ``finished``: the
    latents of ``x0_hat`` are finished images (ODE completions), decoded by the full VAE even where the policy has an
    estimate decoder for x̂0 estimates."""
    b, tp1 = traj.batch_size, traj.num_steps + 1
    off = sorted(set(range(tp1) if states is None else states) & set(traj.absent_states)) if x0_hat is not None else []
    if off:
        raise ValueError(f"states: the MixGRPO-Flash rollout (window.post_solver=dpmpp2m) has no states {off} to score; "
                         "use advantage=uniform (which reads only the final image)")
    if x0_hat is None:
        images, ks, prompts, meta = _decode(policy, traj.latents[:, -1], decode_chunk), [tp1 - 1], traj.prompts, traj.meta
    else:
        ks = list(range(tp1)) if states is None else sorted(states)
        images = _decode_states(policy, x0_hat, ks, decode_chunk, finished)
        prompts, meta = _repeat(traj.prompts, len(ks)), _repeat(traj.meta, len(ks))
    if executor is not None:
        return executor.submit(_scores, reward, images, prompts, meta, b, tp1, ks)
    return _scores(reward, images, prompts, meta, b, tp1, ks)


def _scores(reward: Reward, images: Tensor, prompts: list, meta: list, b: int, tp1: int, ks: list[int]) -> Scores:
    """One reward call over the decoded images of states ``ks`` (row i·len(ks) + j = state ks[j] of sample i)."""
    out = reward(images, prompts, meta)
    n = len(ks)
    rewards = torch.full((b, tp1), float("nan"))
    rewards[:, ks] = out.scores.view(b, n).float()
    final = ks.index(tp1 - 1) if ks[-1] == tp1 - 1 else None
    comps = {k: (v.view(b, n)[:, final] if final is not None else torch.full((b,), float("nan")))
             for k, v in out.components.items()}
    return Scores(rewards, comps, images=b * n)


def _decode_states(policy: FlowPolicy, x0_hat: Tensor, ks: list[int], decode_chunk: int | None,
                   finished: bool = False) -> Tensor:
    """Images of the states ``ks`` of every sample (B·len(ks), 3, H, W): the estimates of intermediate states through
    the policy's estimate decoder when it has one (unless ``finished``), the final image through the full VAE."""
    b, tp1 = x0_hat.shape[:2]
    if finished or getattr(policy, "estimate_vae", None) is None:
        return _decode(policy, x0_hat[:, ks].flatten(0, 1), decode_chunk)
    inter = [k for k in ks if k < tp1 - 1]
    parts = []
    if inter:
        est = _decode(policy, x0_hat[:, inter].flatten(0, 1), decode_chunk, estimate=True)
        parts.append(est.view(b, len(inter), *est.shape[1:]))
    if len(inter) < len(ks):
        parts.append(_decode(policy, x0_hat[:, -1], decode_chunk)[:, None])
    return torch.cat(parts, 1).flatten(0, 1)
