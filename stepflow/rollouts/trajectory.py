"""The rollout's own trajectories (docs/method.md §4, §10): B trajectories under the sampler, the x̂0 estimates (or ODE
completions) of the states the credit reads, one reward call, the credit's advantages of the rollout's rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stepflow.core.rollout import Scores, Trajectory, estimate_states, rollout, score
from stepflow.errors import NonFiniteRewardsError, StopRequested
from stepflow.math.advantage import AdvantageOut
from stepflow.rollouts.base import Collected, Context, Credited, RolloutStrategy, TrainBatch, log_once, stop_point

__all__ = ["TrajectoryRollout", "states_needed", "finite_advantages", "retained_steps", "estimate", "post_tail",
           "rollout_and_score_overlapped"]


class TrajectoryRollout(RolloutStrategy):
    """``completion``: the rewards of intermediate states are those of their Euler-ODE completions
    (``advantage.reward_source=completion``), else of their x̂0 estimates by T′ substeps."""

    name = "trajectory"

    def __init__(self, completion: bool = False):
        self.completion = completion

    def context(self, learner, it):
        ctx = super().context(learner, it)
        ctx.tail = post_tail(learner, ctx.grid, ctx.sde)  # MixGRPO-Flash: the DPM++ tail after the window
        ctx.need = states_needed(learner, ctx.trained, it)  # the states whose rewards the credit (and the log) read
        ctx.keep, ctx.budget = retained_steps(learner, ctx.trained)  # loop.retain_graph: the graphs kept
        return ctx

    def collect(self, learner, mine, ctx: Context, phases) -> Collected:
        if learner.loop.overlap_reward:  # the three phases chunk by chunk, each chunk's reward call in a thread
            traj, x0_hat, scores = rollout_and_score_overlapped(learner, mine, ctx, phases, self.completion)
            return Collected(traj, x0_hat, scores, {"overlapped": True})
        with phases("rollout"):  # X_0 .. X_D and log π_old under the sampler (D: the last state needed); no grad
            # but at the kept steps (loop.retain_graph)
            traj = rollout(learner.policy, mine, learner.sampler, learner.loop.num_steps, learner.guidance,
                           depth=max(ctx.need), sde_steps=ctx.sde, grid=ctx.grid, tail=ctx.tail, keep=ctx.keep,
                           keep_budget_gib=ctx.budget)
        stop_point(learner)
        with phases("estimate"):  # x̂0 of the needed states by T′ Euler substeps (none for uniform credit)
            x0_hat = estimate(learner, traj, ctx.need, self.completion)
        return Collected(traj, x0_hat)

    def score(self, learner, col, mine, ctx):
        if col.extra.get("overlapped"):
            return col
        col.scores = score(learner.policy, learner.reward, col.traj, col.x0_hat, learner.loop.decode_chunk,
                           states=ctx.need, finished=self.completion)  # the needed R_k in one call (uniform: R_T)
        return col

    def credit(self, learner, col, rewards, plan, ctx) -> Credited:
        inputs = {k: learner.dist.gather_rows(v) for k, v in learner.advantage.row_inputs(learner, col).items()}
        adv, dropped = finite_advantages(learner, rewards, plan.group_ids, ctx.it, ctx.trained, inputs)
        return Credited(adv, dropped, adv.advantages)

    def training_batch(self, learner, col, cred, mine, ctx) -> TrainBatch:
        w = learner.weighting.weights(learner.sampler, ctx.grid, ctx.trained, cred.out.gains)  # mean 1, or None
        measure = learner.weighting.measures(ctx.it)  # weighting=auto: also the steps of weight 0
        return TrainBatch(col.traj, learner.dist.local_rows(cred.train), col.x0_hat, w, mine.group_ids, measure,
                          seeds=mine.step_noise_seeds,
                          rows={k: learner.dist.local_rows(v) for k, v in cred.out.rows.items()})

    def metrics(self, learner, col, batch, ctx):
        if learner.loop.retain_graph is False:
            return {}
        return _retain_metrics(learner, col.traj, ctx.keep)  # which the update did: kept graphs or recomputed

    def stepwise(self, col):
        return col.x0_hat is not None


def states_needed(learner: Any, trained: list[int], it: int) -> list[int]:
    """The states whose rewards iteration ``it`` computes: those the credit reads for the ``trained`` steps, plus the
    final image every ``loop.final_reward_every`` iterations when the credit does not read it (train/reward_final)."""
    steps = learner.loop.num_steps
    need = sorted({*learner.advantage.states_needed(trained, steps), *learner.objective.states(trained, steps)}) or [steps]
    every = learner.loop.final_reward_every
    if steps not in need and every and it % every == 0:
        need = sorted({*need, steps})
    return need


def finite_advantages(learner: Any, rewards: Tensor, group_ids: Tensor, it: int,
                      trained: list[int] | None = None,
                      inputs: dict[str, Tensor] | None = None) -> tuple[AdvantageOut, Tensor]:
    """Advantages of the rows whose rewards are finite in the columns the scheme reads; a row with a NaN / inf
    reward is dropped from the iteration (advantage 0 at every step, left out of its group's statistics, so the
    update skips it). Returns (advantages of all rows, dropped (B,) bool). More than ``loop.max_nonfinite_frac``
    dropped rows stop the run (:class:`~stepflow.errors.NonFiniteRewardsError`). ``inputs``: the credit's gathered
    :meth:`~stepflow.credits.base.Credit.row_inputs` (their dropped rows left out alike; its per-row outputs are 0 there)."""
    steps = learner.loop.num_steps
    used = rewards[:, learner.advantage.states_needed(trained or [], steps) or [steps]]
    dropped = ~torch.isfinite(used).all(1)
    n = int(dropped.sum())
    if n == 0:
        return learner.advantage(rewards, group_ids, steps, trained, inputs), dropped
    if n > learner.loop.max_nonfinite_frac * len(rewards):
        raise NonFiniteRewardsError(f"{n} of {len(rewards)} samples of iteration {it} have a NaN / inf reward (more "
                                    f"than loop.max_nonfinite_frac={learner.loop.max_nonfinite_frac}); check the reward "
                                    f"({_describe(learner.reward)})")
    keep = ~dropped
    out = learner.advantage(rewards[keep], group_ids[keep], steps, trained,
                            {k: v[keep] for k, v in (inputs or {}).items()})
    full = torch.zeros(len(rewards), steps, dtype=out.advantages.dtype)
    full[keep] = out.advantages
    rows = {}
    for k, v in out.rows.items():
        rows[k] = torch.zeros(len(rewards), *v.shape[1:], dtype=v.dtype)
        rows[k][keep] = v
    return AdvantageOut(full, None, out.stats, rows), dropped


def estimate(learner: Any, traj: Trajectory, need: list[int], completion: bool = False) -> Tensor | None:
    """The x̂0 of the ``need``ed states (None when neither the credit nor the objective reads them); with
    ``completion`` each state's Euler-ODE completion (the true reward of the state under the ODE)."""
    if not learner.advantage.needs_stepwise_rewards and not learner.objective.reads_estimates:
        return None
    if completion:
        from stepflow.core.branch import complete_states

        return complete_states(learner.policy, traj.latents, traj.times, traj.cond, need, learner.guidance)
    return estimate_states(learner.policy, traj, learner.loop.substeps, learner.guidance, learner.loop.adaptive_substeps,
                           learner.loop.estimate_chunk, states=need)


