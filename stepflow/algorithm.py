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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from stepflow import stop
from stepflow.advantage import AdvantageEstimator, AdvantageOut
from stepflow.config import LoopConfig, TrainConfig
from stepflow.data import IterationPlan, PromptPlanner
from stepflow.dist import Dist, clip_grad_norm
from stepflow.errors import NonFiniteRewardsError, NonFiniteUpdate, StopRequested
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


def update(learner: Learner, traj: Trajectory, adv: Tensor, x0_hat: Tensor | None, it: int,
           steps: list[int] | None = None, weights: Tensor | None = None, groups: Tensor | None = None,
           measure: bool = False, seeds: Tensor | None = None, mask: Tensor | None = None) -> dict[str, float]:
    """Policy update over the objective's terms (the GRPO family: the trained ``steps``, default the objective's
    :meth:`~stepflow.objectives.base.Objective.trained_steps`; the forward-process objectives: K training times per
    row drawn among them): ``updates_per_iter`` optimizer steps over shuffled rows, each accumulating (terms ×
    micro-batches), term j's loss weighted by ``weights[j]`` (S,) (mean 1; default 1). ``train.weighting`` =
    grad_rms / auto combine the steps' gradients instead (:func:`_per_step_update`); ``measure``: add this update's
    gradients to the auto-step signal estimate (``groups``: (B_local,) group ids, to split the batch into independent
    halves). adv: (B_local, T); ``seeds``: (B_local,) the rows' noise seeds (what the forward-process objectives draw
    their times and noise from, and ``train.step_subset`` each row's steps; default the row indices).

    ``train.step_subset=random_per_sample`` (DanceGRPO): row i trains only its own ``int(S·train.step_fraction)`` of
    the S terms (:func:`subset_steps`); term j runs over the chunk's rows that drew it, and each (row, term) pair's
    loss is weighted ``weights[j]/(N·int(S·fraction))``, N the chunk's rows on every rank: the released
    ``mean max(−Aρ, −A clip(ρ, 1 ± ϵ))/(grad_accum·train_timesteps)`` summed over an optimizer step's samples and
    their steps (fastvideo/train_grpo_flux.py L571-611). ``mask``: (B_local, S) bool, the same per-row subset given by
    the caller instead of drawn (the branch rollouts of :mod:`stepflow.branch_loop`: each branch row trains its own
    step only); every row must train the same number of terms.

    ``train.update_per_step`` (Granular-GRPO): one optimizer step per term, each over the chunk's rows that train
    it (its loss the mean over them, times ``weights[j]``), in the terms' order. Returns diagnostics (means over
    terms)."""
    o, pol, dist, obj = learner.train, learner.policy, learner.dist, learner.objective
    if steps is None:
        steps = obj.trained_steps(o, learner.sampler, traj.times, learner.window_steps(it))
    keep = (adv.abs().sum(1) > 0 if (o.drop_zero_adv and obj.drops_zero_advantage)
            else torch.ones(traj.batch_size, dtype=torch.bool))
    rows = torch.nonzero(keep).flatten()
    rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(learner.loop.seed * 7919 + it))]
    if dist.world > 1:  # the same number of optimizer steps on every rank (a rank may hold no rows of a chunk)
        chunks = list(rows.tensor_split(o.updates_per_iter))
    else:
        chunks = [c for c in rows.chunk(o.updates_per_iter) if len(c)] if len(rows) else []
    if not steps:  # e.g. the ODE sampler: no step has a density, nothing to train
        chunks = []
    else:
        obj.begin_update(learner, traj, it, torch.arange(traj.batch_size) if seeds is None else seeds, steps)
    todo = obj.terms(steps)
    # train.step_subset (DanceGRPO): each row trains its own int(S·step_fraction) of the S terms, drawn from its seed
    subset = (subset_steps(len(todo), torch.arange(traj.batch_size) if seeds is None else seeds, o.step_fraction)
              if o.step_subset is not None and todo else None)  # (B_local, S) bool, or None: every row every term
    if mask is not None:  # given by the rollout (branch rows), not drawn
        if subset is not None:
            raise ValueError("train.step_subset: the branch rollouts give each row its own step already; set "
                             "train.step_subset=null")
        subset = torch.as_tensor(mask, dtype=torch.bool)
        if subset.shape != (traj.batch_size, len(todo)):
            raise ValueError(f"mask: expected shape ({traj.batch_size}, {len(todo)}), got {tuple(subset.shape)}")
        counts = subset.sum(1)
        if len(counts) and bool((counts != counts[0]).any()):
            raise ValueError("mask: every row must train the same number of terms")
    if subset is not None and learner.weighting.per_step:
        raise ValueError(f"train.step_subset: combines the terms of each sample's own steps, which "
                         f"train.weighting={o.weighting} (whole per-step gradients) cannot; use another train.weighting")
    if o.update_per_step and learner.weighting.per_step:
        raise ValueError(f"train.update_per_step: one optimizer step per trained step, which train.weighting="
                         f"{o.weighting} (a combination of every step's gradient) cannot; use another train.weighting")
    if mask is not None:  # a rank without rows learns the count from the others
        per_row = int(dist.all_max(int(subset[0].sum()) if len(subset) else 0))
    elif subset is not None:
        per_row = steps_per_sample(len(todo), o.step_fraction)
    else:
        per_row = len(todo)
    if per_row == 0:  # int(S·step_fraction) = 0: no sample trains a step (train.py refuses such settings)
        chunks = []
    times = traj.times.to(pol.device)
    params = list(pol.trainable_parameters())
    stats = _Stats()  # row-weighted sums, detached 0-d tensors: no host sync until the end of the update
    # loop.retain_graph: the terms' velocities are the rollout's, with their graphs; their losses are summed and
    # back-propagated once per optimizer step (a graph is freed by its first backward)
    pending: list[Tensor] | None = [] if traj.kept is not None else None
    if pending is not None and (len(chunks) > 1 or o.update_per_step or learner.weighting.per_step):
        from stepflow.retain import why_not_at_runtime

        raise ValueError(f"loop.retain_graph: the rollout's graphs serve one optimizer step over every term; "
                         f"{why_not_at_runtime(learner) or 'this update takes several'}")
    pol.train()

    def optimizer_step() -> None:
        if pending:  # the kept graphs: one backward of every term's weighted loss
            learner.backward(torch.stack(pending).sum())
            pending.clear()
        dist.all_reduce_grads(params)
        norm = clip_and_step(learner, params, o.max_grad_norm)
        if norm is not None:
            stats.plain.setdefault("grad_norm", []).append(norm)
        learner.opt_steps += 1
        if learner.on_optimizer_step is not None:
            learner.on_optimizer_step(learner.opt_steps - 1)

    for chunk in chunks:
        n_global = dist.all_sum(len(chunk))
        if n_global == 0:
            continue
        learner.optimizer.zero_grad(set_to_none=True)
        mbs = [mb for mb in chunk.split(o.micro_batch_size) if len(mb)]  # a rank may hold none of a chunk's rows
        # FSDP2 / DeepSpeed: every forward and backward is a collective, so every rank runs as many micro-batches as
        # the rank with most; the extra ones are this rank's first row at loss weight 0 (no gradient, no statistic)
        pads = [torch.zeros(1, dtype=torch.long)] * (int(dist.all_max(len(mbs))) - len(mbs) if dist.lockstep else 0)

        def terms(k: int, rows_list, scale: float, last: bool = False, n_global: float = n_global,
                  pads: list = pads) -> None:  # step k, backward
            batches = [(mb, True) for mb in rows_list] + [(mb, False) for mb in pads]
            for i, (mb, real) in enumerate(batches):
                out = step_loss(learner, traj, adv, k, mb, times, x0_hat)
                # each term is a mean over its rows: weighted, the step's loss is the mean over all rows of the
                # chunk on all ranks (gradients are then summed over ranks: grad_scale undoes a strategy's mean),
                # averaged over the steps
                w = scale * len(mb) / n_global * dist.grad_scale if real else 0.0
                dist.boundary(last and i == len(batches) - 1)  # DeepSpeed: reduce and step after the chunk's last
                if pending is not None:
                    pending.append(out.pop("loss") * w)
                else:
                    learner.backward(out.pop("loss") * w)
                if real:
                    stats.add_terms(out, len(mb), k)

        if o.update_per_step:  # Granular-GRPO: an optimizer step per term, each the mean over the rows that train it
            for j, k in enumerate(todo):
                rows_j = chunk if subset is None else chunk[subset[chunk, j]]
                n_j = dist.all_sum(len(rows_j))
                if n_j == 0:  # no row of any rank trains this term: no step
                    continue
                learner.optimizer.zero_grad(set_to_none=True)
                mbs_j = [mb for mb in rows_j.split(o.micro_batch_size) if len(mb)]
                pad = [torch.zeros(1, dtype=torch.long)] * (int(dist.all_max(len(mbs_j))) - len(mbs_j)
                                                            if dist.lockstep else 0)
                with dist.accumulating():
                    terms(k, mbs_j, 1.0 if weights is None else float(weights[j]), last=True, n_global=n_j, pads=pad)
                optimizer_step()
            continue
        if learner.weighting.per_step:
            _per_step_update(learner, todo, chunk, n_global, mbs, groups, terms, params, stats.plain, measure)
        elif subset is not None:  # term j over the chunk's rows that drew it; each (row, term) pair 1/(N·per_row)
            mine = [[mb for mb in chunk[subset[chunk, j]].split(o.micro_batch_size) if len(mb)]
                    for j in range(len(todo))]
            most = torch.tensor([len(m) for m in mine], dtype=torch.float64)
            most = dist.all_max_tensor(most) if dist.lockstep else most  # one collective for every term's count
            last_j = max((j for j in range(len(todo)) if most[j] > 0), default=-1)
            with dist.accumulating():
                for j, k in enumerate(todo):
                    pad = [torch.zeros(1, dtype=torch.long)] * (int(most[j]) - len(mine[j]) if dist.lockstep else 0)
                    terms(k, mine[j], (1.0 if weights is None else float(weights[j])) / per_row, last=j == last_j,
                          pads=pad)
        else:
            with dist.accumulating():
                for j, k in enumerate(todo):
                    terms(k, mbs, (1.0 if weights is None else float(weights[j])) / len(todo),
                          last=j == len(todo) - 1)
        optimizer_step()
    pol.eval()
    res = stats.reduce(dist)
    res["train/samples_trained"], res["train/steps_trained"] = dist.all_sum(len(rows)), float(len(todo) if steps else 0)
    if subset is not None:
        res["train/steps_per_sample"] = float(per_row)
    if weights is not None:
        res.update({f"train/weight_step{k}": float(w) for k, w in zip(steps, weights)})
    if learner.signal is not None:
        res.update({f"train/signal_step{k}": float(r) for k, r in zip(learner.signal.steps, learner.signal.rho())})
        res.update({f"train/weight_step{k}": float(w) for k, w in zip(learner.signal.steps, learner.signal.weights())})
        q, q95, tau2 = learner.signal.heterogeneity()
        if q95 < float("inf"):  # Cochran's Q over its 95 % point: the weights leave uniform above 1
            res["train/signal_heterogeneity"], res["train/signal_tau2"] = q / q95, tau2
    return res


