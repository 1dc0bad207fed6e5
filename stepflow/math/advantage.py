"""Stepwise gains and advantages (method.md §5, §6; paper Eq. 3–5, App. A, App. C).

Array convention (method.md §1, §4): rewards ``R`` are (B, T+1) with ``R[:, k] = R(x̂0(X_k, τ_k))`` for k < T and
``R[:, T]`` the reward of the final image; step k maps ``X_k -> X_{k+1}``; the gain of step k is
``G_k = R_{k+1} − R_k`` (paper ``g_t = r_{t−1} − r_t``), so ``Σ_k G_k = R_T − R_0``.

Groups are the prompts: rows sharing a ``group_ids`` value are the N trajectories of one prompt.  Everything here
acts on the tensors it is given (e.g. rows gathered from all ranks); statistics are computed in float64 and
advantages are returned as float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "gains",
    "group_normalize",
    "normalize_per_step",
    "uniform_advantages",
    "gae",
    "EmaBaseline",
    "AdvantageConfig",
    "AdvantageOut",
    "AdvantageEstimator",
]

STD_SCOPES = ("group", "global")


def gains(rewards: Tensor) -> Tensor:
    """Stepwise gains ``G_k = R_{k+1} − R_k`` (method.md §5). rewards: (B, T+1) -> (B, T)."""
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards: expected shape (B, T+1) with T >= 1, got {tuple(rewards.shape)}")
    return rewards[:, 1:] - rewards[:, :-1]


def _check_scope(std_scope: str, eps: float) -> None:
    if std_scope not in STD_SCOPES:
        raise ValueError(f"std_scope: must be one of {STD_SCOPES}, got {std_scope!r}")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps!r}")


def _group_index(group_ids: Tensor, batch: int) -> tuple[Tensor, int]:
    """Dense group index (B,) in 0..K−1 and K."""
    group_ids = torch.as_tensor(group_ids)
    if group_ids.shape != (batch,):
        raise ValueError(f"group_ids: expected shape ({batch},), got {tuple(group_ids.shape)}")
    _, inv = torch.unique(group_ids, return_inverse=True)
    return inv, int(inv.max().item()) + 1 if batch > 0 else 0


def _segment_stats(values: Tensor, seg: Tensor, k: int, unbiased: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Per-segment mean, std and "all equal" flag over the entries of ``values`` (P,).

    The std is the population std (ddof 0), or with ``unbiased`` the sample std (ddof 1, torch's ``Tensor.std()``
    default; 0 for a segment of one entry, which is constant anyway).  seg: (P,) segment index in 0..k−1.
    Returns three (k,) tensors.
    """
    count = torch.zeros(k, dtype=values.dtype, device=values.device).index_add_(0, seg, torch.ones_like(values))
    total = torch.zeros(k, dtype=values.dtype, device=values.device).index_add_(0, seg, values)
    mean = total / count
    dev2 = torch.zeros(k, dtype=values.dtype, device=values.device).index_add_(0, seg, (values - mean[seg]) ** 2)
    if unbiased:
        std = torch.sqrt(dev2 / (count - 1).clamp(min=1))
    else:
        std = torch.sqrt(dev2 / count)
    vmax = torch.full((k,), -torch.inf, dtype=values.dtype, device=values.device).scatter_reduce_(0, seg, values, "amax")
    vmin = torch.full((k,), torch.inf, dtype=values.dtype, device=values.device).scatter_reduce_(0, seg, values, "amin")
    return mean, std, vmax == vmin


def _normalize_segments(values: Tensor, seg: Tensor, k: int, std_scope: str, eps: float,
                        global_seg: Tensor | None = None, k_global: int = 1, unbiased: bool = False) -> Tensor:
    """``(v − mean_seg) / (std + eps)``; std over the segment (``group``) or over ``global_seg`` (``global``),
    population (ddof 0) or, with ``unbiased``, sample std (ddof 1).

    Constant segments give exactly 0 (not round-off).  values, seg, global_seg: (P,).
    """
    mean, std, const = _segment_stats(values, seg, k, unbiased)
    centred = torch.where(const[seg], torch.zeros_like(values), values - mean[seg])
    if std_scope == "group":
        scale = std[seg]
    else:
        gseg = torch.zeros_like(seg) if global_seg is None else global_seg
        scale = _segment_stats(values, gseg, k_global, unbiased)[1][gseg]
    return centred / (scale + eps)


