"""How the trained steps' loss terms enter one optimizer step: ``train.weighting``, one strategy chosen at build time.

=========  ===================================================================================================
none       every trained step's term weighs 1 (the mean over the steps)
noise      TempFlow-GRPO's noise-aware weights ``w_k = σ_k / mean_j σ_j`` over the trained steps (σ the step's std)
gain_var   ``w_k ∝ Var_i G_k``, the variance of step k's gains over every rank's rows
guard      GRPO-Guard's noise-normalised log-ratio in place of ``log π_θ − log π_old`` (:func:`~stepflow.loss.guard_log_ratio`)
           only (RatioNorm, as Flow-Factory implements it; the measured docs/results.md runs used it)
guard_released
           GRPO-Guard as released (yifan123/flow_grpo PR #175, scripts/train_sd3_GRPO_Guard.py L915-932): the same
           normalised ratio, and each step's policy loss divided by its ``Δt``
           (:func:`~stepflow.loss.guard_released_scale`)
grad_rms   each step's gradient computed alone and scaled to the RMS of their norms
auto       each step's gradient computed alone and weighted by its measured signal fraction
           (:class:`~stepflow.coherence.StepSignal`; steps of weight 0 are computed every ``train.auto_every``
           iterations to be measured again)
=========  ===================================================================================================

The weights (``noise``, ``gain_var``) are the loss weights of the terms and have mean 1; ``grad_rms`` and ``auto``
combine whole per-step gradients instead (``per_step``), so they cannot run where gradients are sharded.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from stepflow.coherence import StepSignal
from stepflow.loss import WEIGHTINGS, gain_variance_weights, guard_released_scale, noise_weights
from stepflow.sde import SamplerConfig, step_std

__all__ = ["Weighting", "build_weighting"]


class Weighting:
    """The ``none`` strategy and the interface of the others."""

    name = "none"
    per_step = False  #: each trained step's gradient is computed separately and then combined
    guard = False  #: the GRPO loss uses GRPO-Guard's normalised log-ratio
    signal: StepSignal | None = None  #: ``auto``: the online per-step signal estimate

    def weights(self, sampler: SamplerConfig, grid: Tensor, trained: Sequence[int], gains: Tensor | None) -> Tensor | None:
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
    (:func:`~stepflow.loss.guard_log_ratio`, as ``guard``), and the ``÷ Δt`` is :meth:`policy_scale`. One deviation:
    ``log_prob`` is already (B,) there, so ``range(1, 1)`` is empty and ``mean(dim=())`` averages over **every**
    dimension, the batch included: the released b is the training batch's mean ``b̄``, not each row's ``b_i``, i.e.
    ``log ρ̃_i(released) = log ρ̃_i(here) + (b̄ − b_i)·s``. The two agree on a batch's first (on-policy) optimizer step
    (μ_θ = μ_old), for one-row batches and whenever the rows' ``mean_dims (μ_θ − μ_old)²`` are equal; elsewhere they
    differ at second order in the policy change. stepflow keeps the per-row bias (the per-sample formula, league.md
    §8, whose value does not depend on how the rows are batched)."""

    name = "guard_released"

    def policy_scale(self, t, t_next) -> Tensor:
        return guard_released_scale(t, t_next)


class _GradRms(Weighting):
    name, per_step = "grad_rms", True


class _Auto(Weighting):
    name, per_step = "auto", True

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
