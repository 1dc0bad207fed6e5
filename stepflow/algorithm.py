"""One iteration of Stepwise-Flow-GRPO / Flow-GRPO, free of Lightning (docs/method.md §10).

:func:`iteration` is the paper's algorithm on one screen: plan → rollout → x̂0 estimates → stepwise rewards →
advantages → policy update. Each phase is a function of its own (``stepflow.rollout``, ``stepflow.advantage``,
:func:`update`, :func:`step_loss`), timed by :class:`Phases`, which also reads the NFEs off the policy's counter.
``stepflow.grpo.GRPOModule`` is the Lightning shell around it; ``experiments/gpu_check.py`` and
:func:`step_gradients` (the per-step gradients ``experiments/grad_coherence.py`` measures with ``stepflow.coherence``)
call the same functions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from stepflow import stop
from stepflow.advantage import AdvantageEstimator, AdvantageOut
from stepflow.config import LoopConfig, TrainConfig
from stepflow.core.update import step_gradients, step_loss, steps_per_sample, subset_steps, update
from stepflow.data import IterationPlan, PromptPlanner
from stepflow.dist import Dist
from stepflow.errors import NonFiniteRewardsError, StopRequested
from stepflow.objectives import Grpo, Objective
from stepflow.objectives.base import trainable_steps
from stepflow.policies.base import FlowPolicy
from stepflow.rewards.base import Reward
from stepflow.rollout import Scores, Trajectory, estimate_states, rollout, score
from stepflow.sde import SamplerConfig
from stepflow.weighting import Weighting

__all__ = ["Learner", "Phases", "IterationResult", "iteration", "update", "step_loss", "step_gradients",
           "trainable_steps", "branch_iteration", "finite_advantages", "iteration_metrics", "subset_steps", "steps_per_sample"]


@dataclass
class Learner:
    """Everything an iteration reads: the policy and its optimizer, the reward, the sampler, the advantage
    estimator, the prompt plan, the loop/train settings, the objective and the step weighting, and the collectives.
    ``backward`` runs a loss's backward pass (Lightning's ``manual_backward`` under a Trainer);
    ``on_optimizer_step(n)`` is called after optimizer step n (the EMA)."""

    policy: FlowPolicy
    reward: Reward
    sampler: SamplerConfig
    advantage: AdvantageEstimator
    plan: PromptPlanner
    loop: LoopConfig
    train: TrainConfig
    optimizer: Any
    guidance: float = 1.0
    dist: Dist = field(default_factory=Dist)
    backward: Callable[[Tensor], None] = Tensor.backward
    on_optimizer_step: Callable[[int], None] | None = None
    opt_steps: int = 0
    window: Any = None  #: a stepflow.window.WindowConfig, or None (every step follows the sampler)
    objective: Objective | None = None  #: what the update minimises (None: GRPO with ``train``'s settings)
    weighting: Weighting = field(default_factory=Weighting)  #: how the trained steps' terms are combined
    logged: set = field(default_factory=set, repr=False)  #: the one-time messages already logged

    def __post_init__(self) -> None:
        if self.objective is None:
            from stepflow.config import ObjectiveConfig

            self.objective = Grpo(ObjectiveConfig(), self.train)

    @property
    def signal(self):
        """The online per-step signal estimate of ``train.weighting=auto`` (else None)."""
        return self.weighting.signal

    def grid(self) -> Tensor:
        """The rollout's σ grid (T+1,) under ``loop.time_grid`` / ``loop.grid_shift`` (:func:`stepflow.rollout.sampling_grid`)."""
        from stepflow.rollout import sampling_grid

        return sampling_grid(self.policy, self.loop.num_steps, getattr(self.loop, "time_grid", "model"),
                             getattr(self.loop, "grid_shift", None))

    def window_steps(self, it: int) -> list[int] | None:
        """The SDE steps of iteration ``it`` (None = all)."""
        if self.window is None:
            return None
        from stepflow.window import window_steps

        return window_steps(self.window, it, self.loop.num_steps, self.loop.seed)


