"""Time grid and one-step stochastic samplers with Gaussian log-probs (method.md §1–§3).

Conventions (method.md §1):

- rectified flow ``x_t = (1 - t) x0 + t x1``, ``x1 ~ N(0, I)``; ``t = 1`` is noise, ``t = 0`` is data;
- the model predicts ``v = x1 - x0``; ``x̂0 = x - t v`` (Tweedie), ``x̂1 = x + (1 - t) v``;
- a step goes from ``t`` to ``t_next = s = t - Δt`` (``Δt > 0``) on the grid of :func:`time_grid`;
- all math is fp32; inputs are promoted with ``.float()`` (differentiable);
- log-probs are **means over all non-batch dims** (Flow-GRPO convention, method.md §2), so a clip range of 1e-4 keeps
  its meaning; the sampled state is treated as a constant action (``next.detach()``) inside the log-prob.

Times ``t, t_next`` may be python floats, 0-d tensors or per-sample ``(B,)`` tensors, so steps at different grid
indices can be batched together.  Per-sample quantities (``std``, ``log_prob``, ...) are always ``(B,)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: a :class:`stepflow.samplers.base.Sampler` (not imported here: the samplers import this module's math)
Sampler = Any

__all__ = [
    "time_grid",
    "fastvideo_time_grid",
    "TIME_GRIDS",
    "StepOut",
    "SamplerConfig",
    "SAMPLERS",
    "DDIM_SCHEDULES",
    "LOGPROBS",
    "sde_step",
    "step_std",
    "flow_sde_std",
    "dance_sde_std",
    "ddim_sde_std",
    "cps_std",
    "flow_sde_step",
    "dance_sde_step",
    "ddim_sde_step",
    "cps_step",
    "ode_step",
    "gaussian_log_prob",
    "prepare_step",
    "finish_step",
]

#: the package's config directory (``conf/<group>/<option>.yaml``)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
DDIM_SCHEDULES = ("eta_s_sqrt1mt", "eta_s", "eta_t_sqrt1mt")
LOGPROBS = ("gaussian", "cps_constfree")
#: the sampling grids of ``loop.time_grid``: the policy's own (diffusers' scheduler) or FastVideo's (DanceGRPO)
TIME_GRIDS = ("model", "fastvideo")
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


# ----------------------------------------------------------------------------------------------------------------
# §1 time grid
# ----------------------------------------------------------------------------------------------------------------
def time_grid(num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000) -> Tensor:
    """SD3's shifted sigma grid with a trailing 0 (method.md §1).

    ``shift(u) = shift·u / (1 + (shift − 1)·u)``; ``σ_min = shift(1/num_train_timesteps)``;
    ``base = linspace(1, σ_min, num_steps)``; ``τ = shift(base)``; then ``0`` is appended.
    (The shift is applied twice, exactly as diffusers' ``FlowMatchEulerDiscreteScheduler`` does: once at
    construction for ``σ_min`` and once in ``set_timesteps``.)  For ``num_steps=10, shift=3`` this is
    ``[1, .9601, .9133, .8577, .7904, .7073, .6022, .4649, .2780, .0089, 0]``.

    Returns: ``(num_steps + 1,)`` fp32, strictly decreasing from exactly 1.0 to exactly 0.0.
    """
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps: must be a positive integer, got {num_steps!r}")
    if not shift > 0:
        raise ValueError(f"shift: must be > 0, got {shift!r}")

    def _shift(u: Tensor | float):
        return shift * u / (1.0 + (shift - 1.0) * u)

    sigma_min = _shift(1.0 / num_train_timesteps)
    base = torch.linspace(1.0, sigma_min, int(num_steps), dtype=torch.float64)
    tau = _shift(base)
    return torch.cat([tau, tau.new_zeros(1)]).to(torch.float32)


def fastvideo_time_grid(num_steps: int, shift: float = 3.0) -> Tensor:
    """The FastVideo-based repos' grid (DanceGRPO, MixGRPO, G²RPO): ``sd3_time_shift(shift, linspace(1, 0, N+1))``.

    ``sd3_time_shift(s, t) = s·t / (1 + (s − 1)·t)``, applied **once** to a uniform grid that already ends at 0: no
    σ_min, no appended 0 (XueZeyue/DanceGRPO@15cc71d fastvideo/train_grpo_flux.py L127-128, L311-313; computed in
    fp32 as there). Unlike :func:`time_grid` (diffusers' double shift with σ_min), its last step runs from
    ``shift(1/N)`` to exactly 0. For ``num_steps=10, shift=1`` it is ``linspace(1, 0, 11)``.

    Returns: ``(num_steps + 1,)`` fp32, strictly decreasing from exactly 1.0 to exactly 0.0.
    """
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps: must be a positive integer, got {num_steps!r}")
    if not (isinstance(shift, (int, float)) and math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift: must be a finite float > 0, got {shift!r}")
    u = torch.linspace(1, 0, int(num_steps) + 1)
    return (shift * u) / (1 + (shift - 1) * u)


# ----------------------------------------------------------------------------------------------------------------
# config and output types
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class StepOut:
    """Result of one sampler step, ``B`` = batch size.

    next:     (B, ...) the next state ``x_s`` (``prev_sample`` when one was given).
    mean:     (B, ...) the Gaussian mean ``μ_θ`` (differentiable w.r.t. ``v``).
    std:      (B,) per-sample std of the step; 0 = deterministic.
    log_prob: (B,) log π(next | x) (mean over non-batch dims); 0 where ``std == 0``.
    trainable:(B,) bool, ``std > 0``.
    kl_scale: (B,) the std Flow-GRPO's KL divides by: ``σ_d`` (no √Δt) for flow_sde, η (the constant diffusion
              coefficient, no √Δt) for dance_sde, ``std`` otherwise (method.md §2, §2.1).
    """

    next: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor
    trainable: Tensor
    kl_scale: Tensor


def SamplerConfig(name: str, **fields: Any) -> Sampler:  # noqa: N802 - the name of the old config class
    """The sampler of option ``name`` (``conf/sampler/<name>.yaml``: its ``_target_`` class, with the YAML's fields
    updated by ``fields``), for code and tests that build a sampler by its option name.
    See :class:`stepflow.samplers.base.Sampler` and :mod:`stepflow.samplers`."""
    from stepflow.core.parts import CONF_DIR, from_option

    return from_option("sampler", name, [CONF_DIR], key="name", **fields)


#: the package's sampler options (``conf/sampler/*.yaml``)
SAMPLERS = tuple(sorted(p.stem for p in (CONF_DIR / "sampler").glob("*.yaml")))


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def _as_time(t, batch: int | None, device=None) -> Tensor:
    """A time (float, 0-d or (B,) tensor) as an fp32 tensor: (B,) when ``batch`` is given, else its own shape."""
    t = torch.as_tensor(t, dtype=torch.float32, device=device)
    if batch is not None:
        if t.ndim == 0:
            t = t.expand(batch)
        elif t.shape != (batch,):
            raise ValueError(f"t: expected a scalar or shape ({batch},), got {tuple(t.shape)}")
    return t


def _bcast(t: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ..., 1) to broadcast against ``like`` (B, ...)."""
    return t.view(-1, *([1] * (like.ndim - 1)))


