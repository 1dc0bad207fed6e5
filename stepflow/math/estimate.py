"""x̂0(t) by T′ Euler substeps of the flow ODE (method.md §4, paper Sec. 5.1 and App. D).

From a state ``x_t`` integrate ``dy/dτ = v(y, τ)`` from ``τ = t`` down to 0 with forward Euler on the uniform,
**unshifted** sub-grid ``τ'_j = t·(n − j)/n``, ``j = 0..n``:

    y_0 = x_t,   y_{j+1} = y_j − (t/n)·v(y_j, τ'_j),   x̂0(t) = y_n.

``n = T′`` for every row (default), or ``n_i = max(1, ceil(T′·t_i))`` per row (``adaptive=True``, so rows near
t = 0 take fewer substeps of about the same size 1/T′).  ``n = 1`` is Tweedie ``x_t − t·v`` (method.md §1, Eq. 2).

Note what the estimate converges to: with the exact velocity, ``n = 1`` gives the posterior mean E[x0 | x_t],
while ``n → ∞`` gives the endpoint of the probability-flow ODE started at x_t (a *sample*-like point, not the
posterior mean).  T′ interpolates between the two; the paper's claim is only that larger T′ gives sharper,
more reward-informative images (tests/test_estimate.py checks both limits in closed form for Gaussian data).

All rows are batched: one ``velocity_fn`` call per substep, with per-row times.  Rows with ``t == 0`` are returned
unchanged (``x̂0(0) = x0``) and need no evaluation.

``velocity_fn`` contract: ``velocity_fn(x (M', ...), t (M',)) -> v (M', ...)``.  By default every call gets all M
rows (rows that are finished are passed along and their outputs ignored, so conditioning stays aligned with the
rows).  With ``compact=True`` only the rows that still need a substep are passed, as
``velocity_fn(x_rows, t_rows, rows)`` with ``rows`` a (M',) long index into the original M rows (so the caller
can gather its conditioning); this is what makes ``adaptive=True`` cheaper.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["estimate_x0", "estimate_x0_with_nfe", "substep_counts"]


def substep_counts(t: Tensor, substeps: int, adaptive: bool = False) -> Tensor:
    """Per-row number of Euler substeps: (M,) long.

    0 where ``t == 0``; else ``substeps`` or, if ``adaptive``, ``max(1, ceil(substeps·t))`` (method.md §4), with a
    1e-6 slack inside the ceil so that fp32 round-off (e.g. ``5 · float32(0.6) = 3.0000001``) does not add a substep.
    """
    if int(substeps) != substeps or substeps < 1:
        raise ValueError(f"substeps: must be a positive integer, got {substeps!r}")
    t = torch.as_tensor(t, dtype=torch.float64)
    if adaptive:
        n = torch.clamp(torch.ceil(substeps * t - 1e-6), min=1)
    else:
        n = torch.full_like(t, float(substeps))
    return torch.where(t > 0, n, torch.zeros_like(n)).long()


def estimate_x0_with_nfe(velocity_fn: Callable[..., Tensor], x: Tensor, t, substeps: int, *,
                         v0: Tensor | None = None, adaptive: bool = False,
                         compact: bool = False) -> tuple[Tensor, int]:
    """x̂0 by Euler substeps (see the module docstring) and the number of sample-level model evaluations.

    Args:
        velocity_fn: ``(x (M', ...), t (M',)) -> v (M', ...)``; with ``compact=True`` also gets ``rows (M',)``.
        x: (M, ...) states ``x_t`` (computed in fp32).
        t: (M,) per-row times (a float / 0-d tensor is broadcast to all rows), in [0, 1].
        substeps: T′ ≥ 1.
        v0: optional (M, ...) velocity at (x, t) already computed by the rollout; substep 0 reuses it, so
            ``substeps=1`` with ``v0`` makes no call at all.
        adaptive: per-row ``n_i = max(1, ceil(T′·t_i))`` substeps of size ``t_i/n_i``.
        compact: pass only unfinished rows (and their indices) to ``velocity_fn``.

    Returns:
        (x̂0 (M, ...) fp32, nfe) where ``nfe`` = Σ over calls of the number of rows passed to ``velocity_fn``.
    """
    x = x.float()
    m = x.shape[0]
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(m)
    if t.shape != (m,):
        raise ValueError(f"t: expected shape ({m},), got {tuple(t.shape)}")
    if v0 is not None and v0.shape != x.shape:
        raise ValueError(f"v0: expected shape {tuple(x.shape)}, got {tuple(v0.shape)}")

    n = substep_counts(t.cpu(), substeps, adaptive).to(x.device)  # (M,)
    n_f = n.to(torch.float32).clamp(min=1)
    h = torch.where(n > 0, t / n_f, torch.zeros_like(t))  # per-row step size t_i / n_i
    view = (-1,) + (1,) * (x.ndim - 1)
    n_max = int(n.max().item()) if m > 0 else 0

    y = x.clone()
    nfe = 0
    for j in range(n_max):
        active = n > j  # (M,)
        tau = torch.where(active, t * (n - j).to(torch.float32) / n_f, torch.zeros_like(t))
        if j == 0 and v0 is not None:
            v = v0.float()
        elif compact:
            rows = torch.nonzero(active, as_tuple=False).squeeze(1)
            v = torch.zeros_like(y)
            v[rows] = velocity_fn(y[rows], tau[rows], rows).float()
            nfe += int(rows.numel())
        else:
            v = velocity_fn(y, tau).float()
            nfe += m
        y = torch.where(active.view(view), y - h.view(view) * v, y)
    return y, nfe


def estimate_x0(velocity_fn: Callable[..., Tensor], x: Tensor, t, substeps: int, *, v0: Tensor | None = None,
                adaptive: bool = False, compact: bool = False) -> Tensor:
    """x̂0 (M, ...) by ``substeps`` Euler substeps from per-row times ``t`` (M,) to 0 (method.md §4).

    Same arguments as :func:`estimate_x0_with_nfe`, which also returns the evaluation count.
    """
    return estimate_x0_with_nfe(velocity_fn, x, t, substeps, v0=v0, adaptive=adaptive, compact=compact)[0]


def tweedie_x0(x: Tensor, v: Tensor, t) -> Tensor:
    """Tweedie ``x̂0 = x − t·v`` (method.md §1, Eq. 2). x, v: (M, ...); t: float or (M,)."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.ndim == 1:
        t = t.view(-1, *([1] * (x.ndim - 1)))
    return x.float() - t * v.float()


__all__.append("tweedie_x0")
