"""stepflow.math.estimate (method.md §4) against closed forms for Gaussian data x0 ~ N(m, v0) with the exact velocity:
Tweedie = E[x0|x_t] = m + (1−t) v0 (x − (1−t) m)/V_t and the probability-flow ODE map
Φ_t(x) = m + sqrt(v0/V_t)·(x − (1−t) m), V_t = (1−t)² v0 + t² (the affine monotone map N((1−t)m, V_t) → N(m, v0))."""

from __future__ import annotations

import math

import pytest
import torch

from stepflow.math.estimate import estimate_x0, estimate_x0_with_nfe, substep_counts, tweedie_x0

M = torch.tensor([0.5, -1.0, 2.0])
V0 = torch.tensor([0.25, 1.0, 0.04])


def _vt(t):
    return (1 - t) ** 2 * V0 + t**2


def velocity(x, t):
    """Exact E[x1 − x0 | x_t] for the Gaussian data above; x (M, 3), t (M,)."""
    t = t.view(-1, 1)
    c = x - (1 - t) * M
    return t * c / _vt(t) - (M + (1 - t) * V0 * c / _vt(t))


def posterior_mean(x, t):
    t = t.view(-1, 1)
    return M + (1 - t) * V0 * (x - (1 - t) * M) / _vt(t)


def ode_map(x, t):
    t = t.view(-1, 1)
    return M + torch.sqrt(V0 / _vt(t)) * (x - (1 - t) * M)


class Counter:
    """Wraps a velocity function and records every call's rows and times."""

    def __init__(self, fn=velocity, compact=False):
        self.fn, self.compact, self.calls = fn, compact, []

    def __call__(self, x, t, rows=None):
        assert (rows is not None) == self.compact
        self.calls.append((x.shape[0], t.clone(), None if rows is None else rows.clone()))
        return self.fn(x, t)


def _states(t):
    gen = torch.Generator().manual_seed(0)
    t = torch.as_tensor(t, dtype=torch.float32)
    x1 = torch.randn(t.numel(), 3, generator=gen)
    x0 = M + V0.sqrt() * torch.randn(t.numel(), 3, generator=gen)
    return (1 - t.view(-1, 1)) * x0 + t.view(-1, 1) * x1, t


def test_one_substep_is_tweedie_and_the_posterior_mean():
    x, t = _states([1.0, 0.9, 0.6, 0.3, 0.05])
    est = estimate_x0(velocity, x, t, 1)
    torch.testing.assert_close(est, x - t.view(-1, 1) * velocity(x, t))
    torch.testing.assert_close(est, tweedie_x0(x, velocity(x, t), t))
    torch.testing.assert_close(est, posterior_mean(x, t), atol=1e-5, rtol=1e-5)


def test_substeps_converge_to_the_ode_flow_map_not_the_posterior_mean():
    """Forward Euler is first order: the error to Φ_t decreases monotonically in T′ and roughly halves when T′
    doubles; at T′ = 50 it is < 5% of the T′ = 1 error (the Tweedie-to-ODE-endpoint gap) and < 0.03 in absolute
    terms (data std 0.2–1; the slow dim is v0 = 0.04, whose dynamics happen at t ≲ 0.2, so uniform substeps of
    t/50 resolve it only to ~10% of its std).  The limit is Φ_t(x), which differs from E[x0|x_t]."""
    x, t = _states([1.0, 0.8, 0.5, 0.2])
    target = ode_map(x, t)
    errs = []
    for n in (1, 2, 5, 10, 20, 50):
        errs.append((estimate_x0(velocity, x, t, n) - target).abs().max().item())
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 0.05 * errs[0] and errs[-1] < 0.03
    assert 0.35 < errs[-1] / errs[-2] < 0.5  # ≈ 20/50 = 0.4 for a first-order method
    gap = (posterior_mean(x, t) - target).abs().max().item()
    assert gap > 10 * errs[-1]  # T′ → ∞ is not Tweedie


def test_subgrid_times_are_uniform_unshifted():
    x, t = _states([0.8, 0.4])
    fn = Counter()
    estimate_x0(fn, x, t, 4)
    got = torch.stack([c[1] for c in fn.calls])  # (4 calls, 2 rows)
    ref = torch.tensor([[0.8 * (4 - j) / 4, 0.4 * (4 - j) / 4] for j in range(4)])
    torch.testing.assert_close(got, ref)


def test_v0_reuse_identical_and_fewer_calls():
    x, t = _states([1.0, 0.7, 0.3])
    v0 = velocity(x, t)
    plain, plain_fn = Counter(), Counter()
    a, nfe_a = estimate_x0_with_nfe(plain_fn, x, t, 5)
    b, nfe_b = estimate_x0_with_nfe(plain, x, t, 5, v0=v0)
    assert torch.equal(a, b)
    assert (len(plain_fn.calls), nfe_a) == (5, 15)
    assert (len(plain.calls), nfe_b) == (4, 12)
    zero = Counter()
    c, nfe_c = estimate_x0_with_nfe(zero, x, t, 1, v0=v0)
    assert (len(zero.calls), nfe_c) == (0, 0)
    torch.testing.assert_close(c, x - t.view(-1, 1) * v0)


