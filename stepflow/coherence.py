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

__all__ = ["mean_pairwise_cosine", "signal_fraction", "step_gradients"]


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
