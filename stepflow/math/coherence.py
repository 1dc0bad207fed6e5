"""Gradient coherence: how much of a step's policy gradient is signal (which steps are worth training).

The policy-gradient estimate of one batch is ``g_i = μ + n_i``: the expected gradient ``μ`` plus zero-mean noise.
For independent batches ``E[g_i·g_j] = |μ|²`` (i ≠ j) and ``E|g_i|² = |μ|² + E|n|²``, so the mean cosine between the
gradients of independent batches estimates the signal fraction ``ρ = |μ|² / (|μ|² + E|n|²)`` (for comparable
norms). ``ρ ≈ 0`` means a step's gradient is noise at this batch size; averaging ``B`` batches gives an SNR of
``B·ρ / (1 − ρ)``. ``experiments/grad_coherence.py`` measures it per denoising step and credit scheme, which is how
the embedded world's ``train_steps`` were chosen (only step 0 is coherent there; conf/recipe/shapes.yaml).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["chi2_quantile", "mean_pairwise_cosine", "pair_sums", "signal_fraction", "StepSignal"]


def _offdiag_mean(g: Tensor, normalize: bool) -> tuple[float, Tensor]:
    """Mean over pairs i ≠ j of ``g_i·g_j`` (rows unit-normalised first when ``normalize``) and the Gram matrix.

    g: (N>=2, D), promoted to float64. Returns (mean, (N, N) Gram matrix).
    """
    if g.ndim != 2 or g.shape[0] < 2:
        raise ValueError(f"g: expected (N>=2, D), got {tuple(g.shape)}")
    g = g.double()
    if normalize:
        g = g / g.norm(dim=1, keepdim=True).clamp(min=1e-300)
    gram = g @ g.T
    n = g.shape[0]
    return float((gram.sum() - gram.diagonal().sum()) / (n * (n - 1))), gram


def mean_pairwise_cosine(g: Tensor) -> float:
    """Mean cosine similarity over all pairs ``i < j`` of the rows of ``g`` (N, D), N >= 2.

    Rows with zero norm count as cosine 0. An estimate of the signal fraction ρ (module docstring).
    """
    return _offdiag_mean(g, normalize=True)[0]


def pair_sums(g: Tensor) -> Tensor:
    """``[Σ_{i≠j} g_i·g_j, N(N−1), Σ_i |g_i|², N]`` of the rows of ``g`` (N, D) in float64 (N >= 1; zeros for N = 0):
    the sums that add over ranks; :meth:`StepSignal.ratio` of them is :func:`signal_fraction` of all the rows'
    pairs within a rank."""
    if g.shape[0] == 0:
        return torch.zeros(4, dtype=torch.float64)
    gram = g.double() @ g.double().T
    n, sq = g.shape[0], gram.diagonal().sum()
    return torch.stack([gram.sum() - sq, torch.tensor(float(n * (n - 1)), dtype=torch.float64), sq,
                        torch.tensor(float(n), dtype=torch.float64)])


def signal_fraction(g: Tensor) -> float:
    """Unbiased signal fraction ``ρ̂ = mean_{i≠j} g_i·g_j / mean_i |g_i|²`` of batch gradients ``g`` (N>=2, D).

    Unlike :func:`mean_pairwise_cosine` it weights batches by their norms (``|μ|² / E|g|²`` exactly in expectation
    of numerator and denominator).
    """
    cross, gram = _offdiag_mean(g, normalize=False)
    return float(cross / gram.diagonal().mean().clamp(min=1e-300))


@functools.lru_cache(maxsize=64)
def chi2_quantile(p: float, df: int) -> float:
    """The p-quantile of the χ² distribution with ``df`` degrees of freedom: the root of the regularised lower
    incomplete gamma function ``P(df/2, x/2) = p`` by bisection (to 1e-10 relative)."""
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    lo, hi = 0.0, max(1.0, 10.0 * df)
    while float(torch.special.gammainc(a, torch.tensor(hi / 2.0, dtype=torch.float64))) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float(torch.special.gammainc(a, torch.tensor(mid / 2.0, dtype=torch.float64))) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-10 * hi:
            break
    return 0.5 * (lo + hi)


class StepSignal:
    """Online per-step signal fraction of the policy gradient, from the gradients the update already computes
    (``train.weighting=auto``), and the step weights it implies.

    A measurement of step k is its mean gradient over each of G >= 2 independent parts of the batch (whole prompt
    groups; ``m_1 .. m_G``): ``r = mean_{i≠j} m_i·m_j / mean_i |m_i|²``, an estimate of the signal fraction ρ_k of
    one part's gradient (module docstring; :func:`signal_fraction`). Measurements are ratios, so an early iteration
    with large gradients does not outweigh the rest; per step they are averaged (``ρ̂_k``, standard error ``s_k``).

    :meth:`weights`: the estimates are noisy (a part's ρ is a few percent), so they are first shrunk toward their
    mean over steps by empirical Bayes (normal prior whose variance τ² over steps is DerSimonian–Laird's, and 0
    unless Cochran's test finds the steps different at the 5 % level; :meth:`heterogeneity`):
    ``ρ̃_k = ρ̄ + τ²/(τ² + s_k²)·(ρ̂_k − ρ̄)``; steps only get different weights when their estimates differ by more
    than their noise. Then ``w_k ∝ sqrt(ρ̃_k)/(1 − ρ̃_k)`` (ρ̃ clamped to [0, 1)), sum 1: for unit-norm step
    gradients ``u_k = sqrt(ρ_k)·s_k + sqrt(1 − ρ_k)·n_k`` (unit signal s, unit noise n), the weights that maximise
    the update's signal-to-noise ratio ``(Σ w_k sqrt ρ_k)² / Σ w_k² (1 − ρ_k)`` (Cauchy–Schwarz). Uniform before
    every step has ``warmup`` measurements, and when no shrunk estimate is positive.
    """

    def __init__(self, steps: Sequence[int], warmup: int = 3):
        self.steps = list(steps)
        self.warmup = int(warmup)
        s = len(self.steps)
        self.count = torch.zeros(s, dtype=torch.float64)
        self.mean = torch.zeros(s, dtype=torch.float64)
        self.m2 = torch.zeros(s, dtype=torch.float64)  # Welford: Σ (r − mean)²
        self.measurements = 0  #: iterations that measured at least one step

    @staticmethod
    def ratio(cross: float, pairs: float, sq: float, parts: float) -> float:
        """A measurement from the sums over parts: ``(Σ_{i≠j} m_i·m_j / pairs) / (Σ_i |m_i|² / parts)``."""
        if pairs <= 0 or sq <= 0:
            return 0.0
        return (cross / pairs) / (sq / parts)

    def add(self, steps: Sequence[int], ratios: Sequence[float]) -> None:
        """One iteration's measurements ``r`` (see :meth:`ratio`) of ``steps`` (a subset of :attr:`steps`)."""
        for k, r in zip(steps, ratios):
            j = self.steps.index(k)
            self.count[j] += 1
            delta = float(r) - float(self.mean[j])
            self.mean[j] += delta / self.count[j]
            self.m2[j] += delta * (float(r) - float(self.mean[j]))
        self.measurements += 1

    def rho(self) -> Tensor:
        """(S,) the mean measured signal fraction per step (0 where nothing was measured)."""
        return self.mean.clone()

    def stderr(self) -> Tensor:
        """(S,) standard errors of :meth:`rho` (inf below two measurements)."""
        var = self.m2 / (self.count - 1).clamp(min=1)
        return torch.where(self.count >= 2, (var / self.count.clamp(min=1)).sqrt(), torch.full_like(var, float("inf")))

    def heterogeneity(self) -> tuple[float, float, float]:
        """Cochran's ``Q = Σ_k (ρ̂_k − ρ̄)²/s_k²`` (ρ̄ the precision-weighted mean), its 95 % point under "every step has
        the same ρ" (χ² with S − 1 degrees of freedom) and the DerSimonian–Laird between-step
        variance ``τ² = max(0, (Q − (S − 1)) / (Σ p − Σ p²/Σ p))``, p = 1/s²; τ² is 0 unless Q exceeds its 95 % point."""
        rho, se = self.rho(), self.stderr()
        p = 1.0 / se.pow(2).clamp(min=1e-24)
        df = len(rho) - 1
        if df < 1 or not bool(torch.isfinite(se).all()):  # a step measured fewer than twice
            return 0.0, float("inf"), 0.0
        mean = float((p * rho).sum() / p.sum())
        q = float((p * (rho - mean).pow(2)).sum())
        q95 = chi2_quantile(0.95, df)
        tau2 = max(0.0, (q - df) / float(p.sum() - p.pow(2).sum() / p.sum())) if q > q95 else 0.0
        return q, q95, tau2

    def shrunk(self) -> Tensor:
        """(S,) empirical-Bayes estimates ``ρ̃_k = ρ̄ + τ²/(τ² + s_k²)·(ρ̂_k − ρ̄)`` (class docstring; ρ̄ the mean over
        steps, τ² from :meth:`heterogeneity`)."""
        rho, se2 = self.rho(), self.stderr().pow(2)
        if len(rho) < 2 or not bool(torch.isfinite(se2).all()):
            return rho
        tau2 = self.heterogeneity()[2]
        return rho.mean() + (tau2 / (tau2 + se2).clamp(min=1e-300)) * (rho - rho.mean())

    def weights(self) -> Tensor:
        """(S,) step weights summing to 1 (class docstring)."""
        s = len(self.steps)
        uniform = torch.full((s,), 1.0 / s, dtype=torch.float64)
        if s == 0 or float(self.count.min()) < max(self.warmup, 2):
            return uniform
        r = self.shrunk().clamp(0.0, 1.0 - 1e-6)
        w = r.sqrt() / (1.0 - r)
        return uniform if float(w.sum()) <= 0 else w / w.sum()

    def state_dict(self) -> dict:
        return {"steps": self.steps, "count": self.count.clone(), "mean": self.mean.clone(), "m2": self.m2.clone(),
                "measurements": self.measurements}

    def load_state_dict(self, sd: dict) -> None:
        if "mean" not in sd:
            raise ValueError("train.weighting=auto: the checkpoint's step-signal estimate is from an older stepflow "
                             "(before per-measurement ratios); resume it with the stepflow that wrote it, or start afresh")
        self.steps = list(sd["steps"])
        self.count, self.mean, self.m2 = (sd[k].clone().double() for k in ("count", "mean", "m2"))
        self.measurements = int(sd["measurements"])
