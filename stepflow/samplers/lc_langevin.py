"""LC-GRPO's rollout kernel (arXiv 2608.05600, Guo, Yuan, He, Wang, Ding; no released code: from the paper's text as
restated in ../shared/spec/followups.md §3.6 and a detailed write-up of the paper): an inference-aligned ODE Euler
predictor followed by one Langevin corrector at the next time (``conf/sampler/lc_langevin.yaml``).

From ``t`` to ``s = t − Δt``::

    x'   = x − Δt·v_θ(x, t)                                    (predictor: the test-time Euler step)
    s_θ  = −(x' + (1 − s)·v_θ(x', s)) / s                      (the score of p_s from the velocity, Tweedie)
    x_s  = x' + ε_s·s_θ + sqrt(2 ε_s)·ξ,   sqrt(2 ε_s) = η·s    (corrector: one Langevin step toward p_s)

so the transition is N(m_θ, 2 ε_s I) with ``m_θ = x' + ε_s·s_θ = x' − (η² s / 2)·(x' + (1 − s)·v_θ(x', s))`` and
``std = η·s``: two model evaluations per step (the second at (x', s)), both differentiated in the update (the paper
found stop-grad through the corrector worse; ``corrector_grad=false`` is that ablation), the corrector's without CFG
(the paper's choice; ``corrector_cfg=true`` uses the run's scale). The last step (s = 0) has no noise: it is the pure
ODE step and costs one evaluation. The log-prob is the per-dim-mean Gaussian of the step (constants kept), so the GRPO
ratio, clipping and KL apply unchanged.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from stepflow.math.sde import _bcast, finish_step, prepare_step
from stepflow.samplers.base import Sampler, check_bool, check_logprob, grid_times

__all__ = ["LcLangevin", "lc_langevin_step"]


def lc_langevin_step(x, v, t, t_next, *, eta: float, velocity, noise=None, prev_sample=None, generator=None,
                     logprob: str = "gaussian", corrector_cfg: bool = False, corrector_grad: bool = True):
    """One LC-GRPO step (the module docstring). x, v: (B, ...); t, t_next: float / 0-d / (B,); ``velocity(z, t,
    guided)``: the model, evaluated once more at (x', s) for the rows with s > 0 (none when every s is 0: the ODE
    step). ``kl_scale = std = η·s`` (the exact KL of two such steps divides by 2 std²)."""
    x, v, t, s = prepare_step(x, v, t, t_next)
    x_pred = x - _bcast(t - s, x) * v  # the Euler predictor
    std = eta * s
    live = std > 0
    if bool(live.any()):
        with contextlib.nullcontext() if corrector_grad else torch.no_grad():  # the update's autograd mode, or none
            v2 = velocity(x_pred, s, corrector_cfg).float()  # at (x', s): the second NFE
        half_eps_over_s = eta * eta * s / 2.0  # ε_s / s with ε_s = (η s)² / 2: no division by s
        mean = x_pred - _bcast(half_eps_over_s, x) * (x_pred + _bcast(1.0 - s, x) * v2)
        mean = torch.where(_bcast(live, x), mean, x_pred)
    else:
        mean = x_pred
    return finish_step(x, mean, std, std, noise=noise, prev_sample=prev_sample, generator=generator, logprob=logprob)


@dataclass
class LcLangevin(Sampler):
    """eta: the corrector's noise scale, ``sqrt(2 ε_s) = η·s`` (>= 0); corrector_cfg: the corrector's velocity under
    the run's CFG scale (the paper: without CFG); corrector_grad: the update differentiates through the corrector's
    velocity (the paper's default; False = its stop-grad ablation); logprob: the log-prob convention."""

    name = "lc_langevin"
    noise_field = "sampler.eta"
    nfe_per_step = 2  #: the predictor's velocity and the corrector's (the core passes ``velocity``)

    eta: float = 0.7
    corrector_cfg: bool = False
    corrector_grad: bool = True
    logprob: str = "gaussian"

    def __post_init__(self) -> None:
        check_logprob(self.logprob)
        if not (isinstance(self.eta, (int, float)) and not isinstance(self.eta, bool) and math.isfinite(self.eta)
                and self.eta >= 0):
            raise ValueError(f"eta: must be a finite float >= 0 for lc_langevin, got {self.eta!r}")
        check_bool("corrector_cfg", self.corrector_cfg)
        check_bool("corrector_grad", self.corrector_grad)

    def std(self, t, t_next, t_guard=None):
        return self.eta * grid_times(t, t_next)[1]

    def step(self, x, v, t, t_next, *, t_guard=None, noise=None, prev_sample=None, generator=None, velocity=None):
        if velocity is None:
            raise ValueError("velocity: sampler=lc_langevin evaluates the model again at the predictor's state; pass "
                             "velocity=(z, t, guided=True) -> v (stepflow.math.sde.sde_step)")
        return lc_langevin_step(x, v, t, t_next, eta=self.eta, velocity=velocity, noise=noise, prev_sample=prev_sample,
                                generator=generator, logprob=self.logprob, corrector_cfg=self.corrector_cfg,
                                corrector_grad=self.corrector_grad)

    def requirements(self, s) -> list[str]:
        """GRPO-Guard's old mean needs the rollout's corrector velocity under π_old, which no trajectory keeps."""
        from stepflow.math.weighting import build_weighting

        if build_weighting(s.train.weighting).guard:
            return [f"train.weighting={s.train.weighting}: GRPO-Guard's ratio needs the old policy's corrector "
                    "velocity, which sampler=lc_langevin does not keep; use train.weighting=none (or noise)"]
        return []

    def describe(self) -> str:
        return f"{self.name} (eta {self.eta:g})"