class Phases:
    """Seconds and policy NFEs (sample-level transformer evaluations, CFG counted twice) per phase, and the peak
    memory of each phase (GiB): ``with phases("rollout"): ...``. On CUDA the peak allocated by PyTorch
    (:attr:`peak_gib`; CUDA is synchronised at both ends, so a phase's seconds are its own); on Linux the process's
    peak resident set (:attr:`peak_rss_gib`, :func:`_reset_peak_rss` / :func:`_peak_rss_gib`): everything the process
    holds in RAM, the model and the allocator's kept free memory included."""

    def __init__(self, policy: FlowPolicy):
        self.policy = policy
        self.seconds: dict[str, float] = {}
        self.nfe: dict[str, int] = {}
        self.nfe_grad: dict[str, int] = {}
        self.peak_gib: dict[str, float] = {}
        self.page_faults: dict[str, int] = {}  #: minor page faults of the process (fresh memory faulted in)
        self.peak_rss_gib: dict[str, float] = {}  #: the process's peak resident set in the phase (Linux)

    @contextlib.contextmanager
    def __call__(self, name: str):
        cuda = self.policy.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.policy.device)
            torch.cuda.reset_peak_memory_stats(self.policy.device)
        rss = _reset_peak_rss()
        n0, g0, f0, t0 = self.policy.nfe, self.policy.nfe_grad, _minor_faults(), time.perf_counter()
        try:
            yield
        finally:
            self.page_faults[name] = self.page_faults.get(name, 0) + _minor_faults() - f0
            if rss:
                self.peak_rss_gib[name] = max(self.peak_rss_gib.get(name, 0.0), _peak_rss_gib())
            if cuda:
                torch.cuda.synchronize(self.policy.device)
                peak = torch.cuda.max_memory_allocated(self.policy.device) / 2**30
                self.peak_gib[name] = max(self.peak_gib.get(name, 0.0), peak)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.nfe[name] = self.nfe.get(name, 0) + self.policy.nfe - n0
            self.nfe_grad[name] = self.nfe_grad.get(name, 0) + self.policy.nfe_grad - g0