def steps_per_sample(num_terms: int, fraction: float) -> int:
    """``train.step_subset=random_per_sample``: how many of the S terms each sample trains, ``int(S·fraction)``
    (DanceGRPO's ``train_timesteps = int(len(timesteps)·timestep_fraction)``, fastvideo/train_grpo_flux.py L570:
    a plain floor of the float product, as released)."""
    return int(num_terms * fraction)


def subset_steps(num_terms: int, seeds: Tensor, fraction: float) -> Tensor:
    """DanceGRPO's per-sample random subset of the trained steps (fastvideo/train_grpo_flux.py L551-570): row i
    permutes the S terms with ``torch.randperm`` under a generator seeded from its own noise seed ``seeds[i]`` (so the
    draw depends on the row alone: the same on any rank, in any batch, on resume) and keeps the first
    :func:`steps_per_sample` (S, fraction). seeds: (B,) long. Returns (B, S) bool, ``mask[i, j]`` = row i trains
    term j; every row has the same count."""
    n = steps_per_sample(num_terms, fraction)
    mask = torch.zeros(len(seeds), num_terms, dtype=torch.bool)
    for i, s in enumerate(seeds.tolist()):
        g = torch.Generator().manual_seed((int(s) * 1_000_003 + 13) % (2**63 - 1))  # its own stream (NFT's is + 7)
        mask[i, torch.randperm(num_terms, generator=g)[:n]] = True
    return mask