def _guarded(t: Tensor, t_guard, what: str) -> Tensor:
    """``t`` with entries equal to 1 replaced by ``t_guard`` (Flow-GRPO's ``where(sigma == 1, sigma_max, sigma)``)."""
    at_one = t == 1.0
    if t_guard is None:  # only then do we need to look at the values (a host sync)
        if bool(at_one.any()):
            raise ValueError(f"t_guard: required for {what} when t == 1 (pass τ_1 of the grid)")
        return t
    return torch.where(at_one, torch.as_tensor(t_guard, dtype=t.dtype, device=t.device), t)


def _mean_dims(z: Tensor) -> Tensor:
    """Mean over all non-batch dims: (B, ...) -> (B,)."""
    return z.reshape(z.shape[0], -1).mean(dim=1)


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor, kind: str = "gaussian") -> Tensor:
    """Per-sample log-prob of ``x`` under N(mean, std² I), averaged over non-batch dims (method.md §2, §3.5).

    x, mean: (B, ...); std: (B,).  ``kind="gaussian"``: ``mean_dims[−(x−μ)²/(2 std²) − log std − ½ log 2π]``;
    ``kind="cps_constfree"``: ``−mean_dims (x−μ)²`` (FlowCPS).  Rows with ``std == 0`` get 0 (no density; they are
    untrainable) with finite, zero gradients.  ``x`` is detached (the action is a constant).  Returns (B,).
    """
    if kind not in LOGPROBS:
        raise ValueError(f"logprob: must be one of {LOGPROBS}, got {kind!r}")
    live = std > 0
    sq = (x.detach() - mean) ** 2
    if kind == "cps_constfree":
        lp = -_mean_dims(sq)
    else:
        safe = torch.where(live, std, torch.ones_like(std))
        sb = _bcast(safe, sq)
        lp = _mean_dims(-sq / (2.0 * sb**2)) - torch.log(safe) - _HALF_LOG_2PI
    return torch.where(live, lp, torch.zeros_like(lp))