def rollout_and_score_overlapped(learner: Any, plan: Any, ctx: Context, ph: Any, completion: bool = False):
    """Rollout, estimates and decoding of ``loop.overlap_chunks`` chunks of the rows in turn, each chunk's reward
    call submitted to a thread as soon as its images exist; the "reward" phase is what is left to wait for at the
    end. Same trajectories, rewards and NFEs as the sequential phases (rows are seeded one by one). Returns
    (None, None, None) when a stop interrupted the reward calls (the caller's stop point stops every rank)."""
    from concurrent.futures import ThreadPoolExecutor

    n = len(plan)
    size = -(-n // learner.loop.overlap_chunks)
    parts, ests, futures = [], [], []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward") as pool:
        for s in range(0, n, size):
            sub = plan.rows(slice(s, s + size))
            with ph("rollout"):
                part = rollout(learner.policy, sub, learner.sampler, learner.loop.num_steps, learner.guidance,
                               depth=max(ctx.need), sde_steps=ctx.sde, grid=ctx.grid, tail=ctx.tail, keep=ctx.keep,
                               keep_budget_gib=None if ctx.budget is None else ctx.budget * len(sub) / n)
            with ph("estimate"):
                est = estimate(learner, part, ctx.need, completion)
                futures.append(score(learner.policy, learner.reward, part, est, learner.loop.decode_chunk,
                                     states=ctx.need, executor=pool, finished=completion))
            parts.append(part)
            ests.append(est)
        with ph("reward"):
            try:
                done = [f.result() for f in futures]
            except StopRequested:
                return None, None, None
    traj = Trajectory.cat(parts)
    x0_hat = None if ests[0] is None else torch.cat(ests)
    comps = {k: torch.cat([d.components[k] for d in done]) for k in done[0].components}
    return traj, x0_hat, Scores(torch.cat([d.rewards for d in done]), comps, images=sum(d.images for d in done))


def post_tail(learner: Any, grid: Tensor, sde: list[int] | None) -> Tensor | None:
    """The window's post-window tail grid for this iteration (MixGRPO-Flash: DPM-Solver++(2M) on a compressed grid;
    ``Window.tail``), with the grid's own shift (``loop.time_grid=fastvideo``: ``loop.grid_shift``, null = the
    policy's; ``model``: the policy's scheduler shift). None: the grid's Euler steps."""
    if learner.window is None:
        return None
    shift = getattr(learner.loop, "grid_shift", None)
    if getattr(learner.loop, "time_grid", "model") != "fastvideo" or shift is None:
        shift = float(learner.policy.shift)
    return learner.window.tail(grid, sde, shift)


def retained_steps(learner: Any, trained: list[int]) -> tuple[list[int] | None, float | None]:
    """``loop.retain_graph`` (:mod:`stepflow.core.retain`): the trained steps whose graphs the rollout keeps (None: the
    update recomputes) and the GiB budget of ``auto`` (None: no budget). ``true`` where it cannot apply raises the
    one-line reason (``stepflow.train.settings`` refuses such settings before anything loads); ``auto`` falls back
    to recomputation, logging why once."""
    from stepflow.core import retain

    m = retain.mode(learner.loop.retain_graph)
    if m == "off" or not trained:
        return None, None
    why = retain.why_not_at_runtime(learner)
    if why is not None:
        if m == "on":
            raise ValueError(f"loop.retain_graph=true: {why}; set loop.retain_graph=false (or auto)")
        log_once(learner, f"loop.retain_graph=auto: the update recomputes: {why}")
        return None, None
    if learner.policy.device.type == "cpu":
        if learner.loop.retain_keep_memory and retain.keep_freed_memory():
            log_once(learner, "loop.retain_graph: freed host memory stays in the process for the next rollout "
                              "(glibc mallopt; loop.retain_keep_memory=false returns it to the OS)")
        if hint := retain.allocator_hint():
            log_once(learner, hint)
    return list(trained), (float(learner.loop.retain_max_gib) if m == "auto" else None)


def _retain_metrics(learner: Any, traj: Trajectory, keep: list[int] | None) -> dict[str, float]:
    """Which the update did: ``train/retained`` 1 = from the kept graphs, 0 = recomputed (and the kept GiB)."""
    if keep is not None and traj.kept is None and traj.kept_refused:
        log_once(learner, f"loop.retain_graph=auto: the update recomputes: {traj.kept_refused}")
    out = {"train/retained": float(learner.dist.all_sum(1.0 if traj.kept is not None else 0.0) == learner.dist.world)}
    if traj.kept is not None:
        out["mem/retained_gib"] = float(traj.kept_gib)
    return out


def _describe(reward) -> str:
    """The reward in a message (:meth:`stepflow.rewards.base.Reward.describe`; a plain callable: its type)."""
    describe = getattr(reward, "describe", None)
    return describe() if callable(describe) else f"reward {type(reward).__name__}"