_PROC = "/proc/self"


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set (Linux: ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM``; it touches
    nothing else, page flags included). False where that file is missing or not writable."""
    try:
        with open(f"{_PROC}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_rss_gib() -> float:
    """The process's peak resident set since the last :func:`_reset_peak_rss` (``VmHWM`` of /proc/self/status), GiB."""
    with open(f"{_PROC}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    return 0.0


def _minor_faults() -> int:
    """The process's minor page faults so far (0 where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


@dataclass(frozen=True)
class IterationResult:
    plan: IterationPlan  #: the global plan (every rank's rows)
    scores: Scores  #: this rank's rewards
    rewards: Tensor  #: (B_global, T+1) rewards of all ranks
    advantages: AdvantageOut  #: of all rows
    update: dict[str, float]  #: the update's diagnostics
    phases: Phases
    stepwise: bool  #: rewards were computed at every state (else only R_T)
    finite: Tensor  #: (B_global,) bool, the rows whose rewards were used (the others were dropped)


def iteration(learner: Learner, it: int) -> IterationResult:
    """GRPO iteration ``it`` (docs/method.md §10). A stop request (SIGTERM / SIGINT) abandons it at the next phase
    boundary before the update (``StopRequested``); once the update has begun, the iteration finishes. The branch
    credits (``advantage=tempflow | g2rpo``) run :func:`branch_iteration` instead."""
    if learner.advantage.branched:
        return branch_iteration(learner, it)
    plan = learner.plan.plan(it)  # the same global plan on every rank; each rolls out its own rows
    mine = plan.shard(learner.dist.rank, learner.dist.world)
    steps, ph = learner.loop.num_steps, Phases(learner.policy)
    grid = learner.grid()  # loop.time_grid: the policy's own, or FastVideo's (DanceGRPO)
    sde = learner.window_steps(it)  # the SDE window (None: every step); the others follow the ODE
    tail = _post_tail(learner, grid, sde)  # MixGRPO-Flash: the DPM++ tail after the window (None: Euler)
    obj = learner.objective
    trained = obj.trained_steps(learner.train, learner.sampler, grid, sde)  # steps (forward objectives: times)
    need = states_needed(learner, trained, it)  # the states whose rewards the credit (and the log) read
    keep, budget = retained_steps(learner, trained)  # loop.retain_graph: the steps whose graphs the rollout keeps
    learner.policy.eval()
    _stop_point(learner)
    if learner.loop.overlap_reward:  # the same three phases, chunk by chunk, each chunk's reward call in a thread
        with obj.behaviour():
            traj, x0_hat, scores = _rollout_and_score_overlapped(learner, mine, need, sde, ph, grid, tail, keep, budget)
    else:
        with obj.behaviour():  # the behaviour policy's weights (DiffusionNFT: the old copy; else the current ones)
            with ph("rollout"):  # X_0 .. X_D and log π_old under the sampler (D: the last state needed); no grad
                # but at the kept steps (loop.retain_graph)
                traj = rollout(learner.policy, mine, learner.sampler, steps, learner.guidance, depth=max(need),
                               sde_steps=sde, grid=grid, tail=tail, keep=keep, keep_budget_gib=budget)
            _stop_point(learner)
            with ph("estimate"):  # x̂0 of the needed states by T′ Euler substeps (none for uniform credit)
                x0_hat = _estimate(learner, traj, need)
        _stop_point(learner)
        with ph("reward"), contextlib.suppress(StopRequested):  # the needed R_k in one call (uniform: R_T)
            scores = score(learner.policy, learner.reward, traj, x0_hat, learner.loop.decode_chunk, states=need,
                           finished=learner.advantage.cfg.reward_source == "completion")
    _stop_point(learner)  # an interrupted reward call set the stop flag: every rank stops here
    with ph("advantage"):  # gains G_k = R_{k+1} − R_k, normalised per group over every rank's rows
        rewards = learner.dist.gather_rows(scores.rewards)
        adv, dropped = finite_advantages(learner, rewards, plan.group_ids, it, trained)
    with ph("update"):  # the objective's terms (GRPO: clipped ratio + β·KL over the trained steps)
        w = step_weights(learner, adv, trained, grid)
        measure = learner.weighting.measures(it)  # weighting=auto: also the steps of weight 0
        upd = update(learner, traj, learner.dist.local_rows(adv.advantages), x0_hat, it, trained, w, mine.group_ids,
                     measure, seeds=mine.step_noise_seeds)
        obj.end_iteration(learner)  # its weight copies move toward the new weights
    upd["train/nonfinite_rewards"] = float(dropped.sum())
    if learner.loop.retain_graph is not False:  # which the update did: 1 = from the kept graphs, 0 = recomputed
        upd.update(_retain_metrics(learner, traj, keep))
    return IterationResult(plan, scores, rewards, adv, upd, ph, x0_hat is not None, ~dropped)


def retained_steps(learner: Learner, trained: list[int]) -> tuple[list[int] | None, float | None]:
    """``loop.retain_graph`` (:mod:`stepflow.retain`): the trained steps whose graphs the rollout keeps (None: the
    update recomputes) and the GiB budget of ``auto`` (None: no budget). ``true`` where it cannot apply raises the
    one-line reason (``stepflow.train.settings`` refuses such settings before anything loads); ``auto`` falls back
    to recomputation, logging why once."""
    from stepflow import retain

    m = retain.mode(learner.loop.retain_graph)
    if m == "off" or not trained:
        return None, None
    why = retain.why_not_at_runtime(learner)
    if why is not None:
        if m == "on":
            raise ValueError(f"loop.retain_graph=true: {why}; set loop.retain_graph=false (or auto)")
        _log_once(learner, f"loop.retain_graph=auto: the update recomputes: {why}")
        return None, None
    if learner.policy.device.type == "cpu":
        if learner.loop.retain_keep_memory and retain.keep_freed_memory():
            _log_once(learner, "loop.retain_graph: freed host memory stays in the process for the next rollout "
                               "(glibc mallopt; loop.retain_keep_memory=false returns it to the OS)")
        if hint := retain.allocator_hint():
            _log_once(learner, hint)
    return list(trained), (float(learner.loop.retain_max_gib) if m == "auto" else None)


def _retain_metrics(learner: Learner, traj: Trajectory, keep: list[int] | None) -> dict[str, float]:
    if keep is not None and traj.kept is None and traj.kept_refused:
        _log_once(learner, f"loop.retain_graph=auto: the update recomputes: {traj.kept_refused}")
    out = {"train/retained": float(learner.dist.all_sum(1.0 if traj.kept is not None else 0.0) == learner.dist.world)}
    if traj.kept is not None:
        out["mem/retained_gib"] = float(traj.kept_gib)
    return out


def _log_once(learner: Learner, msg: str) -> None:
    import logging

    if msg not in learner.logged:
        learner.logged.add(msg)
        logging.getLogger("stepflow.train").info(msg)


def branch_iteration(learner, it: int):
    """Iteration ``it`` of a branch-rollout credit (``advantage=tempflow | g2rpo``; :mod:`stepflow.branch_loop`,
    docs/method.md §13): ODE anchors (phase rollout), K SDE branches of every row at every trained step completed by
    the ODE (estimate), one reward call (reward), the branch advantages over every rank's rows (advantage), and the
    update of the branch rows, each at its own step (update). Returns an :class:`IterationResult` like
    :func:`iteration`."""
    from stepflow.branch import branch_at
    from stepflow.branch_loop import anchor_rows, branch_advantages, branch_trajectory, score_branches

    plan = learner.plan.plan(it)
    mine = plan.shard(learner.dist.rank, learner.dist.world)
    pol, cfg, dist = learner.policy, learner.advantage.cfg, learner.dist
    steps, ph, grid = learner.loop.num_steps, Phases(learner.policy), learner.grid()
    obj = learner.objective
    trained = obj.trained_steps(learner.train, learner.sampler, grid, None)
    k_br, grans = int(cfg.branches), tuple(cfg.granularities)
    pol.eval()
    _stop_point(learner)
    with obj.behaviour():
        with ph("rollout"):  # the ODE anchors, one per (prompt, initial noise)
            anchors_plan, amap = anchor_rows(mine)
            anchor = rollout(pol, anchors_plan, learner.sampler, steps, learner.guidance, sde_steps=[], grid=grid)
        _stop_point(learner)
        with ph("estimate"):  # K SDE branches of every row at every trained step, each completed by the ODE
            lat, vel, cond = anchor.latents[amap], anchor.velocities[amap], anchor.cond.index(amap)
            branches = []
            for k in trained:
                branches.append(branch_at(pol, lat, vel, anchor.times, cond, k, learner.sampler, k_br,
                                          mine.step_noise_seeds, learner.guidance, grans))
                _stop_point(learner)
    with ph("reward"), contextlib.suppress(StopRequested):
        scores, branch_r = score_branches(learner, anchor, amap, branches, mine)
    _stop_point(learner)
    with ph("advantage"):
        rewards = dist.gather_rows(scores.rewards)
        all_r = dist.gather_rows(branch_r)  # (B_global, K, S, G)
        adv_all, dropped, stats = branch_advantages(learner, all_r, plan.group_ids, it, trained, steps)
    with ph("update"):
        mine_adv = dist.local_rows(adv_all)
        traj, adv, mask = branch_trajectory(anchor, amap, branches, mine_adv, list(mine.prompts), list(mine.meta))
        w = learner.weighting.weights(learner.sampler, grid, trained, None)  # noise: TempFlow's σ√Δt weights
        groups = mine.group_ids.repeat_interleave(k_br * len(trained))
        upd = update(learner, traj, adv, None, it, trained, w, groups, False, mask=mask)
        obj.end_iteration(learner)
    upd["train/nonfinite_rewards"] = float(dropped.sum())
    upd["train/branch_rows"] = float(dist.all_sum(traj.batch_size))
    summary = torch.zeros(len(plan), steps, dtype=torch.float32)
    if trained:
        summary[:, trained] = adv_all.mean(1)
    return IterationResult(plan, scores, rewards, AdvantageOut(summary, None, stats), upd, ph, True, ~dropped)


def _estimate(learner: Learner, traj: Trajectory, need: list[int]) -> Tensor | None:
    if not learner.advantage.needs_stepwise_rewards and not learner.objective.reads_estimates:
        return None
    if learner.advantage.cfg.reward_source == "completion":  # the true reward of each state under the ODE
        from stepflow.branch import complete_states

        return complete_states(learner.policy, traj.latents, traj.times, traj.cond, need, learner.guidance)
    return estimate_states(learner.policy, traj, learner.loop.substeps, learner.guidance, learner.loop.adaptive_substeps,
                           learner.loop.estimate_chunk, states=need)


def _rollout_and_score_overlapped(learner: Learner, plan: IterationPlan, need: list[int], sde, ph: Phases,
                                  grid: Tensor | None = None, tail: Tensor | None = None, keep: list[int] | None = None,
                                  budget: float | None = None):
    """Rollout, estimates and decoding of ``loop.overlap_chunks`` chunks of the rows in turn, each chunk's reward
    call submitted to a thread as soon as its images exist; the "reward" phase is what is left to wait for at the
    end. Same trajectories, rewards and NFEs as the sequential phases (rows are seeded one by one)."""
    from concurrent.futures import ThreadPoolExecutor

    from stepflow.rollout import Scores

    n = len(plan)
    size = -(-n // learner.loop.overlap_chunks)
    parts, ests, futures = [], [], []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward") as pool:
        for s in range(0, n, size):
            sub = plan.rows(slice(s, s + size))
            with ph("rollout"):
                part = rollout(learner.policy, sub, learner.sampler, learner.loop.num_steps, learner.guidance,
                               depth=max(need), sde_steps=sde, grid=grid, tail=tail, keep=keep,
                               keep_budget_gib=None if budget is None else budget * len(sub) / n)
            with ph("estimate"):
                est = _estimate(learner, part, need)
                futures.append(score(learner.policy, learner.reward, part, est, learner.loop.decode_chunk, states=need,
                                     executor=pool, finished=learner.advantage.cfg.reward_source == "completion"))
            parts.append(part)
            ests.append(est)
        with ph("reward"):
            try:
                done = [f.result() for f in futures]
            except StopRequested:  # an interrupted reward call: the caller's stop point stops every rank
                return None, None, None
    traj = Trajectory.cat(parts)
    x0_hat = None if ests[0] is None else torch.cat(ests)
    comps = {k: torch.cat([d.components[k] for d in done]) for k in done[0].components}
    return traj, x0_hat, Scores(torch.cat([d.rewards for d in done]), comps, images=sum(d.images for d in done))


def _post_tail(learner: Learner, grid: Tensor, sde: list[int] | None) -> Tensor | None:
    """``window.post_solver=dpmpp2m`` (MixGRPO-Flash): the compressed tail grid after this iteration's window
    (:func:`stepflow.window.post_tail`), with the grid's own shift (``loop.time_grid=fastvideo``: ``loop.grid_shift``,
    null = the policy's; ``model``: the policy's scheduler shift). An empty window gets no tail: all Euler (the
    released Flash crashes there, sampling_utils.py L44). None for every other window."""
    if learner.window is None or getattr(learner.window, "post_solver", "euler") == "euler":
        return None
    from stepflow.window import post_tail

    shift = getattr(learner.loop, "grid_shift", None)
    if getattr(learner.loop, "time_grid", "model") != "fastvideo" or shift is None:
        shift = float(learner.policy.shift)
    return post_tail(learner.window, grid, sde, shift)


def _stop_point(learner: Learner) -> None:
    """A phase boundary: every rank agrees to go on or to stop (the same collective on every rank)."""
    if learner.dist.any(stop.STOP.is_set()):
        raise StopRequested(stop.reason())


def step_weights(learner: Learner, adv: AdvantageOut, trained: list[int], grid: Tensor) -> Tensor | None:
    """The loss weight of each trained step (S,), mean 1, from the step weighting (``train.weighting`` = noise: ∝ the
    step's noise std; gain_var: ∝ the variance of its gains over every rank's rows); None = all 1."""
    return learner.weighting.weights(learner.sampler, grid, trained, adv.gains)


def states_needed(learner: Learner, trained: list[int], it: int) -> list[int]:
    """The states whose rewards iteration ``it`` computes: those the credit reads for the ``trained`` steps, plus the
    final image every ``loop.final_reward_every`` iterations when the credit does not read it (train/reward_final)."""
    steps = learner.loop.num_steps
    need = sorted({*learner.advantage.states_needed(trained, steps), *learner.objective.states(trained, steps)}) or [steps]
    every = learner.loop.final_reward_every
    if steps not in need and every and it % every == 0:
        need = sorted({*need, steps})
    return need


def finite_advantages(learner: Learner, rewards: Tensor, group_ids: Tensor, it: int,
                      trained: list[int] | None = None) -> tuple[AdvantageOut, Tensor]:
    """Advantages of the rows whose rewards are finite in the columns the scheme reads; a row with a NaN / inf
    reward is dropped from the iteration (advantage 0 at every step, left out of its group's statistics, so the
    update skips it). Returns (advantages of all rows, dropped (B,) bool). More than ``loop.max_nonfinite_frac``
    dropped rows stop the run (:class:`~stepflow.errors.NonFiniteRewardsError`)."""
    steps = learner.loop.num_steps
    used = rewards[:, learner.advantage.states_needed(trained or [], steps) or [steps]]
    dropped = ~torch.isfinite(used).all(1)
    n = int(dropped.sum())
    if n == 0:
        return learner.advantage(rewards, group_ids, steps, trained), dropped
    if n > learner.loop.max_nonfinite_frac * len(rewards):
        raise NonFiniteRewardsError(f"{n} of {len(rewards)} samples of iteration {it} have a NaN / inf reward (more "
                                    f"than loop.max_nonfinite_frac={learner.loop.max_nonfinite_frac}); check the reward")
    keep = ~dropped
    out = learner.advantage(rewards[keep], group_ids[keep], steps, trained)
    full = torch.zeros(len(rewards), steps, dtype=out.advantages.dtype)
    full[keep] = out.advantages
    return AdvantageOut(full, None, out.stats), dropped


def iteration_metrics(res: IterationResult, world: int | Dist) -> dict[str, float]:
    """The metrics of one iteration (names in docs/guide.md): rewards per step, advantages, update diagnostics,
    seconds and NFEs per phase, images scored (counts summed over ranks: ``world`` = the Dist of the ranks, or a
    world size to multiply this rank's counts by). Every rank must call it when given a Dist."""
    r = res.rewards[res.finite]  # the dropped rows' NaN / inf never reach a logged mean
    done = [k for k in range(r.shape[1]) if bool(torch.isfinite(r[:, k]).all())]  # the states that were scored
    m: dict[str, float] = {}
    if r.shape[1] - 1 in done:
        final = r[:, -1]
        m["train/reward_final"] = final.mean().item()
        m["train/reward_std"] = final.std().item() if final.numel() > 1 else 0.0
    m["train/reward_mean"] = r[:, done].mean().item() if res.stepwise else r[:, -1].mean().item()
    if res.stepwise:
        m.update({f"train/reward_step{k}": r[:, k].mean().item() for k in done})
    m.update({f"train/{name}": torch.nanmean(v.float()).item() for name, v in res.scores.components.items()
              if bool(torch.isfinite(v.float()).any())})
    m.update({f"train/{k}": float(v) for k, v in res.advantages.stats.items()})
    m.update(res.update)
    s, n = res.phases.seconds, res.phases.nfe
    m.update({f"time/{p}_s": s.get(p, 0.0) for p in ("rollout", "estimate", "reward", "advantage", "update")})
    m["time/iteration_s"] = sum(s.values())
    counts = torch.tensor([sum(n.values()), n.get("rollout", 0), n.get("estimate", 0), res.scores.images,
                           sum(res.phases.nfe_grad.values())], dtype=torch.float64)
    # every rank's own counts summed (ranks differ: zero-weight micro-batches, a short evaluation shard)
    counts = world.all_sum_tensor(counts) if isinstance(world, Dist) else counts * world
    nfe, rollout_nfe, est_nfe, images, grad_nfe = (int(c) for c in counts.tolist())
    m.update({"cost/nfe": nfe, "cost/nfe_rollout": rollout_nfe, "cost/nfe_estimate": est_nfe, "cost/reward_calls": 1,
              "cost/reward_images": images,
              # a backward costs about two forwards: forward-equivalent NFEs of the iteration
              "cost/nfe_backward": grad_nfe, "cost/nfe_fwd_equiv": nfe + 2 * grad_nfe})
    m.update({f"mem/peak_gib_{p}": v for p, v in res.phases.peak_gib.items()})  # CUDA only
    m.update({f"mem/page_faults_{p}": float(v) for p, v in res.phases.page_faults.items()})  # this rank's process
    m.update({f"mem/peak_rss_gib_{p}": v for p, v in res.phases.peak_rss_gib.items()})  # this rank's process, Linux
    return m