class _Stats:
    """The update's diagnostics: each term's value weighted by its rows (``add_terms``), reduced over ranks into
    row-weighted means (``ratio_min`` / ``ratio_max``: global min / max); ``plain``: per-optimizer-step values, the
    same on every rank (grad_norm, auto_steps), averaged."""

    def __init__(self) -> None:
        self.sums: dict[str, list[Tensor]] = {}
        self.rows: dict[str, float] = {}
        self.extremes: dict[str, list[Tensor]] = {"ratio_min": [], "ratio_max": []}
        self.plain: dict[str, list[Tensor]] = {}

    def add_terms(self, out: dict[str, Tensor], n: int, k: int) -> None:
        for name, v in out.items():
            if name in self.extremes:
                self.extremes[name].append(v.detach())
                continue
            names = [name, f"{name}_step{k}"] if name in ("clip_frac", "kl") else [name]
            for key in names:
                self.sums.setdefault(key, []).append(v.detach().double() * n)
                self.rows[key] = self.rows.get(key, 0.0) + n

    def reduce(self, dist: Dist) -> dict[str, float]:
        """One host sync; under several ranks one sum and one max over ranks (every rank must call it)."""
        keys = dist.union(self.sums) if dist.world > 1 else sorted(self.sums)
        sums = torch.stack([torch.stack(self.sums[k]).sum().cpu() if k in self.sums else torch.zeros((), dtype=torch.float64)
                            for k in keys]) if keys else torch.zeros(0, dtype=torch.float64)
        rows = torch.tensor([self.rows.get(k, 0.0) for k in keys], dtype=torch.float64)
        both = dist.all_sum_tensor(torch.cat([sums, rows]))
        sums, rows = both[:len(keys)], both[len(keys):]
        res = {f"train/{k}": float(sums[i] / rows[i]) for i, k in enumerate(keys) if rows[i] > 0}
        lo, hi = self.extremes["ratio_min"], self.extremes["ratio_max"]
        ext = torch.tensor([-float(torch.stack(lo).min()) if lo else -float("inf"),
                            float(torch.stack(hi).max()) if hi else -float("inf")], dtype=torch.float64)
        ext = dist.all_max_tensor(ext)
        if bool(torch.isfinite(ext).all()):
            res["train/ratio_min"], res["train/ratio_max"] = -float(ext[0]), float(ext[1])
        for k, v in self.plain.items():
            res[f"train/{k}"] = float(torch.stack([x.double() for x in v]).cpu().mean())
        return res