def group_normalize(values: Tensor, group_ids: Tensor, *, std_scope: str = "group", eps: float = 1e-4,
                    unbiased: bool = False) -> Tensor:
    """Joint per-group normalisation (paper Eq. 5, method.md §5).

    values: (B,) or (B, T); group_ids: (B,).  For a group c, mean μ_c and population std s_c are taken over **all**
    its entries (N rows × T columns); ``out = (v − μ_c) / (s_c + eps)``.  ``std_scope="global"`` replaces s_c by
    the std over all B·T entries (Flow-GRPO's ``global_std``).  ``unbiased``: the sample std (ddof 1, DanceGRPO's
    ``group_rewards.std()``) in place of the population std.  A group whose entries are all equal gets exactly 0.
    Returns float32 of the same shape as ``values``.
    """
    _check_scope(std_scope, eps)
    v = values.detach().to(torch.float64)
    if v.ndim not in (1, 2):
        raise ValueError(f"values: expected shape (B,) or (B, T), got {tuple(v.shape)}")
    b = v.shape[0]
    inv, k = _group_index(group_ids, b)
    inv = inv.to(v.device)
    width = 1 if v.ndim == 1 else v.shape[1]
    seg = inv.view(b, 1).expand(b, width).reshape(-1)
    out = _normalize_segments(v.reshape(-1), seg, k, std_scope, eps, unbiased=unbiased)
    return out.view(v.shape).to(torch.float32)


def normalize_per_step(g: Tensor, group_ids: Tensor, *, std_scope: str = "group", eps: float = 1e-4,
                       unbiased: bool = False) -> Tensor:
    """Per-step normalisation (App. C ablation, method.md §5): each column k separately within each group.

    g: (B, T); ``out[i, k] = (g[i,k] − mean_{j∈c} g[j,k]) / (std_{j∈c} g[j,k] + eps)``; ``std_scope="global"``
    uses the std of column k over all B rows (what Flow-GRPO's tracker does with ``global_std`` and (B, T) input).
    ``unbiased``: sample std (ddof 1).  Returns (B, T) float32.
    """
    _check_scope(std_scope, eps)
    v = g.detach().to(torch.float64)
    if v.ndim != 2:
        raise ValueError(f"g: expected shape (B, T), got {tuple(v.shape)}")
    b, t = v.shape
    inv, k = _group_index(group_ids, b)
    inv = inv.to(v.device)
    cols = torch.arange(t, device=v.device).view(1, t)
    seg = (inv.view(b, 1) * t + cols).reshape(-1)  # (group, step) segments
    gseg = cols.expand(b, t).reshape(-1)  # step segments (global std per step)
    out = _normalize_segments(v.reshape(-1), seg, k * t, std_scope, eps, global_seg=gseg, k_global=t, unbiased=unbiased)
    return out.view(b, t).to(torch.float32)


def uniform_advantages(final: Tensor, group_ids: Tensor, num_steps: int, *, std_scope: str = "group",
                       eps: float = 1e-4, unbiased: bool = False) -> Tensor:
    """Flow-GRPO advantages (paper Eq. 4): ``(R − mean_c R)/(std_c R + eps)`` repeated over T steps (``unbiased``:
    the sample std, DanceGRPO's ``(R − mean)/(std() + 1e-8)`` with ``eps=1e-8``).

    final: (B,) final rewards; returns (B, num_steps) float32.
    """
    a = group_normalize(final, group_ids, std_scope=std_scope, eps=eps, unbiased=unbiased)
    return a.view(-1, 1).expand(-1, int(num_steps)).contiguous()


