"""Gradient coherence: how much of a step's policy gradient is signal (which steps are worth training).

The policy-gradient estimate of one batch is ``g_i = μ + n_i``: the expected gradient ``μ`` plus zero-mean noise.
For independent batches ``E[g_i·g_j] = |μ|²`` (i ≠ j) and ``E|g_i|² = |μ|² + E|n|²``, so the mean cosine between the
gradients of independent batches estimates the signal fraction ``ρ = |μ|² / (|μ|² + E|n|²)`` (for comparable
norms). ``ρ ≈ 0`` means a step's gradient is noise at this batch size; averaging ``B`` batches gives an SNR of
``B·ρ / (1 − ρ)``. ``experiments/grad_coherence.py`` measures it per denoising step and credit scheme, which is how
the embedded world's ``train_steps`` were chosen (only step 0 is coherent there; conf/recipe/shapes.yaml).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["mean_pairwise_cosine", "signal_fraction", "step_gradients", "StepSignal"]


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


def signal_fraction(g: Tensor) -> float:
    """Unbiased signal fraction ``ρ̂ = mean_{i≠j} g_i·g_j / mean_i |g_i|²`` of batch gradients ``g`` (N>=2, D).

    Unlike :func:`mean_pairwise_cosine` it weights batches by their norms (``|μ|² / E|g|²`` exactly in expectation
    of numerator and denominator).
    """
    cross, gram = _offdiag_mean(g, normalize=False)
    return float(cross / gram.diagonal().mean().clamp(min=1e-300))


def step_gradients(learner, traj, adv: Tensor, steps: Sequence[int]) -> Tensor:
    """Flattened gradient (of the trained weights) of the GRPO loss of each step in ``steps`` over the whole batch: (len(steps), D).

    The loss is the training loop's own (:func:`stepflow.algorithm.step_loss` of ``learner``, β·KL included);
    ``traj``/``adv`` come from one rollout and its advantages. The weights are not changed; gradients of the LoRA
    parameters are left cleared.
    """
    from stepflow.algorithm import step_loss

    params = list(learner.policy.trainable_parameters())
    rows = torch.arange(traj.batch_size)
    times = traj.times.to(learner.policy.device)
    out = []
    learner.policy.train()
    try:
        for k in steps:
            for p in params:
                p.grad = None
            step_loss(learner, traj, adv, k, rows, times)["loss"].backward()
            out.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]))
    finally:
        for p in params:
            p.grad = None
        learner.policy.eval()
    return torch.stack(out)


class StepSignal:
    """Online per-step signal fraction of the policy gradient, from the gradients the update already computes
    (``train.train_steps=auto``): each measured iteration splits the batch into two halves of whole groups, A and B,
    whose step-k gradients are independent estimates of the same expected gradient, and accumulates
    ``Σ m_A·m_B`` and ``Σ (|m_A|² + |m_B|²)/2`` (m: a half's mean gradient). Their ratio estimates the signal
    fraction ρ_k of a half batch (module docstring; ρ of the full batch is larger, the order of the steps the same).

    :meth:`weights` turns the estimates into step weights: ``w_k ∝ max(ρ_k − threshold·max_j ρ_j, 0)`` (sum 1), so
    steps whose gradient is mostly noise get none; before ``warmup`` measurements every step weighs the same.
    """

    def __init__(self, steps: Sequence[int], warmup: int = 3, threshold: float = 0.5):
        self.steps = list(steps)
        self.warmup, self.threshold = int(warmup), float(threshold)
        self.dot = torch.zeros(len(self.steps), dtype=torch.float64)
        self.sq = torch.zeros(len(self.steps), dtype=torch.float64)
        self.measurements = 0

    def add(self, steps: Sequence[int], m_a: Sequence[Tensor], m_b: Sequence[Tensor]) -> None:
        """One measurement: the halves' flattened mean gradients of ``steps`` (a subset of :attr:`steps`)."""
        for k, a, b in zip(steps, m_a, m_b):
            j = self.steps.index(k)
            a, b = a.double().flatten(), b.double().flatten()
            self.dot[j] += float(a @ b)
            self.sq[j] += 0.5 * float(a @ a + b @ b)
        self.measurements += 1

    def rho(self) -> Tensor:
        """(S,) the signal-fraction estimates (0 where nothing was measured)."""
        return torch.where(self.sq > 0, self.dot / self.sq.clamp(min=1e-300), torch.zeros_like(self.dot))

    def weights(self) -> Tensor:
        """(S,) step weights summing to 1."""
        s = len(self.steps)
        if self.measurements < self.warmup:
            return torch.full((s,), 1.0 / s, dtype=torch.float64)
        rho = self.rho()
        w = torch.clamp(rho - self.threshold * rho.max().clamp(min=0), min=0)
        if not bool((w > 0).any()):  # nothing stands out: the most coherent step
            w = torch.zeros_like(rho)
            w[int(rho.argmax())] = 1.0
        return w / w.sum()

    def state_dict(self) -> dict:
        return {"steps": self.steps, "dot": self.dot.clone(), "sq": self.sq.clone(), "measurements": self.measurements}

    def load_state_dict(self, sd: dict) -> None:
        self.steps = list(sd["steps"])
        self.dot, self.sq = sd["dot"].clone().double(), sd["sq"].clone().double()
        self.measurements = int(sd["measurements"])
