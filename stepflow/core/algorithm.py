"""One iteration of Stepwise-Flow-GRPO / Flow-GRPO, free of Lightning (docs/method.md §10).

:func:`iteration` is the paper's algorithm on one screen: plan → rollout → x̂0 estimates → stepwise rewards →
advantages → policy update. Each phase is a function of its own (``stepflow.core.rollout``, ``stepflow.math.advantage``,
:func:`update`, :func:`step_loss`), timed by :class:`Phases`, which also reads the NFEs off the policy's counter.
``stepflow.grpo.GRPOModule`` is the Lightning shell around it; ``experiments/gpu_check.py`` and
:func:`step_gradients` (the per-step gradients ``experiments/grad_coherence.py`` measures with ``stepflow.math.coherence``)
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

from stepflow.config import LoopConfig, TrainConfig
from stepflow.core.data import IterationPlan, PromptPlanner
from stepflow.core.dist import Dist
from stepflow.core.rollout import Scores
from stepflow.core.update import clip_and_step, step_gradients, step_loss, steps_per_sample, subset_steps, update
from stepflow.errors import StopRequested
from stepflow.math.advantage import AdvantageOut
from stepflow.math.weighting import Weighting
from stepflow.objectives import Grpo, Objective
from stepflow.objectives.base import trainable_steps
from stepflow.policies.base import FlowPolicy
from stepflow.rewards.base import Reward
from stepflow.rollouts.base import RolloutStrategy, stop_point
from stepflow.rollouts.trajectory import finite_advantages, retained_steps, states_needed

__all__ = ["Learner", "Phases", "IterationResult", "iteration", "update", "step_loss", "step_gradients",
           "trainable_steps", "finite_advantages", "iteration_metrics", "subset_steps", "steps_per_sample",
           "states_needed", "retained_steps", "clip_and_step"]


@dataclass
class Learner:
    """Everything an iteration reads: the policy and its optimizer, the reward, the sampler, the advantage
    estimator, the prompt plan, the loop/train settings, the objective and the step weighting, and the collectives.
    ``backward`` runs a loss's backward pass (Lightning's ``manual_backward`` under a Trainer);
    ``on_optimizer_step(n)`` is called after optimizer step n (the EMA)."""

    policy: FlowPolicy
    reward: Reward
    sampler: Any  #: a stepflow.samplers.Sampler
    advantage: Any  #: a stepflow.credits.Credit
    plan: PromptPlanner
    loop: LoopConfig
    train: TrainConfig
    optimizer: Any
    guidance: float = 1.0
    dist: Dist = field(default_factory=Dist)
    backward: Callable[[Tensor], None] = Tensor.backward
    on_optimizer_step: Callable[[int], None] | None = None
    opt_steps: int = 0
    window: Any = None  #: a stepflow.windows.Window, or None (every step follows the sampler)
    objective: Objective | None = None  #: what the update minimises (None: GRPO with ``train``'s settings)
    weighting: Weighting = field(default_factory=Weighting)  #: how the trained steps' terms are combined
    logged: set = field(default_factory=set, repr=False)  #: the one-time messages already logged

    def __post_init__(self) -> None:
        if self.objective is None:
            self.objective = Grpo(train=self.train)

    @property
    def rollout(self) -> RolloutStrategy:
        """How the credit's rewards are collected (:meth:`stepflow.credits.base.Credit.rollout_strategy`)."""
        return self.advantage.rollout_strategy()

    @property
    def signal(self):
        """The online per-step signal estimate of ``train.weighting=auto`` (else None)."""
        return self.weighting.signal

    def grid(self) -> Tensor:
        """The rollout's σ grid (T+1,) under ``loop.time_grid`` / ``loop.grid_shift`` (:func:`stepflow.core.rollout.sampling_grid`)."""
        from stepflow.core.rollout import sampling_grid

        return sampling_grid(self.policy, self.loop.num_steps, getattr(self.loop, "time_grid", "model"),
                             getattr(self.loop, "grid_shift", None))

    def window_steps(self, it: int) -> list[int] | None:
        """The SDE steps of iteration ``it`` (None = all)."""
        if self.window is None:
            return None
        return self.window.steps(it, self.loop.num_steps, self.loop.seed)


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
    """GRPO iteration ``it`` (docs/method.md §10) for every rollout strategy (:mod:`stepflow.rollouts`; the credit
    names it): collect → reward → advantages over every rank's rows → the objective's update. A stop request
    (SIGTERM / SIGINT) abandons it at the next phase boundary before the update (``StopRequested``); once the update
    has begun, the iteration finishes."""
    strategy, obj = learner.rollout, learner.objective
    plan = learner.plan.plan(it)  # the same global plan on every rank; each rolls out its own rows
    mine = plan.shard(learner.dist.rank, learner.dist.world)
    ph = Phases(learner.policy)
    ctx = strategy.context(learner, it)  # the grid, SDE window, trained steps, states needed, kept graphs
    learner.policy.eval()
    stop_point(learner)
    with obj.behaviour():  # the behaviour policy's weights (DiffusionNFT: the old copy; else the current ones)
        col = strategy.collect(learner, mine, ctx, ph)  # rollout (and the x̂0 estimates or branches): no grad
    stop_point(learner)
    with ph("reward"), contextlib.suppress(StopRequested):  # one reward call (uniform credit: R_T only)
        col = strategy.score(learner, col, mine, ctx)
    stop_point(learner)  # an interrupted reward call set the stop flag: every rank stops here
    with ph("advantage"):  # the credit over every rank's rows (gains: G_k = R_{k+1} − R_k, normalised per group)
        rewards = learner.dist.gather_rows(col.scores.rewards)
        cred = strategy.credit(learner, col, rewards, plan, ctx)
    with ph("update"):  # the objective's terms (GRPO: clipped ratio + β·KL over the trained steps)
        b = strategy.training_batch(learner, col, cred, mine, ctx)
        obj.row_info = b.rows  # the credit's per-row data for the objective (e.g. GARDO's KL gate)
        upd = update(learner, b.traj, b.adv, b.x0_hat, it, ctx.trained, b.weights, b.groups, b.measure,
                     seeds=b.seeds, mask=b.mask)
        obj.update_stats = upd  # what the update logged, for end_iteration (e.g. GARDO's reference reset)
        obj.end_iteration(learner)  # its weight copies move toward the new weights
    upd["train/nonfinite_rewards"] = float(cred.dropped.sum())
    upd.update(strategy.metrics(learner, col, b, ctx))
    return IterationResult(plan, col.scores, rewards, cred.out, upd, ph, strategy.stepwise(col), ~cred.dropped)


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