def test_batched_per_sample_times_equal_per_row_calls():
    x, t = _states([1.0, 0.96, 0.7, 0.46, 0.0089, 0.3])
    batched = estimate_x0(velocity, x, t, 5)
    for i in range(len(t)):
        single = estimate_x0(velocity, x[i:i + 1], float(t[i]), 5)
        torch.testing.assert_close(batched[i:i + 1], single, atol=1e-6, rtol=1e-6)


def test_t_zero_rows_are_returned_unchanged():
    x, t = _states([0.0, 0.5, 0.0])

    def nan_at_zero(y, tau):
        v = velocity(y, tau)
        return torch.where((tau == 0).view(-1, 1), torch.full_like(v, float("nan")), v)

    est, nfe = estimate_x0_with_nfe(nan_at_zero, x, t, 3)
    assert torch.equal(est[0], x[0]) and torch.equal(est[2], x[2])
    torch.testing.assert_close(est[1:2], estimate_x0(velocity, x[1:2], t[1:2], 3))
    only = Counter(compact=True)
    _, nfe_c = estimate_x0_with_nfe(only, x, t, 3, compact=True)
    assert nfe_c == 3 and all(c[2].tolist() == [1] for c in only.calls)


def test_adaptive_substep_counts_and_values():
    """n_i = max(1, ceil(T′ t_i)): T′ = 4, t = [1, .5, .26, .01, 0] -> [4, 2, 2, 1, 0]; each row equals a plain
    n_i-substep estimate; compact mode evaluates only unfinished rows (Σ n_i rows), default mode all rows."""
    tt = [1.0, 0.5, 0.26, 0.01, 0.0]
    assert substep_counts(torch.tensor(tt), 4, adaptive=True).tolist() == [4, 2, 2, 1, 0]
    assert substep_counts(torch.tensor(tt), 4).tolist() == [4, 4, 4, 4, 0]
    assert substep_counts(torch.tensor([0.6], dtype=torch.float32), 5, adaptive=True).tolist() == [3]
    x, t = _states(tt)
    full = Counter()
    est, nfe = estimate_x0_with_nfe(full, x, t, 4, adaptive=True)
    assert (len(full.calls), nfe) == (4, 20)
    for i, n in enumerate([4, 2, 2, 1, 0]):
        ref = x[i:i + 1] if n == 0 else estimate_x0(velocity, x[i:i + 1], t[i:i + 1], n)
        torch.testing.assert_close(est[i:i + 1], ref, atol=1e-6, rtol=1e-6)
    comp = Counter(compact=True)
    est_c, nfe_c = estimate_x0_with_nfe(comp, x, t, 4, adaptive=True, compact=True)
    torch.testing.assert_close(est_c, est)
    assert nfe_c == 9 and [c[0] for c in comp.calls] == [4, 3, 1, 1]
    assert [c[2].tolist() for c in comp.calls] == [[0, 1, 2, 3], [0, 1, 2], [0], [0]]
    comp_v0 = Counter(compact=True)
    _, nfe_v0 = estimate_x0_with_nfe(comp_v0, x, t, 4, adaptive=True, compact=True, v0=velocity(x, t))
    assert nfe_v0 == 5


def test_compact_mode_keeps_per_row_conditioning_aligned():
    """A row-conditioned field (scale c_i per row): compact mode gathers c[rows] and matches the default mode."""
    x, t = _states([0.9, 0.0, 0.5, 0.2])
    c = torch.tensor([0.5, 2.0, -1.0, 3.0])
    dense = estimate_x0(lambda y, tau: c.view(-1, 1) * y * tau.view(-1, 1), x, t, 3, adaptive=True)
    comp = estimate_x0(lambda y, tau, rows: c[rows].view(-1, 1) * y * tau.view(-1, 1), x, t, 3, adaptive=True,
                       compact=True)
    torch.testing.assert_close(dense, comp)
    # closed form for v = c·τ·y: each Euler substep multiplies by (1 − h c τ_j)
    for i in range(4):
        n = max(1, math.ceil(3 * float(t[i]) - 1e-6)) if float(t[i]) > 0 else 0
        h = float(t[i]) / max(n, 1)
        f = 1.0
        for j in range(n):
            f *= 1 - h * float(c[i]) * float(t[i]) * (n - j) / n
        torch.testing.assert_close(dense[i], x[i] * f, atol=1e-6, rtol=1e-5)


def test_bad_substeps():
    x, t = _states([0.5])
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="^substeps:"):
            estimate_x0(velocity, x, t, bad)