def finish_step(x: Tensor, mean: Tensor, std: Tensor, kl_scale: Tensor, *, noise=None, prev_sample=None, generator=None,
                logprob: str = "gaussian") -> StepOut:
    """The end of every Gaussian step (a sampler's, the package's or a user's): the next state ``mean + std·noise``
    (``noise ~ N(0, I)`` from ``generator`` when None), or ``prev_sample`` when given (the update re-evaluating the
    rollout's action), and its log-prob under ``logprob``'s convention. mean: (B, ...); std, kl_scale: (B,)."""
    std = std.to(mean.dtype)
    if prev_sample is not None:
        nxt = prev_sample.float()
        if nxt.shape != mean.shape:
            raise ValueError(f"prev_sample: expected shape {tuple(mean.shape)}, got {tuple(nxt.shape)}")
    else:
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        elif noise.shape != mean.shape:
            raise ValueError(f"noise: expected shape {tuple(mean.shape)}, got {tuple(noise.shape)}")
        nxt = mean + _bcast(std, mean) * noise.float()
    lp = gaussian_log_prob(nxt, mean, std, logprob)
    return StepOut(next=nxt, mean=mean, std=std, log_prob=lp, trainable=std > 0, kl_scale=kl_scale.to(mean.dtype))


def prepare_step(x: Tensor, v: Tensor, t, t_next):
    """The start of every step: x, v in fp32 (shapes checked) and the times as (B,) fp32 tensors."""
    x = x.float()
    v = v.float()
    if x.shape != v.shape:
        raise ValueError(f"v: expected shape {tuple(x.shape)}, got {tuple(v.shape)}")
    b = x.shape[0]
    return x, v, _as_time(t, b, x.device), _as_time(t_next, b, x.device)


# ----------------------------------------------------------------------------------------------------------------
# per-step std (no state needed)
# ----------------------------------------------------------------------------------------------------------------
def _flow_sigma_d(t: Tensor, a: float, t_guard) -> Tensor:
    """Flow-GRPO ``σ_d = a·sqrt(t / (1 − t̃))``, ``t̃ = t_guard`` where ``t == 1`` (method.md §2)."""
    return a * torch.sqrt(t / (1.0 - _guarded(t, t_guard, "flow_sde")))


def _ddim_sigma(t: Tensor, s: Tensor, eta: float, schedule: str, first_step_guard: bool, t_guard) -> Tensor:
    """DDIM per-step std σ (method.md §3.3)."""
    if schedule == "eta_s":
        return eta * s
    tt = _guarded(t, t_guard, "ddim_sde first_step_guard") if first_step_guard else t
    root = torch.sqrt(torch.clamp(1.0 - tt, min=0.0))
    if schedule == "eta_s_sqrt1mt":
        return eta * s * root
    if schedule == "eta_t_sqrt1mt":
        return eta * t * root
    raise ValueError(f"schedule: must be one of {DDIM_SCHEDULES}, got {schedule!r}")


def flow_sde_std(t: Tensor, s: Tensor, a: float, t_guard=None) -> Tensor:
    """Flow-GRPO's per-step std ``σ_d·sqrt(Δt)`` (method.md §2). t, s: fp32 tensors of one shape."""
    return _flow_sigma_d(t, a, t_guard) * torch.sqrt(t - s)


def dance_sde_std(t: Tensor, s: Tensor, eta: float) -> Tensor:
    """DanceGRPO's per-step std ``η·sqrt(Δt)`` (method.md §2.1). t, s: fp32 tensors of one shape."""
    return eta * torch.sqrt(t - s)


def ddim_sde_std(t: Tensor, s: Tensor, eta: float, schedule: str, first_step_guard: bool, t_guard=None) -> Tensor:
    """The DDIM per-step std σ of ``schedule`` (method.md §3.3 table). t, s: fp32 tensors of one shape."""
    return _ddim_sigma(t, s, eta, schedule, first_step_guard, t_guard)


def cps_std(t: Tensor, s: Tensor, eta: float) -> Tensor:
    """FlowCPS's per-step std ``s·sin(η π/2)`` (method.md §3.3). t, s: fp32 tensors of one shape."""
    return s * math.sin(eta * math.pi / 2.0)


def step_std(sampler: Sampler, t, t_next, t_guard=None) -> Tensor:
    """Per-step std of ``sampler`` from ``t`` to ``t_next``: ``sampler.std(t, t_next, t_guard)`` (method.md §2, §3.3
    table). t, t_next: floats, 0-d or (B,) tensors.  Returns an fp32 tensor of their broadcast shape."""
    return sampler.std(t, t_next, t_guard)


