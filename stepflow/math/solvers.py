"""Deterministic multistep solvers on x̂0-predictions: DiffusionNFT's ``dpm2`` rollout sampler, and MixGRPO-Flash's
post-window DPM-Solver++(2M) tail on a compressed grid (:func:`flash_grid`, :func:`flash_tail`; end of the module).

A transcription of NVlabs/DiffusionNFT (commit 24af555) ``flow_grpo/diffusers_patch/solver.py``,
``run_sampling(..., solver="dpm2", determistic=True)`` (its ``dpm_step``, ``convert_model_output``, ``ddim_update``
with ``eta=0`` and ``multistep_dpm_solver_second_order_update``): multistep DPM-Solver++(2M) for rectified flow,
i.e. diffusers' ``DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2,
solver_type="midpoint", prediction_type="flow_prediction", use_flow_sigmas=True, final_sigmas_type="zero")``.

Conventions (as :mod:`stepflow.math.sde`): ``x_t = (1 − t)·x0 + t·ε`` (``t = 1`` noise, ``t = 0`` data), so
``α_t = 1 − t`` and ``σ_t = t``; the model's velocity is ``v ≈ ε − x0`` and ``x̂0 = x − t·v``; the log-SNR is
``λ(t) = log α_t − log σ_t = log((1 − t)/t)`` (``−inf`` at ``t = 1``, ``+inf`` at ``t = 0``).  A step goes from
``t`` to ``t_next < t``; ``t_prev > t`` is the previous grid point (the one the previous x̂0 was predicted at).
States are fp32 (inputs promoted with ``.float()``); the step coefficients are computed in fp64 from the times and
cast to fp32 before they multiply a state (the released code's ``sigmas.to(torch.float64)``).  Times may be python
floats, 0-d tensors or per-sample ``(B,)`` tensors.

Which order each step of an ``N``-step grid takes (:func:`dpm_order`, released ``dpm_step`` lines 218–253):
step 0 is first order (no previous x̂0: ``lower_order_nums < 1``), the last step ``N − 1`` is first order
(``lower_order_final``; at ``t_next = 0`` the second-order update divides by ``r0 = 0``), every other step is
second order.  The released code's ``lower_order_second`` (``k == N − 2 and N < 15``) only demotes a *third*-order
solver to second order: with ``order == 2`` the ``elif order == 2 or ...`` branch is taken regardless, so for
``dpm2`` the second-to-last step is second order at every ``N``.  Both first-order fallbacks go through the released
``ddim_update(eta=0)``, i.e. DDIM η = 0 (= Euler ``x − Δt·v`` up to rounding).

At ``t_prev = 1`` (step 1 of a grid starting at exactly 1, as SD3's does): ``λ(t_prev) = −inf``, so ``h_0 = +inf``,
``r0 = +inf`` and ``D1 = (1/r0)·(x̂0 − x̂0_prev) = 0``: the released second-order update degenerates to the first-order
DPM-Solver++ step (= DDIM η = 0) there, and so does this one (same IEEE arithmetic, no special case).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from stepflow.math.sde import StepOut, _as_time, _bcast

__all__ = [
    "DPM_ORDERS",
    "dpm_order",
    "dpm2_orders",
    "log_snr",
    "x0_from_v",
    "ddim0_update",
    "dpm2_second_order_update",
    "dpm2_update",
    "dpm2_step",
    "flash_num_post",
    "flash_grid",
    "flash_orders",
    "flash_tail",
]

#: solver orders implemented (the released code asserts False for a third order)
DPM_ORDERS = (1, 2)


def dpm_order(k: int, num_steps: int, solver_order: int = 2) -> int:
    """The order step ``k`` (``0 ≤ k < num_steps``) of a ``num_steps``-step grid takes (released ``dpm_step``).

    ``lower_order_final = k == N − 1``; ``lower_order_second = k == N − 2 and N < 15``; ``lower_order_nums =
    min(k, solver_order)`` (one increment per earlier step, capped); then ``1`` if ``solver_order == 1 or
    lower_order_nums < 1 or lower_order_final``, else ``2`` (``elif solver_order == 2 or lower_order_nums < 2 or
    lower_order_second``).  For ``solver_order=2``: ``1`` at ``k = 0`` and ``k = N − 1``, ``2`` elsewhere.
    """
    if solver_order not in DPM_ORDERS:
        raise ValueError(f"solver_order: must be one of {DPM_ORDERS}, got {solver_order!r}")
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps: must be a positive integer, got {num_steps!r}")
    if int(k) != k or not 0 <= k < num_steps:
        raise ValueError(f"k: must be an integer in 0..{num_steps - 1}, got {k!r}")
    lower_order_final = k == num_steps - 1
    lower_order_second = k == num_steps - 2 and num_steps < 15
    lower_order_nums = min(k, solver_order)
    if solver_order == 1 or lower_order_nums < 1 or lower_order_final:
        return 1
    if solver_order == 2 or lower_order_nums < 2 or lower_order_second:
        return 2
    raise AssertionError("unreachable: third order is not implemented")  # pragma: no cover


def dpm2_orders(num_steps: int) -> list[int]:
    """``[dpm_order(k, num_steps) for k in range(num_steps)]``, e.g. ``N = 5 -> [1, 2, 2, 2, 1]``."""
    return [dpm_order(k, num_steps) for k in range(num_steps)]


def log_snr(t) -> Tensor:
    """``λ(t) = log(1 − t) − log(t)`` in fp64 (float / 0-d / (B,) -> same shape); ``−inf`` at 1, ``+inf`` at 0."""
    t = torch.as_tensor(t).to(torch.float64)
    return torch.log(1.0 - t) - torch.log(t)


def x0_from_v(x: Tensor, v: Tensor, t) -> Tensor:
    """``x̂0 = x − t·v`` (released ``convert_model_output``), fp32.  x, v: (B, ...); t: float / 0-d / (B,)."""
    x, v = x.float(), v.float()
    if x.shape != v.shape:
        raise ValueError(f"v: expected shape {tuple(x.shape)}, got {tuple(v.shape)}")
    return x - _bcast(_as_time(t, x.shape[0], x.device), x) * v


def _coef(c: Tensor, like: Tensor) -> Tensor:
    """An fp64 (B,) coefficient as fp32 (B, 1, ..., 1) against ``like``."""
    return _bcast(c.to(torch.float32), like)


def _times(like: Tensor, *ts) -> list[Tensor]:
    """Times as fp64 (B,) tensors (fp32 grid values promoted, as the released ``sigmas.to(torch.float64)``)."""
    b = like.shape[0]
    return [_as_time(t, b, like.device).to(torch.float64) for t in ts]


def ddim0_update(x: Tensor, x0: Tensor, t, t_next) -> Tensor:
    """First-order step: DDIM with η = 0 on x̂0 (released ``ddim_update(..., eta=0.0)``, solver.py:275–295).

    ``x_next = (1 − t_next)·x̂0 + t_next·ε̂``, ``ε̂ = (x − (1 − t)·x̂0)/t``; with ``x̂0 = x − t·v`` this is the Euler
    step ``x − (t − t_next)·v`` (up to rounding).  Needs ``t > 0``; exact at ``t = 1`` (``ε̂ = x``) and at ``t_next = 0``
    (``x_next = x̂0``).  x, x0: (B, ...); t, t_next: float / 0-d / (B,).  Returns fp32 (B, ...).
    """
    x, x0 = x.float(), x0.float()
    t, s = _times(x, t, t_next)
    eps_hat = (x - _coef(1.0 - t, x) * x0) / _coef(t, x)
    return _coef(1.0 - s, x) * x0 + _coef(s, x) * eps_hat  # released: sqrt(t_next² − ρ²)·ε̂, ρ = η·(...) = 0


def dpm2_second_order_update(x: Tensor, x0_cur: Tensor, x0_prev: Tensor, t_prev, t, t_next) -> Tensor:
    """Multistep DPM-Solver++(2M), midpoint form (released ``multistep_dpm_solver_second_order_update``, :317–350).

    With ``α = 1 − σ``, ``λ = log α − log σ``, ``h = λ(t_next) − λ(t)``, ``h_0 = λ(t) − λ(t_prev)``, ``r0 = h_0/h``,
    ``D0 = x̂0_cur``, ``D1 = (1/r0)·(x̂0_cur − x̂0_prev)``:

        ``x_next = (t_next/t)·x − α(t_next)·(e^{−h} − 1)·D0 − ½·α(t_next)·(e^{−h} − 1)·D1``

    x: (B, ...) the state at ``t``; x0_cur: (B, ...) x̂0 predicted at (x, t); x0_prev: (B, ...) x̂0 predicted at
    the previous state (time ``t_prev``).  Times: float / 0-d / (B,), ``t_prev > t > t_next > 0``
    (``t_prev = 1`` gives ``D1 = 0``; ``t_next = 0`` gives ``r0 = 0`` and a non-finite result, which is why the
    last step is first order).  Returns fp32 (B, ...).
    """
    x, m0, m1 = x.float(), x0_cur.float(), x0_prev.float()
    if not x.shape == m0.shape == m1.shape:
        raise ValueError(f"x0_cur, x0_prev: expected shape {tuple(x.shape)}, got {tuple(m0.shape)}, "
                         f"{tuple(m1.shape)}")
    s1, s0, st = _times(x, t_prev, t, t_next)
    lam_t, lam_s0, lam_s1 = log_snr(st), log_snr(s0), log_snr(s1)
    alpha_t = 1.0 - st
    h, h_0 = lam_t - lam_s0, lam_s0 - lam_s1
    r0 = h_0 / h
    d1 = _coef(1.0 / r0, x) * (m0 - m1)
    c = alpha_t * (torch.exp(-h) - 1.0)
    return _coef(st / s0, x) * x - _coef(c, x) * m0 - _coef(0.5 * c, x) * d1


def dpm2_update(x: Tensor, x0_cur: Tensor, x0_prev: Tensor | None, t_prev, t, t_next, order: int) -> Tensor:
    """One ``dpm2`` step of order ``order`` (1: :func:`ddim0_update`, ``x0_prev``/``t_prev`` unused; 2:
    :func:`dpm2_second_order_update`).  Shapes as there; returns fp32 (B, ...)."""
    if order == 1:
        return ddim0_update(x, x0_cur, t, t_next)
    if order == 2:
        if x0_prev is None or t_prev is None:
            raise ValueError("order 2: needs the previous step's x0_prev and t_prev")
        return dpm2_second_order_update(x, x0_cur, x0_prev, t_prev, t, t_next)
    raise ValueError(f"order: must be one of {DPM_ORDERS}, got {order!r}")


def dpm2_step(x: Tensor, v: Tensor, t, t_next, *, order: int, x0_prev: Tensor | None = None,
              t_prev=None) -> StepOut:
    """A ``dpm2`` step as a :class:`stepflow.math.sde.StepOut`: ``next = mean = dpm2_update(x, x − t·v, ...)``; std 0,
    log_prob 0, untrainable, kl_scale 0 (deterministic, no density; as :func:`stepflow.math.sde.ode_step`).

    x, v: (B, ...); t, t_next, t_prev: float / 0-d / (B,); ``order``: :func:`dpm_order` of the step.
    """
    x, v = x.float(), v.float()
    nxt = dpm2_update(x, x0_from_v(x, v, t), x0_prev, t_prev, t, t_next, order)
    zero = torch.zeros_like(_as_time(t, x.shape[0], x.device))
    return StepOut(next=nxt, mean=nxt, std=zero, log_prob=zero.clone(), trainable=zero > 0, kl_scale=zero.clone())


# ----------------------------------------------------------------------------------------------------------------
# MixGRPO-Flash: the ODE after the SDE window by DPM-Solver++(2M) on fewer steps (Tencent-Hunyuan/MixGRPO@e5cdd6a)
# ----------------------------------------------------------------------------------------------------------------
def flash_num_post(num_steps: int, last_sde: int, compress_ratio: float) -> int:
    """Grid points of the compressed tail after the window: ``int(max((N − last_sde)·compress_ratio, 1))``
    (fastvideo/utils/sampling_utils.py L44; ``sigma_schedule.size(0) − 1 = N``). The tail then has
    ``num_post − 1`` steps instead of the ``N − 1 − last_sde`` steps of the uncompressed grid (released Flash,
    ratio 0.4, N = 25, window [0..3]: 8 points, 7 steps instead of 21). ``num_post = 1`` gives **no** tail step: the
    rollout stops at ``σ_{last_sde+1} > 0`` (a grid that does not reach 0; released: every window ending at 22 of
    25 steps, and any ``(N − last_sde)·ratio < 2``)."""
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps: must be a positive integer, got {num_steps!r}")
    if int(last_sde) != last_sde or not 0 <= last_sde < num_steps:
        raise ValueError(f"last_sde: must be a step index in 0..{num_steps - 1}, got {last_sde!r}")
    if not (isinstance(compress_ratio, (int, float)) and math.isfinite(compress_ratio) and compress_ratio > 0):
        raise ValueError(f"compress_ratio: must be a finite float > 0, got {compress_ratio!r}")
    return int(max((num_steps - last_sde) * compress_ratio, 1))


def flash_grid(grid: Tensor, last_sde: int, compress_ratio: float, shift: float) -> Tensor:
    """The rollout grid of MixGRPO-Flash (``dpm_apply_strategy="post"``; sampling_utils.py L41-54):
    ``grid[: last_sde + 1] ++ shift(linspace(u, 0, num_post))`` with :func:`flash_num_post` points and
    ``shift(u) = s·u/(1 + (s − 1)·u)`` (``sd3_time_shift``, L9-10). Released: ``u = linspace(1, 0, N + 1)[last_sde +
    1]``, the *unshifted* grid value, so that the tail starts at the grid's own ``σ_{last_sde+1}``; here
    ``u = shift⁻¹(grid[last_sde + 1]) = σ/(s − (s − 1)·σ)`` (fp64), which is the same number on the FastVideo grid
    (``sd3_time_shift(s, linspace(1, 0, N + 1))``, the released one) and keeps the tail starting at the state's time on
    any other grid (diffusers' σ_min grid, FLUX's, whose exponential shift is this one with ``s = e^μ``); its first
    point is set to ``grid[last_sde + 1]`` exactly. The pre-window steps and the window keep the original grid.

    grid: (N+1,) from 1 to 0; ``shift``: the grid's shift (``--shift``, 3 in every released script). Returns
    ``(last_sde + 1 + num_post,)`` fp32: ``last_sde + num_post`` steps, the last ``num_post − 1`` of them the tail.
    """
    if grid.ndim != 1 or grid.shape[0] < 2:
        raise ValueError(f"grid: expected a (N+1,) time grid, got shape {tuple(grid.shape)}")
    if not (isinstance(shift, (int, float)) and math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift: must be a finite float > 0, got {shift!r}")
    n = grid.shape[0] - 1
    num_post = flash_num_post(n, last_sde, compress_ratio)
    sig = float(grid[last_sde + 1])
    u = sig / (shift - (shift - 1.0) * sig)
    post = torch.linspace(u, 0.0, num_post, dtype=torch.float32)
    post = (shift * post) / (1 + (shift - 1) * post)
    post[0] = grid[last_sde + 1]
    return torch.cat([grid[: last_sde + 1].to(torch.float32).cpu(), post]).to(grid.device)


def flash_orders(num_tail_steps: int) -> list[int]:
    """The order of each tail step (released ``dpm_step``, sampling_utils.py L307-347, with the window's history in
    ``dpm_state``): every step before the tail pushed its x̂0 (L116-117, ``dpm_state.update(x_0)``) and raised
    ``lower_order_nums`` (L127), so the first tail step is already second order, using the x̂0 of the window's last
    step; the tail's last step is first order (``lower_order_final``: it ends at σ = 0, where the second-order update
    divides by ``r0 = 0``). ``lower_order_second`` only demotes a third-order solver. E.g. 7 steps:
    ``[2, 2, 2, 2, 2, 2, 1]``."""
    if int(num_tail_steps) != num_tail_steps or num_tail_steps < 0:
        raise ValueError(f"num_tail_steps: must be an integer >= 0, got {num_tail_steps!r}")
    return [2] * max(num_tail_steps - 1, 0) + [1] * min(num_tail_steps, 1)


def flash_tail(x: Tensor, tail: Tensor, velocity: Callable[[Tensor, Tensor], Tensor], x0_prev: Tensor,
               t_prev) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """MixGRPO-Flash's deterministic DPM-Solver++(2M) (midpoint) tail (sampling_utils.py L134-144 with L307-385,
    ``sde_solver=False``): from the state ``x`` at ``tail[0]`` (the state after the window's last step) over the tail
    grid ``tail`` (``flash_grid(...)[last_sde + 1:]``), step j of order ``flash_orders(len(tail) − 1)[j]``
    (:func:`dpm2_update`: second order is the released ``multistep_dpm_solver_second_order_update`` midpoint branch
    L515-520, first order its ``dpm_solver_first_order_update`` L436, = DDIM η = 0).

    velocity(x, t) -> v: the model at state x, time t (0-d tensor); x0_prev: (B, ...) the x̂0 of the window's last
    state, predicted at ``t_prev`` (the grid time of that state). Returns (final state fp32, the tail's states after
    x, the velocities evaluated) — ``len(tail) − 1`` of each; with ``len(tail) == 1`` nothing is evaluated and ``x``
    is returned as the final state (the released ``num_post = 1`` corner).
    """
    x = x.float()
    states, vels = [], []
    orders = flash_orders(tail.shape[0] - 1)
    for j, order in enumerate(orders):
        t, t_next = tail[j], tail[j + 1]
        v = velocity(x, t).float()
        x0 = x0_from_v(x, v, t)
        x = dpm2_update(x, x0, x0_prev, t_prev, t, t_next, order)
        x0_prev, t_prev = x0, t
        states.append(x)
        vels.append(v)
    return x, states, vels
