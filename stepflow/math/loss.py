"""GRPO clipped surrogate, Gaussian-policy KL and the distillation loss (method.md §2, §3.5, §5, §6.3; paper Eq. 3).

All per-step losses act on one denoising step of a batch: ``log_prob, old_log_prob, adv`` are (B,) and the result
is a mean over the (optionally masked) rows, as in Flow-GRPO's ``mean_i max(−Ã ρ, −Ã clip(ρ, 1±ε))`` + β·KL.
Statistics are returned as detached 0-d tensors (no host sync); call ``.item()`` when logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["grpo_surrogate", "gaussian_kl", "LossOut", "policy_loss", "distill_loss", "KL_MODES", "DISTILL_WEIGHTS",
           "WEIGHTINGS", "noise_weights", "gain_variance_weights", "rms_weights", "guard_log_ratio",
           "guard_released_scale"]

KL_MODES = ("exact", "flow_grpo_parity")
DISTILL_WEIGHTS = ("relu", "signed", "exp")


def _masked_mean(z: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of (B,) ``z`` over rows where ``mask`` (B,) bool is True (0 if none)."""
    if mask is None:
        return z.mean()
    w = mask.to(z.dtype)
    return (z * w).sum() / w.sum().clamp(min=1.0)


def grpo_surrogate(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, clip_eps: float, *,
                   mask: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate (paper Eq. 3, method.md §5), to be minimised.

    ``ρ = exp(lp − lp_old)``; ``loss = mean_i max(−A ρ, −A clip(ρ, 1−ε, 1+ε))``.
    log_prob (with grad), old_log_prob, adv: (B,); mask: optional (B,) bool of rows to average over.
    Returns ``(loss 0-d, stats)`` with stats ``clip_frac`` (fraction of rows with ``|ρ − 1| > ε``, Flow-GRPO's
    definition), ``ratio_mean``, ``ratio_min``, ``ratio_max`` as detached 0-d tensors (over masked rows).
    """
    if not clip_eps > 0:
        raise ValueError(f"clip_eps: must be > 0, got {clip_eps!r}")
    if not (log_prob.shape == old_log_prob.shape == adv.shape) or log_prob.ndim != 1:
        raise ValueError(f"log_prob/old_log_prob/adv: expected equal (B,) shapes, got "
                         f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(adv.shape)}")
    adv = adv.detach().to(log_prob.dtype)
    ratio = torch.exp(log_prob - old_log_prob.detach())
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = _masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        r = ratio.detach()
        rr = r if mask is None else r[mask]
        if rr.numel() == 0:
            rr = torch.ones(1, dtype=r.dtype, device=r.device)
        stats = {
            "clip_frac": _masked_mean(((r - 1.0).abs() > clip_eps).to(r.dtype), mask),
            "ratio_mean": rr.mean(),
            "ratio_min": rr.min(),
            "ratio_max": rr.max(),
        }
    return loss, stats


def gaussian_kl(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """Per-dim-mean KL( N(mean, std²I) ‖ N(ref_mean, std²I) ) = mean_dims((μ − μ_ref)²) / (2 std²) (method.md §2, §3.5).

    mean, ref_mean: (B, ...); std: (B,).  Returns (B,).  ``ref_mean`` is detached.  Rows with ``std == 0``
    (deterministic, untrainable steps) get 0 with zero gradient.  Passing Flow-GRPO's ``kl_scale`` (σ_d) as ``std``
    reproduces its ``flow_grpo_parity`` value, which for flow_sde is the exact KL × Δt.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(f"ref_mean: expected shape {tuple(mean.shape)}, got {tuple(ref_mean.shape)}")
    sq = ((mean - ref_mean.detach()) ** 2).reshape(mean.shape[0], -1).mean(dim=1)
    std = std.to(sq.dtype)
    live = std > 0
    safe = torch.where(live, std, torch.ones_like(std))
    return torch.where(live, sq / (2.0 * safe**2), torch.zeros_like(sq))


@dataclass
class LossOut:
    """loss = policy_loss + β·kl (0-d, with grad); the rest are detached 0-d tensors."""

    loss: Tensor
    policy_loss: Tensor
    kl: Tensor
    clip_frac: Tensor
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor


def policy_loss(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, *, clip_eps: float, mean: Tensor | None = None,
                ref_mean: Tensor | None = None, std: Tensor | None = None, kl_scale: Tensor | None = None,
                beta: float = 0.0, kl_mode: str = "exact", mask: Tensor | None = None,
                policy_scale: Tensor | float | None = None) -> LossOut:
    """One step's GRPO loss (paper Eq. 3): ``surrogate + β·mean_i KL_i`` (method.md §5).

    log_prob, old_log_prob, adv: (B,); mean, ref_mean: (B, ...) policy / reference Gaussian means; std, kl_scale:
    (B,) from :class:`stepflow.math.sde.StepOut`.  ``kl_mode="exact"`` divides by 2·std², ``"flow_grpo_parity"`` by
    2·kl_scale² (Flow-GRPO's value; = exact × Δt for flow_sde).  The KL is computed (and logged) whenever the
    means are given; it is required when ``beta > 0``.  mask: optional (B,) bool rows to average over.
    ``policy_scale``: a factor on the surrogate only, ``scale·surrogate + β·KL`` (GRPO-Guard's gradient reweight
    ``1/Δt``, :func:`guard_released_scale`); the logged ``policy_loss`` is the scaled one, as released.  None: 1.
    """
    if kl_mode not in KL_MODES:
        raise ValueError(f"kl_mode: must be one of {KL_MODES}, got {kl_mode!r}")
    if not beta >= 0:
        raise ValueError(f"beta: must be >= 0, got {beta!r}")
    surrogate, st = grpo_surrogate(log_prob, old_log_prob, adv, clip_eps, mask=mask)
    have_means = mean is not None and ref_mean is not None
    scale = std if kl_mode == "exact" else kl_scale
    if beta > 0 and (not have_means or scale is None):
        need = "std" if kl_mode == "exact" else "kl_scale"
        raise ValueError(f"beta: > 0 needs mean, ref_mean and {need}")
    if have_means and scale is not None:
        kl = _masked_mean(gaussian_kl(mean, ref_mean, scale), mask)
    else:
        kl = surrogate.new_zeros(())
    if policy_scale is not None:
        surrogate = surrogate * policy_scale
    loss = surrogate + beta * kl if beta > 0 else surrogate
    return LossOut(loss=loss, policy_loss=surrogate.detach(), kl=kl.detach(), clip_frac=st["clip_frac"],
                   ratio_mean=st["ratio_mean"], ratio_min=st["ratio_min"], ratio_max=st["ratio_max"])


def distill_loss(x0_student: Tensor, x0_target: Tensor, adv: Tensor, weight: str = "relu",
                 temperature: float = 1.0) -> Tensor:
    """Gain-weighted ODE progressive-distillation loss (method.md §6.3).

    ``L = mean_i w(A_i) · mean_dims (x̂0_student − sg[x̂0_target])²`` with ``w = relu(A)`` | ``A`` (signed) |
    ``exp(A/temperature)``.  Per-dim mean (not the sum ‖·‖²) so the scale does not depend on the latent size.
    x0_student (with grad), x0_target: (B, ...); adv: (B,) (detached).  Returns a 0-d tensor.
    """
    if weight not in DISTILL_WEIGHTS:
        raise ValueError(f"weight: must be one of {DISTILL_WEIGHTS}, got {weight!r}")
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature!r}")
    if x0_student.shape != x0_target.shape:
        raise ValueError(f"x0_target: expected shape {tuple(x0_student.shape)}, got {tuple(x0_target.shape)}")
    a = adv.detach().to(torch.float32)
    if weight == "relu":
        w = torch.relu(a)
    elif weight == "signed":
        w = a
    else:
        w = torch.exp(a / temperature)
    err = ((x0_student.float() - x0_target.detach().float()) ** 2).reshape(x0_student.shape[0], -1).mean(dim=1)
    return (w * err).mean()