# ----------------------------------------------------------------------------------------------------------------
# samplers
# ----------------------------------------------------------------------------------------------------------------
def flow_sde_step(x: Tensor, v: Tensor, t, t_next, *, a: float = 0.7, t_guard=None, noise: Tensor | None = None,
                  prev_sample: Tensor | None = None, generator: torch.Generator | None = None,
                  logprob: str = "gaussian") -> StepOut:
    """Flow-GRPO Euler–Maruyama step of the marginal-preserving reverse SDE (method.md §2, paper Eq. 1).

    ``σ_d = a·sqrt(t/(1−t̃))`` (``t̃ = t_guard`` where ``t == 1``), ``std = σ_d·sqrt(Δt)``,
    ``μ = x − Δt·[v + σ_d²/(2t)·(x + (1−t) v)]``; we use the identity ``σ_d²/(2t) = a²/(2(1−t̃))`` (no 0/0).
    x, v: (B, ...); t, t_next: float / 0-d / (B,).  ``kl_scale = σ_d``.
    """
    x, v, t, s = prepare_step(x, v, t, t_next)
    dt = t - s
    t_til = _guarded(t, t_guard, "flow_sde")
    sigma_d = a * torch.sqrt(t / (1.0 - t_til))
    half_var_over_t = (a * a) / (2.0 * (1.0 - t_til))  # = σ_d² / (2t)
    drift = v + _bcast(half_var_over_t, x) * (x + _bcast(1.0 - t, x) * v)
    mean = x - _bcast(dt, x) * drift
    std = sigma_d * torch.sqrt(dt)
    return finish_step(x, mean, std, sigma_d, noise=noise, prev_sample=prev_sample, generator=generator, logprob=logprob)


def dance_sde_step(x: Tensor, v: Tensor, t, t_next, *, eta: float = 0.3, noise: Tensor | None = None,
                   prev_sample: Tensor | None = None, generator: torch.Generator | None = None,
                   logprob: str = "gaussian") -> StepOut:
    """DanceGRPO's Euler–Maruyama step with a constant diffusion coefficient η (method.md §2.1).

    As released (XueZeyue/DanceGRPO@15cc71d fastvideo/train_grpo_flux.py ``flux_step`` L131-168, ``sde_solver=True``;
    the Qwen-Image, Hunyuan and Wan scripts carry the same step): with ``dσ = t_next − t = −Δt``,
    ``x̂0 = x − t·v``, score ``s = −(x − (1 − t)·x̂0)/t²``, ``μ = x + dσ·v + dσ·(−½η²·s)``, ``std = η·sqrt(Δt)``.
    Since ``x − (1 − t)·x̂0 = t·(x + (1 − t)·v)`` this is ``μ = x − Δt·[v + η²/(2t)·(x + (1 − t)·v)]``, the Flow-GRPO
    mean (§2) with ``σ_d`` replaced by the constant η. t = 1 needs no guard (it divides by t, not 1 − t); t = 0 is
    never a step's start. The log-prob is the per-dim-mean Gaussian (the released one, constants kept).
    x, v: (B, ...); t, t_next: float / 0-d / (B,).  ``kl_scale = η`` (the diffusion coefficient without √Δt, as
    flow_sde's σ_d: ``kl_mode=flow_grpo_parity`` is then the exact KL × Δt for both).
    """
    x, v, t, s = prepare_step(x, v, t, t_next)
    dt = t - s
    drift = v + _bcast((eta * eta) / (2.0 * t), x) * (x + _bcast(1.0 - t, x) * v)
    mean = x - _bcast(dt, x) * drift
    std = eta * torch.sqrt(dt)
    return finish_step(x, mean, std, torch.full_like(t, float(eta)), noise=noise, prev_sample=prev_sample,
                   generator=generator, logprob=logprob)


def _xhat_step(x: Tensor, v: Tensor, t: Tensor, s: Tensor, sigma: Tensor) -> Tensor:
    """``(1−s)·x̂0 + sqrt(max(s² − σ², 0))·x̂1`` with ``x̂0 = x − t v``, ``x̂1 = x + (1−t) v`` (method.md §3.1)."""
    x0 = x - _bcast(t, x) * v
    x1 = x + _bcast(1.0 - t, x) * v
    c = torch.sqrt(torch.clamp(s * s - sigma * sigma, min=0.0))
    return _bcast(1.0 - s, x) * x0 + _bcast(c, x) * x1


