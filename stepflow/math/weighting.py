"""How the trained steps' loss terms enter one optimizer step: ``train.weighting``, one strategy chosen at build time.

=========  ===================================================================================================
none       every trained step's term weighs 1 (the mean over the steps)
noise      TempFlow-GRPO's noise-aware weights ``w_k = σ_k / mean_j σ_j`` over the trained steps (σ the step's std)
gain_var   ``w_k ∝ Var_i G_k``, the variance of step k's gains over every rank's rows
guard      GRPO-Guard's noise-normalised log-ratio in place of ``log π_θ − log π_old`` (:func:`~stepflow.math.loss.guard_log_ratio`)
           only (RatioNorm, as Flow-Factory implements it; the measured docs/results.md runs used it)
guard_released
           GRPO-Guard as released (yifan123/flow_grpo PR #175, scripts/train_sd3_GRPO_Guard.py L915-932): the same
           normalised ratio, and each step's policy loss divided by its ``Δt``
           (:func:`~stepflow.math.loss.guard_released_scale`)
grad_rms   each step's gradient computed alone and scaled to the RMS of their norms
auto       each step's gradient computed alone and weighted by its measured signal fraction
           (:class:`~stepflow.math.coherence.StepSignal`; steps of weight 0 are computed every ``train.auto_every``
           iterations to be measured again)
=========  ===================================================================================================

The weights (``noise``, ``gain_var``) are the loss weights of the terms and have mean 1; ``grad_rms`` and ``auto``
combine whole per-step gradients instead (``per_step``), so they cannot run where gradients are sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from stepflow.math.coherence import StepSignal, pair_sums
from stepflow.math.loss import WEIGHTINGS, gain_variance_weights, guard_released_scale, noise_weights, rms_weights
from stepflow.math.sde import step_std

if TYPE_CHECKING:
    from stepflow.samplers.base import Sampler

__all__ = ["Weighting", "build_weighting"]


class Weighting:
    """The ``none`` strategy and the interface of the others."""

    name = "none"
    per_step = False  #: each trained step's gradient is computed separately and then combined
    guard = False  #: the GRPO loss uses GRPO-Guard's normalised log-ratio
    signal: StepSignal | None = None  #: ``auto``: the online per-step signal estimate

    def weights(self, sampler: Sampler, grid: Tensor, trained: Sequence[int], gains: Tensor | None) -> Tensor | None:
        """(S,) the loss weight of each trained step (mean 1), or None (all 1). ``grid``: (T+1,) times; ``gains``:
        (B, T) the iteration's gains over every rank's rows (None for credit without gains)."""
        return None

    def measures(self, it: int) -> bool:
        """Iteration ``it`` also computes (and measures) the steps whose weight is 0 (``auto``)."""
        return False

    def policy_scale(self, t, t_next) -> Tensor | None:
        """A factor on the GRPO policy loss of the step from ``t`` to ``t_next`` (0-d tensors), applied before the KL
        term is added (``guard_released``: ``1/Δt``); None = 1."""
        return None

    def combine(self, learner: Any, terms: Sequence[int], rows: Tensor, n_global: float, mbs: list[Tensor],
                groups: Tensor | None, backward: Callable[[int, list[Tensor]], None], params: list, stats: dict,
                measure: bool) -> None:
        """``per_step`` strategies: one optimizer step's gradient (into the ``params``' .grad) from each term's own
        gradient; ``backward(k, micro_batches)`` back-propagates term k over micro-batches of ``rows`` (this rank's
        rows of the step, split in ``mbs``; ``n_global``: the step's rows on every rank). ``stats``: the update's
        per-optimizer-step diagnostics; ``measure``: also the terms of weight 0 (``auto``)."""
        raise NotImplementedError(f"train.weighting={self.name} weighs the terms' losses; it combines no gradients")

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, sd: dict | None) -> None:
        pass


class _Noise(Weighting):
    name = "noise"

    def weights(self, sampler, grid, trained, gains):
        if not trained:
            return None
        std = step_std(sampler, grid[:-1], grid[1:], t_guard=grid[1])
        return noise_weights(std[list(trained)])


class _GainVar(Weighting):
    name = "gain_var"

    def weights(self, sampler, grid, trained, gains):
        if not trained or gains is None:
            return None
        return gain_variance_weights(gains[:, list(trained)])


class _Guard(Weighting):
    name, guard = "guard", True


class _GuardReleased(_Guard):
    """GRPO-Guard's released loss (``config.rationorm = True``; yifan123/flow_grpo PR #175,
    scripts/train_sd3_GRPO_Guard.py L915-939, ``log π`` from sde_step_with_logprob L42-68 of
    flow_grpo/diffusers_patch/sd3_sde_with_logprob.py):

        s      = std_dev_t.mean() · sqrt_dt.mean()                          L916, L918-919  (σ_t·√Δt: the step's std)
        b      = (μ_θ − μ_old)².mean(dim=tuple(range(1, log_prob.ndim))) / (2 s²)   L917-918
        ρ̃      = exp( (log π_θ − log π_old + b) · s )                        L919
        L_step = mean_i max(−A_i ρ̃_i, −A_i clip(ρ̃_i, 1 ± ε)) / sqrt_dt.mean()²   L923-932  (÷ Δt)
        loss   = L_step + β·KL                                               L934-939  (β = 0 in the released configs)

    Here ρ̃_i = exp(mean_dims(ε_i ⊙ (μ_θ,i − μ_old,i))), ε = (x_{k+1} − μ_old)/s
    (:func:`~stepflow.math.loss.guard_log_ratio`, as ``guard``), and the ``÷ Δt`` is :meth:`policy_scale`. One deviation:
    ``log_prob`` is already (B,) there, so ``range(1, 1)`` is empty and ``mean(dim=())`` averages over **every**
    dimension, the batch included: the released b is the training batch's mean ``b̄``, not each row's ``b_i``, i.e.
    ``log ρ̃_i(released) = log ρ̃_i(here) + (b̄ − b_i)·s``. The two agree on a batch's first (on-policy) optimizer step
    (μ_θ = μ_old), for one-row batches and whenever the rows' ``mean_dims (μ_θ − μ_old)²`` are equal; elsewhere they
    differ at second order in the policy change. stepflow keeps the per-row bias (the per-sample formula, league.md
    §8, whose value does not depend on how the rows are batched)."""

    name = "guard_released"

    def policy_scale(self, t, t_next) -> Tensor:
        return guard_released_scale(t, t_next)


class _PerStep(Weighting):
    """``grad_rms`` and ``auto``: each trained step's gradient computed alone, then combined (:meth:`combine`)."""

    per_step = True

    def combine(self, learner, terms, rows, n_global, mbs, groups, backward, params, stats, measure) -> None:
        """Each trained step's gradient separately, summed from its parts (whole prompt groups; one group: two
        halves), then combined into the parameters' .grad: ``train.weighting=grad_rms``: ``Σ_k (rms/|g_k|)·g_k / S``;
        ``train.weighting=auto``: ``Σ_k w_k·(rms/|g_k|)·g_k`` with the signal weights w (sum 1) of
        :class:`stepflow.math.coherence.StepSignal`, to which every step computed adds a measurement from its parts' mean
        gradients (sums over ranks). Steps of weight 0 are computed only when ``measure``. Under DDP the per-step
        gradients are summed over ranks first, so the norms and the combination are those of the global gradients.
        ``groups``: (B_local,) the rows' group ids (None: one group)."""
        parts, sizes = _parts(rows, mbs, groups)
        sig = self.signal
        if sig is not None:
            w_all = sig.weights()
            todo = [k for k in terms if measure or float(w_all[sig.steps.index(k)]) > 0]
        else:
            todo = list(terms)
        n_params = sum(p.numel() for p in params)
        grads, sums = [], []
        for k in todo:
            vecs = []
            for part in parts:
                for p in params:
                    p.grad = None
                backward(k, part)
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


def _parts(rows: Tensor, mbs: list[Tensor], groups: Tensor | None) -> tuple[list[list[Tensor]], list[int]]:
    """The independent parts of an optimizer step's ``rows`` (whole prompt groups; one group only: two halves by
    position), each as its micro-batches' rows of it (``mbs`` split by part), and their sizes."""
    gid = groups[rows] if groups is not None else torch.zeros(len(rows), dtype=torch.long)
    if len(torch.unique(gid)) < 2:  # one group only: halves by position
        gid = (torch.arange(len(rows)) >= (len(rows) + 1) // 2).long()
    part_of = {int(r): int(g) for r, g in zip(rows, gid)}
    ids = sorted(set(part_of.values()))
    parts = [[mb[torch.tensor([part_of[int(r)] == g for r in mb])] for mb in mbs] for g in ids]
    parts = [[mb for mb in p if len(mb)] for p in parts]
    return parts, [sum(len(mb) for mb in p) for p in parts]


def _grad_vector(params: list) -> Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


class _GradRms(_PerStep):
    name = "grad_rms"


class _Auto(_PerStep):
    name = "auto"

    def __init__(self, steps: Sequence[int], warmup: int, every: int):
        self.signal = StepSignal(steps, warmup)
        self.every = every

    def measures(self, it: int) -> bool:
        return it % self.every == 0

    def state_dict(self) -> dict:
        return self.signal.state_dict()

    def load_state_dict(self, sd: dict | None) -> None:
        if sd is not None:
            self.signal.load_state_dict(sd)


def build_weighting(name: str, candidates: Sequence[int] = (), warmup: int = 3, every: int = 2) -> Weighting:
    """The strategy ``train.weighting=name``; ``auto`` measures the ``candidates`` steps (every step it may train)."""
    if name not in WEIGHTINGS:
        raise ValueError(f"train.weighting: must be one of {', '.join(WEIGHTINGS)}, got {name!r}")
    if name == "auto":
        return _Auto(candidates, warmup, every)
    return {"none": Weighting, "noise": _Noise, "gain_var": _GainVar, "guard": _Guard, "guard_released": _GuardReleased,
            "grad_rms": _GradRms}[name]()