# ----------------------------------------------------------------------------------------------------------------
# per-step weighting of the loss (docs/method.md §9; train.weighting)
# ----------------------------------------------------------------------------------------------------------------
WEIGHTINGS = ("none", "noise", "guard", "guard_released", "grad_rms", "gain_var", "auto")


def noise_weights(stds: Tensor) -> Tensor:
    """TempFlow-GRPO's noise-aware weighting: ``w_k = σ_k / mean_j σ_j`` over the trained steps, σ_k the step's noise
    std (σ_t·√Δt for flow_sde). stds: (S,) -> (S,), mean 1 (high-noise steps weigh more)."""
    s = stds.double()
    return (s / s.mean()).float()


def gain_variance_weights(gains: Tensor) -> Tensor:
    """Weights proportional to each trained step's gain variance over the batch: ``w_k = Var_i G_k / mean_j Var_i G_j``
    (a step whose gains barely vary carries little credit). gains: (B, S) -> (S,), mean 1; all-zero variance -> 1."""
    v = gains.double().var(dim=0, unbiased=False)
    if not bool((v > 0).any()):
        return torch.ones_like(v, dtype=torch.float32)
    return (v / v.mean()).float()


def rms_weights(norms: Tensor) -> Tensor:
    """Per-step gradient normalisation: ``w_k = sqrt(mean_j |g_j|²) / |g_k|``, so every trained step's gradient
    enters the update with the same norm (the RMS of their norms). norms: (S,) -> (S,); a zero norm gets 0."""
    n = norms.double()
    rms = n.pow(2).mean().sqrt()
    return torch.where(n > 0, rms / n.clamp(min=1e-300), torch.zeros_like(n)).float()