def clip_and_step(learner: Learner, params: list, max_norm: float) -> Tensor | None:
    """Clip the gradients to ``max_norm`` (0 = no clipping) and take the optimizer step; returns the gradient norm
    before clipping (None without clipping). DeepSpeed clips inside its own step (``gradient_clipping`` in its config)
    and reports the norm it clipped with; FSDP2's sharded gradients have their norm summed over ranks.

    A gradient whose norm is inf / nan (the norm is global, so every rank sees it) raises
    :class:`NonFiniteUpdate` before the step: no non-finite weight is taken, saved or logged, and ``last.ckpt``
    keeps the last finished iteration."""
    engine = learner.dist.engine
    if engine is not None:
        learner.optimizer.step()
        norm = torch.as_tensor(float(engine.get_global_grad_norm() or 0.0), dtype=torch.float64)
        _check_finite_grad(learner, norm, taken=True)
        return norm if max_norm > 0 else None
    norm = clip_grad_norm(params, max_norm if max_norm > 0 else float("inf"))
    _check_finite_grad(learner, norm, taken=False)
    learner.optimizer.step()
    return norm if max_norm > 0 else None


def _check_finite_grad(learner: Learner, norm: Tensor, taken: bool) -> None:
    if bool(torch.isfinite(norm)):
        return
    when = ("DeepSpeed's optimizer step has taken it; nothing was saved after it" if taken
            else "the optimizer step was not taken")
    raise NonFiniteUpdate(
        f"train: the gradient of optimizer step {learner.opt_steps + 1} is not finite (norm {float(norm)}), so the run "
        f"stopped: {when}, and checkpoints/last.ckpt holds the last finished iteration; lower train.lr, check the "
        "reward (train/nonfinite_rewards) or clip harder (train.max_grad_norm)")