def gae(g: Tensor, gamma: float, lam: float) -> Tensor:
    """GAE over gains (method.md §6.2): ``A_{T−1} = G_{T−1}``, ``A_k = G_k + γλ·A_{k+1}`` (backward in k).

    γ convention: the gains themselves are the TD residuals δ_k (they equal the classic ``γ R_{k+1} − R_k`` only
    at γ = 1), so γ enters only through the product γλ.  γλ = 0 gives the gains, γλ = 1 gives ``R_T − R_k``.
    g: (B, T) -> (B, T), same dtype.
    """
    if g.ndim != 2:
        raise ValueError(f"g: expected shape (B, T), got {tuple(g.shape)}")
    c = float(gamma) * float(lam)
    out = torch.empty_like(g)
    acc = torch.zeros_like(g[:, 0])
    for k in range(g.shape[1] - 1, -1, -1):
        acc = g[:, k] + c * acc
        out[:, k] = acc
    return out


class EmaBaseline:
    """Per-step EMA baseline of the gains (method.md §6.1).

    ``b_k ← α·b_k + (1−α)·mean_i g_k^i``; the **first** update initialises ``b = mean_i g^i`` (no zero-start bias).
    ``__call__(g)`` returns ``g − b`` using the baseline **before** it sees ``g`` (so b only carries earlier
    batches and does not depend on the rows it centres), then updates ``b`` with ``g``.  On the very first call b
    is first initialised to the batch mean, so that call returns ``g − mean_i g``.  g: (B, T) -> (B, T).
    """

    def __init__(self, alpha: float = 0.9):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"ema_alpha: must be in [0, 1), got {alpha!r}")
        self.alpha = float(alpha)
        self.b: Tensor | None = None  # (T,) float64
        self.num_updates = 0

    def update(self, g: Tensor) -> None:
        """Fold the batch mean of ``g`` (B, T) into the baseline."""
        batch_mean = g.detach().to(torch.float64).mean(dim=0).cpu()
        if self.b is None or self.num_updates == 0:
            self.b = batch_mean
        else:
            if self.b.shape != batch_mean.shape:
                raise ValueError(f"g: expected {self.b.shape[0]} steps, got {batch_mean.shape[0]}")
            self.b = self.alpha * self.b + (1.0 - self.alpha) * batch_mean
        self.num_updates += 1

    def __call__(self, g: Tensor) -> Tensor:
        if self.b is None:
            self.update(g)
            return g - self.b.to(device=g.device, dtype=g.dtype)
        if self.b.shape[0] != g.shape[1]:
            raise ValueError(f"g: expected {self.b.shape[0]} steps, got {g.shape[1]}")
        out = g - self.b.to(device=g.device, dtype=g.dtype)
        self.update(g)
        return out

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "b": None if self.b is None else self.b.clone(), "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = float(state["alpha"])
        self.b = None if state["b"] is None else torch.as_tensor(state["b"], dtype=torch.float64).clone()
        self.num_updates = int(state["num_updates"])


@dataclass
class AdvantageOut:
    """advantages: (B, T) float32, clipped to ±adv_clip; gains: (B, T) raw gains or None (uniform);
    stats: python floats (``zero_groups``, ``zero_rows``, ``adv_clip_frac``, ``adv_abs_mean_step{k}``,
    ``gain_abs_mean_step{k}``, ``gain_mean``, ``telescope_mean`` = mean (R_T − R_0)); rows: per-row (B,) tensors
    the credit hands to the objective (:attr:`stepflow.objectives.base.Objective.row_info`, e.g. GARDO's KL gate)."""

    advantages: Tensor
    gains: Tensor | None
    stats: dict[str, float] = field(default_factory=dict)
    rows: dict[str, Tensor] = field(default_factory=dict)


def AdvantageConfig(scheme: str = "gain", **fields):  # noqa: N802 - the name code and tests build credits by
    """The credit of option ``scheme`` of the ``advantage`` group (conf/advantage/<scheme>.yaml's ``_target_``, its
    fields updated by ``fields``): code and tests that build a credit by its option name. ValueError for an unknown
    option or field."""
    from stepflow.core.parts import CONF_DIR, from_option

    return from_option("advantage", scheme, [CONF_DIR], key="scheme", **fields)


def AdvantageEstimator(credit):  # noqa: N802 - kept for code that wrapped a config in an estimator
    """The credit itself (a :class:`stepflow.credits.base.Credit` computes its advantages)."""
    return credit