def guard_log_ratio(x_next: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """GRPO-Guard's normalised log-ratio ``s·(log π_θ − log π_old) + mean_dims((μ_θ − μ_old)²)/(2s)`` of a Gaussian step
    with std s, which equals ``mean_dims(ε ⊙ (μ_θ − μ_old))`` with ``ε = (x_next − μ_old)/s`` (so the 1/s blow-up of
    the log-ratio at low-noise steps disappears). x_next, mean (with grad), old_mean: (B, ...); std: (B,) -> (B,).
    Rows with std 0 give 0."""
    s = std.to(mean.dtype)
    live = s > 0
    safe = torch.where(live, s, torch.ones_like(s)).view(-1, *([1] * (mean.ndim - 1)))
    eps = (x_next.detach() - old_mean.detach()) / safe
    lr = (eps * (mean - old_mean.detach())).reshape(mean.shape[0], -1).mean(dim=1)
    return torch.where(live, lr, torch.zeros_like(lr))


def guard_released_scale(t, t_next) -> Tensor:
    """GRPO-Guard's gradient reweight as released: the step's policy loss divided by ``sqrt_dt.mean()**2 = Δt``
    (yifan123/flow_grpo PR #175, ``scripts/train_sd3_GRPO_Guard.py`` L931-932, ``policy_loss = policy_loss /
    (sqrt_dt.mean()**2)``, with ``sqrt_dt = sqrt(−dt)`` from ``sde_step_with_logprob(..., return_sqrt_dt=True)``,
    ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`` L47, L91-92). The released rows of a step share its time,
    so the batch mean is the step's ``Δt = t − t_next``. t, t_next: floats or 0-d tensors -> 0-d fp32 ``1/Δt``.

    With the normalised ratio ρ̃ = exp(mean(ε ⊙ (μ_θ − μ_old))) (:func:`guard_log_ratio`) and the Flow-SDE mean
    ``μ = x − Δt·[v + σ_d²/(2t)·(x + (1 − t)·v)]``, ``∂ρ̃/∂v = −Δt·(1 + σ_d²(1 − t)/(2t))·ε/D`` at ρ̃ = 1: the factor
    cancels the Δt of the mean, so every step's gradient w.r.t. its velocity has the same scale (the released
    "Gradient Reweight"); on a shift-3 SD3 grid of 10 steps it weighs step 0 (Δt = .040) 25× and step 8 (Δt = .269)
    3.7×, so relative to step 8 step 0's weight grows 6.7×. On a grid of equal steps it is a constant factor."""
    dt = torch.as_tensor(t, dtype=torch.float32) - torch.as_tensor(t_next, dtype=torch.float32)
    if dt.ndim != 0:
        raise ValueError(f"t, t_next: the step's times must be scalars (one grid step), got shape {tuple(dt.shape)}")
    return 1.0 / dt  # the grid is strictly decreasing (policies.base.check_time_grid): Δt > 0, no host sync here