def ddim_sde_step(x: Tensor, v: Tensor, t, t_next, *, eta: float = 0.9, schedule: str = "eta_s_sqrt1mt",
                  first_step_guard: bool = False, t_guard=None, noise: Tensor | None = None,
                  prev_sample: Tensor | None = None, generator: torch.Generator | None = None,
                  logprob: str = "gaussian") -> StepOut:
    """DDIM-style SDE step (method.md §3.1, §3.3; paper Sec. 5.5 / App. B).

    ``x_s = (1−s)·x̂0 + sqrt((s² − σ²)₊)·x̂1 + σ·ε`` with σ from ``schedule`` (see :class:`stepflow.samplers.DdimSde`).
    x, v: (B, ...); t, t_next: float / 0-d / (B,).  ``kl_scale = std = σ``.
    """
    x, v, t, s = prepare_step(x, v, t, t_next)
    sigma = _ddim_sigma(t, s, eta, schedule, first_step_guard, t_guard)
    mean = _xhat_step(x, v, t, s, sigma)
    return finish_step(x, mean, sigma, sigma, noise=noise, prev_sample=prev_sample, generator=generator, logprob=logprob)


def cps_step(x: Tensor, v: Tensor, t, t_next, *, eta: float = 0.9, noise: Tensor | None = None,
             prev_sample: Tensor | None = None, generator: torch.Generator | None = None,
             logprob: str = "gaussian") -> StepOut:
    """FlowCPS step (method.md §3.3 [CODE]): ``std = s·sin(η π/2)``, ``μ = x̂0(1−s) + x̂1·sqrt(s² − std²)``.

    FlowCPS itself uses ``logprob="cps_constfree"``.  x, v: (B, ...); t, t_next: float / 0-d / (B,).
    """
    x, v, t, s = prepare_step(x, v, t, t_next)
    std = s * math.sin(eta * math.pi / 2.0)
    mean = _xhat_step(x, v, t, s, std)
    return finish_step(x, mean, std, std, noise=noise, prev_sample=prev_sample, generator=generator, logprob=logprob)


def ode_step(x: Tensor, v: Tensor, t, t_next, *, prev_sample: Tensor | None = None) -> StepOut:
    """Deterministic Euler step ``x − Δt·v`` (std 0, log_prob 0, untrainable, kl_scale 0).

    x, v: (B, ...); t, t_next: float / 0-d / (B,).  ``prev_sample``, if given, is returned as ``next``.
    """
    x, v, t, s = prepare_step(x, v, t, t_next)
    mean = x - _bcast(t - s, x) * v
    zero = torch.zeros_like(t)
    nxt = mean if prev_sample is None else prev_sample.float()
    return StepOut(next=nxt, mean=mean, std=zero, log_prob=zero.clone(), trainable=zero > 0, kl_scale=zero.clone())


def sde_step(sampler: Sampler, x: Tensor, v: Tensor, t, t_next, *, t_guard=None, noise: Tensor | None = None,
             prev_sample: Tensor | None = None, generator: torch.Generator | None = None,
             velocity=None) -> StepOut:
    """One step of ``sampler`` from ``t`` to ``t_next``: ``sampler.step(...)`` (see the per-sampler functions).

    x, v: (B, ...) (promoted to fp32); t, t_next: float, 0-d or (B,) tensors; ``t_guard`` = τ_1 of the grid.
    If ``prev_sample`` is given it becomes ``next`` and the log-prob is evaluated at it (recomputing log π_θ with
    gradients through ``v``); otherwise ``next = mean + std·noise`` (``noise ~ N(0, I)`` from ``generator`` if None).
    A multistep sampler (dpm2) takes its one-step form here (Euler); its rollout is :func:`stepflow.core.rollout.rollout`.
    ``velocity``: the model as ``velocity(z, t, guided=True) -> v``, for a sampler whose step evaluates it again
    (``sampler.nfe_per_step > 1``, e.g. lc_langevin's corrector; required there, not passed to the others).
    """
    if getattr(sampler, "nfe_per_step", 1) <= 1:
        return sampler.step(x, v, t, t_next, t_guard=t_guard, noise=noise, prev_sample=prev_sample, generator=generator)
    if velocity is None:
        raise ValueError(f"velocity: sampler={sampler.name} evaluates the model {sampler.nfe_per_step} times a step; "
                         "pass velocity=(z, t, guided=True) -> v")
    return sampler.step(x, v, t, t_next, t_guard=t_guard, noise=noise, prev_sample=prev_sample, generator=generator,
                        velocity=velocity)