def _grad_vector(params: list) -> Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def _per_step_update(learner: Learner, steps: list[int], chunk: Tensor, n_global: float, mbs: list[Tensor],
                     groups: Tensor | None, terms, params: list, stats: dict, measure: bool) -> None:
    """Each trained step's gradient separately, summed from its parts (whole prompt groups; one group: two halves),
    then combined into the parameters' .grad: ``train.weighting=grad_rms``: ``Σ_k (rms/|g_k|)·g_k / S``;
    ``train.weighting=auto``: ``Σ_k w_k·(rms/|g_k|)·g_k`` with the signal weights w (sum 1) of
    :class:`stepflow.coherence.StepSignal`, to which every step computed adds a measurement from its parts' mean
    gradients (sums over ranks). Steps of weight 0 are computed only when ``measure``. Under DDP the per-step
    gradients are summed over ranks first, so the norms and the combination are those of the global gradients.
    ``n_global``: the chunk's rows on all ranks."""
    from stepflow.coherence import StepSignal, pair_sums
    from stepflow.loss import rms_weights

    gid = groups[chunk] if groups is not None else torch.zeros(len(chunk), dtype=torch.long)
    if len(torch.unique(gid)) < 2:  # one group only: halves by position
        gid = (torch.arange(len(chunk)) >= (len(chunk) + 1) // 2).long()
    part_of = {int(r): int(g) for r, g in zip(chunk, gid)}
    ids = sorted(set(part_of.values()))
    parts = [[mb[torch.tensor([part_of[int(r)] == g for r in mb])] for mb in mbs] for g in ids]
    parts = [[mb for mb in p if len(mb)] for p in parts]
    sizes = [sum(len(mb) for mb in p) for p in parts]
    sig = learner.signal
    if sig is not None:
        w_all = sig.weights()
        todo = [k for k in steps if measure or float(w_all[sig.steps.index(k)]) > 0]
    else:
        todo = list(steps)
    n_params = sum(p.numel() for p in params)
    grads, sums = [], []
    for k in todo:
        vecs = []
        for part in parts:
            for p in params:
                p.grad = None
            terms(k, part, 1.0)
            vecs.append(_grad_vector(params))
        grads.append(sum(vecs) if vecs else torch.zeros(n_params))  # a DDP rank may hold no rows of a chunk
        if sig is not None:  # part means m_i = part_i · n_global / n_i: their pair sums
            m = [v.double() * (n_global / n) for v, n in zip(vecs, sizes)]
            sums.append(pair_sums(torch.stack(m)) if m else torch.zeros(4, dtype=torch.float64))
    if sig is not None and todo:  # one reduction over ranks for every step's sums
        sig.add(todo, [StepSignal.ratio(*row) for row in learner.dist.all_sum_tensor(torch.stack(sums)).tolist()])
    manual = learner.dist.world > 1 and learner.dist.manual_grad_sync
    if manual and grads:  # every rank combines the global per-step gradients (norms of the sum over ranks)
        grads = list(learner.dist.all_sum_tensor(torch.stack(grads)).unbind(0))
    norms = torch.stack([g.norm() for g in grads]).double() if grads else torch.zeros(0)
    coef = rms_weights(norms).double()
    if sig is not None:
        w_all = sig.weights()  # after this measurement
        coef = coef * torch.tensor([float(w_all[sig.steps.index(k)]) for k in todo], dtype=torch.float64)
        stats.setdefault("auto_steps", []).append(torch.tensor(float((coef > 0).sum())))
    else:
        coef = coef / max(1, len(todo))
    total = sum(c * g for c, g in zip(coef.tolist(), grads)) if grads else None
    if manual and total is not None:  # the caller's all_reduce_grads sums the ranks' (identical) combinations
        total = total / learner.dist.world
    off = 0
    for p in params:
        n_p = p.numel()
        p.grad = None if total is None else total[off:off + n_p].view_as(p).to(p.dtype).clone()
        off += n_p


def step_loss(learner: Learner, traj: Trajectory, adv: Tensor, k: int, rows: Tensor, times: Tensor,
              x0_hat: Tensor | None = None) -> dict[str, Tensor]:
    """The loss of term k (the GRPO family: step k) on ``rows`` (a mean over them, key ``loss``) and its detached
    diagnostics: the objective's (:meth:`stepflow.objectives.base.Objective.loss`; docs/method.md §5, §6.3, §11)."""
    return learner.objective.loss(learner, traj, adv, k, rows, times, x0_hat)


def step_gradients(learner: Learner, traj: Trajectory, adv: Tensor, steps: Sequence[int]) -> Tensor:
    """Flattened gradient (of the trained weights) of the GRPO loss of each step in ``steps`` over the whole batch:
    (len(steps), D), the input of :func:`stepflow.coherence.signal_fraction`.

    The loss is the training loop's own (:func:`step_loss` of ``learner``, β·KL included); ``traj``/``adv`` come
    from one rollout and its advantages. The weights are not changed; gradients of the LoRA parameters are left
    cleared.
    """
    params = list(learner.policy.trainable_parameters())
    rows = torch.arange(traj.batch_size)
    times = traj.times.to(learner.policy.device)
    out = []
    learner.policy.train()
    try:
        for k in steps:
            for p in params:
                p.grad = None
            step_loss(learner, traj, adv, k, rows, times)["loss"].backward()
            out.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]))
    finally:
        for p in params:
            p.grad = None
        learner.policy.eval()
    return torch.stack(out)


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
