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
    "SCHEMES",
    "BRANCH_SCHEMES",
]

SCHEMES = ("uniform", "gain", "gain_per_step", "gain_ema", "gae", "turning_point", "tempflow", "g2rpo")
#: the credits whose rewards come from branch rollouts (stepflow.branch_loop): an ODE anchor, K SDE branches at each
#: trained step, each completed by the ODE (TempFlow-GRPO, Granular-GRPO; docs/method.md §13)
BRANCH_SCHEMES = ("tempflow", "g2rpo")
STD_SCOPES = ("group", "global")
NORMS = (None, "joint", "per_step")


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
class AdvantageConfig:
    """How rewards become per-step advantages.

    scheme:   ``uniform`` (Flow-GRPO Eq. 4) | ``gain`` (Eq. 5, joint) | ``gain_per_step`` (App. C) |
              ``gain_ema`` (§6.1) | ``gae`` (§6.2) | ``turning_point`` (TurningPoint-GRPO: d_t from the rewards of
              the states 0..n of an SDE window 0..n−1 and the final image, turning points credited R_T − R_{t−1},
              balanced; one normalisation per step column; with ``reward_source=completion`` as released) |
              ``tempflow`` / ``g2rpo`` (branch rollouts, :data:`BRANCH_SCHEMES`: an ODE anchor, ``branches`` SDE
              branches at each trained step completed by the ODE at ``granularities``; TempFlow-GRPO's per-step
              column normalisation, Granular-GRPO's sum over granularities). (Gain-weighted distillation is an
              objective: ``objective=distill``.)
    branches: tempflow / g2rpo: K, the SDE branches each rollout row draws at every trained step.
    granularities: tempflow / g2rpo: the strides of the ODE completions (Granular-GRPO's ``granular_list``); one
              reward per branch and granularity.
    std_scope: ``group`` | ``global`` (std over the whole batch).
    eps:      added to the std.        adv_clip: advantages are clamped to ±adv_clip.
    ema_alpha: α of :class:`EmaBaseline`.     gamma, lam: GAE's γ, λ (only γλ matters, see :func:`gae`).
    norm:     None (scheme default: joint, except ``gain_per_step``) | ``joint`` | ``per_step``; overrides the
              normalisation of the gain-family schemes; ignored for ``uniform`` (one value per row).
    unbiased_std: divide by the sample std (ddof 1, torch's ``Tensor.std()`` default: DanceGRPO's group std,
              fastvideo/train_grpo_flux.py L542) instead of the population std (ddof 0, Flow-GRPO's ``np.std``); in
              every scheme and scope. Default false.
    reward_source: where the stepwise rewards R_k of the gain schemes come from: ``tweedie`` (the x̂0 estimate of
              X_k by T′ Euler substeps, ``loop.substeps``; the paper's method) | ``completion`` (X_k completed to an
              image by the Euler ODE on the rest of the grid, ``stepflow.branch.complete``: the true reward of the
              state under the ODE, at T − k NFEs per state).
    over:     ``all`` (the gains of every step enter the normalisation, Eq. 5) | ``trained`` (only the trained
              steps' gains, normalised jointly over them; it applies to ``gain`` and ``gain_per_step``, the schemes
              that read every step's gain (gae, gain_ema) keep ``all``, see :attr:`effective_over`). With
              ``trained`` the
              advantages of the trained steps depend only on the states around them, so the loop estimates and
              scores only those and stops the rollout after the last one (:meth:`AdvantageEstimator.states_needed`).
    """

    scheme: str = "gain"
    std_scope: str = "group"
    eps: float = 1e-4
    adv_clip: float = 5.0
    ema_alpha: float = 0.9
    gamma: float = 1.0
    lam: float = 0.9
    norm: str | None = None
    over: str = "all"
    unbiased_std: bool = False
    reward_source: str = "tweedie"
    branches: int = 4
    granularities: list[int] = field(default_factory=lambda: [1])

    def __post_init__(self) -> None:
        if self.reward_source not in ("tweedie", "completion"):
            raise ValueError(f"reward_source: must be tweedie or completion, got {self.reward_source!r}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme: must be one of {SCHEMES}, got {self.scheme!r}")
        if self.std_scope not in STD_SCOPES:
            raise ValueError(f"std_scope: must be one of {STD_SCOPES}, got {self.std_scope!r}")
        if not (isinstance(self.branches, int) and not isinstance(self.branches, bool) and self.branches >= 1):
            raise ValueError(f"branches: must be an integer >= 1, got {self.branches!r}")
        gran = list(self.granularities) if isinstance(self.granularities, (list, tuple)) else None
        if not gran or any(not isinstance(g, int) or isinstance(g, bool) or g < 1 for g in gran) or len(set(gran)) < len(gran):
            raise ValueError(f"granularities: must be a list of distinct integers >= 1 (e.g. [1, 2]), got {self.granularities!r}")
        self.granularities = gran
        if self.scheme in BRANCH_SCHEMES and self.reward_source != "tweedie":
            raise ValueError(f"reward_source: advantage={self.scheme} rewards its branches' ODE completions already; "
                             "leave advantage.reward_source=tweedie (its default)")
        if self.norm not in NORMS:
            raise ValueError(f"norm: must be one of {NORMS}, got {self.norm!r}")
        if self.over not in ("all", "trained"):
            raise ValueError(f"over: must be all or trained, got {self.over!r}")
        if not isinstance(self.unbiased_std, bool):
            raise ValueError(f"unbiased_std: must be a bool, got {self.unbiased_std!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"eps: must be a float >= 0, got {self.eps!r}")
        if not (isinstance(self.adv_clip, (int, float)) and self.adv_clip > 0):
            raise ValueError(f"adv_clip: must be a float > 0, got {self.adv_clip!r}")
        if not (isinstance(self.ema_alpha, (int, float)) and 0.0 <= self.ema_alpha < 1.0):
            raise ValueError(f"ema_alpha: must be a float in [0, 1), got {self.ema_alpha!r}")
        if not (isinstance(self.gamma, (int, float)) and 0.0 <= self.gamma <= 1.0):
            raise ValueError(f"gamma: must be a float in [0, 1], got {self.gamma!r}")
        if not (isinstance(self.lam, (int, float)) and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"lam: must be a float in [0, 1], got {self.lam!r}")

    @property
    def effective_over(self) -> str:
        """``trained`` for gain / gain_per_step with ``over=trained``, else ``all``."""
        return "trained" if self.over == "trained" and self.scheme in ("gain", "gain_per_step") else "all"

    @property
    def effective_norm(self) -> str:
        """``joint`` or ``per_step`` for the gain-family schemes (``joint`` for uniform, where it is moot)."""
        if self.norm is not None:
            return self.norm
        return "per_step" if self.scheme == "gain_per_step" else "joint"


@dataclass
class AdvantageOut:
    """advantages: (B, T) float32, clipped to ±adv_clip; gains: (B, T) raw gains or None (uniform);
    stats: python floats (``zero_groups``, ``zero_rows``, ``adv_clip_frac``, ``adv_abs_mean_step{k}``,
    ``gain_abs_mean_step{k}``, ``gain_mean``, ``telescope_mean`` = mean (R_T − R_0))."""

    advantages: Tensor
    gains: Tensor | None
    stats: dict[str, float] = field(default_factory=dict)


class AdvantageEstimator:
    """Rewards (B, T+1) -> per-step advantages (B, T) according to a :class:`AdvantageConfig`."""

    def __init__(self, cfg: AdvantageConfig):
        self.cfg = cfg
        self.ema = EmaBaseline(cfg.ema_alpha) if cfg.scheme == "gain_ema" else None

    @property
    def needs_stepwise_rewards(self) -> bool:
        """False for ``uniform`` (only the final reward is read), True otherwise."""
        return self.cfg.scheme != "uniform"

    @property
    def branched(self) -> bool:
        """The credit's rewards come from branch rollouts (tempflow, g2rpo), not from the rollout's own states."""
        return self.cfg.scheme in BRANCH_SCHEMES

    def states_needed(self, trained: list[int], num_steps: int) -> list[int]:
        """The states k ∈ 0..T whose rewards R_k the advantages of the ``trained`` steps read: ``[T]`` for uniform
        credit, all of them for gains normalised over every step, ``{k, k + 1 : k trained}`` with ``over=trained``;
        ``turning_point``: ``0..n`` and T for the window ``0..n−1``; the branch schemes read none of the rollout's
        (their rollout is the anchor; :mod:`stepflow.branch_loop`)."""
        if self.branched:
            return [num_steps]
        if self.cfg.scheme == "turning_point":
            return sorted({*range(len(trained) + 1), num_steps})
        if not self.needs_stepwise_rewards:
            return [num_steps]
        if self.cfg.effective_over == "trained":
            return sorted({s for k in trained for s in (k, k + 1)})
        return list(range(num_steps + 1))

    def _normalize(self, values: Tensor, group_ids: Tensor) -> Tensor:
        fn = group_normalize if self.cfg.effective_norm == "joint" else normalize_per_step
        return fn(values, group_ids, std_scope=self.cfg.std_scope, eps=self.cfg.eps, unbiased=self.cfg.unbiased_std)

    def __call__(self, rewards: Tensor, group_ids: Tensor, num_steps: int | None = None,
                 trained: list[int] | None = None) -> AdvantageOut:
        """rewards: (B, T+1) (only the columns :meth:`states_needed` names are read; others may be NaN);
        group_ids: (B,) long; num_steps: T (checked against ``rewards``); trained: the trained steps (``over=trained``
        only; the other steps get advantage 0).  Returns :class:`AdvantageOut`."""
        cfg = self.cfg
        if rewards.ndim != 2 or rewards.shape[1] < 2:
            raise ValueError(f"rewards: expected shape (B, T+1), got {tuple(rewards.shape)}")
        t = rewards.shape[1] - 1
        if num_steps is not None and num_steps != t:
            raise ValueError(f"num_steps: {num_steps} does not match rewards with {t + 1} columns")
        cols = self.states_needed(list(trained or []), t)
        if not bool(torch.isfinite(rewards[:, cols]).all()):
            raise ValueError("rewards: non-finite values in the columns this scheme reads")

        g = None
        if cfg.effective_over == "trained":  # gains of the trained steps only, normalised jointly over them
            g = torch.zeros(rewards.shape[0], t, dtype=torch.float64)
            ks = sorted(trained or [])
            adv = torch.zeros(rewards.shape[0], t, dtype=torch.float32)
            if ks:
                g[:, ks] = (rewards[:, [k + 1 for k in ks]] - rewards[:, ks]).detach().to(torch.float64)
                adv[:, ks] = self._normalize(g[:, ks], group_ids)
        elif cfg.scheme == "turning_point":
            adv, g, turning = self._turning_point(rewards, group_ids, t, sorted(trained or []))
        elif cfg.scheme in BRANCH_SCHEMES:
            raise ValueError(f"advantage={cfg.scheme}: its advantages come from branch rollouts "
                             "(AdvantageEstimator.branch_advantages), not from one rollout's rewards")
        elif cfg.scheme == "uniform":
            adv = uniform_advantages(rewards[:, -1], group_ids, t, std_scope=cfg.std_scope, eps=cfg.eps,
                                     unbiased=cfg.unbiased_std)
        else:
            g = gains(rewards.detach().to(torch.float64))
            if cfg.scheme == "gain_ema":
                src = self.ema(g)
            elif cfg.scheme == "gae":
                src = gae(g, cfg.gamma, cfg.lam)
            else:  # gain, gain_per_step
                src = g
            adv = self._normalize(src, group_ids)
        raw = adv
        adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)
        stats = self._stats(raw, adv, g, rewards, group_ids,
                            sorted(trained or []) if cfg.effective_over == "trained" or cfg.scheme == "turning_point"
                            else None)
        if cfg.scheme == "turning_point":
            stats["turning_frac"] = turning
        return AdvantageOut(advantages=adv, gains=None if g is None else g.to(torch.float32), stats=stats)

    def _turning_point(self, rewards: Tensor, group_ids: Tensor, t: int,
                       trained: list[int]) -> tuple[Tensor, Tensor, float]:
        """TurningPoint-GRPO (:func:`stepflow.branch_credit.turning_point_rewards` with the released flags, then
        :func:`~stepflow.branch_credit.per_step_advantages`): R_0 = ``rewards[:, 0]`` (under
        ``reward_source=completion`` the pure-ODE image from the same noise), R_t = ``rewards[:, t]`` for the window's
        t = 1..n (the first t SDE steps, then the ODE), R_sde = ``rewards[:, T]``. The trained steps must be the window
        ``0..n−1`` (the released ``sde_window_range = (0, n)``). Returns the (B, T) advantages (0 outside the window;
        not yet clipped), the per-step rewards r_t in the window's columns (the "gains" logged) and the fraction of
        (row, step) pairs that are kept turning points."""
        from stepflow.branch_credit import per_step_advantages, turning_point_rewards

        n = len(trained)
        if trained != list(range(n)) or n == 0:
            raise ValueError(f"advantage=turning_point: the trained steps must be an SDE window starting at step 0 "
                             f"(TurningPoint-GRPO's sde_window_range (0, n)), got {trained}; set train.train_steps=null "
                             "with window=none or a window that starts at 0")
        r = rewards.detach().to(torch.float64)
        tp = turning_point_rewards(r[:, 0], r[:, 1:n + 1], r[:, t], eta=1.0)
        adv = torch.zeros(r.shape[0], t, dtype=torch.float32)
        adv[:, :n] = per_step_advantages(tp.rewards, group_ids, eps=self.cfg.eps,
                                         global_std=self.cfg.std_scope == "global")
        g = torch.zeros(r.shape[0], t, dtype=torch.float64)
        g[:, :n] = tp.rewards.double()
        return adv, g, float(tp.turning.double().mean())

    def branch_advantages(self, rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The advantages of branch rollouts (:mod:`stepflow.branch_loop`). rewards: (B, K, S, G) the reward of row
        i's branch j at trained step s completed at granularity g; group_ids: (B,) the rows' prompts (a group: every
        row and branch of a prompt). ``tempflow``: :func:`stepflow.branch_credit.tempflow_advantages` on the (B·K, S)
        rewards (G = 1: each step's column normalised within the group, population std + eps); ``g2rpo``:
        :func:`~stepflow.branch_credit.g2rpo_advantages` on the (B·K, S, G) rewards (normalised per (step,
        granularity) with the sample std + eps, summed over the granularities). Clipped to ±adv_clip. Returns
        (B, K, S) float32 and the stats."""
        from stepflow.branch_credit import g2rpo_advantages, tempflow_advantages

        cfg = self.cfg
        b, k, s, g = rewards.shape
        gid = torch.as_tensor(group_ids).repeat_interleave(k)
        if cfg.scheme == "tempflow":
            if g != 1:
                raise ValueError(f"advantage=tempflow: one completion per branch (granularities [1]), got {g}")
            raw = tempflow_advantages(rewards.reshape(b * k, s), gid, eps=cfg.eps, global_std=cfg.std_scope == "global")
        else:
            raw = g2rpo_advantages(rewards.reshape(b * k, s, g), gid, eps=cfg.eps)
        adv = raw.clamp(-cfg.adv_clip, cfg.adv_clip)
        stats = {"adv_clip_frac": float((raw.abs() > cfg.adv_clip).double().mean()),
                 "zero_rows": float((adv.view(b, k * s) == 0).all(1).sum()),
                 "num_groups": float(len(torch.unique(torch.as_tensor(group_ids))))}
        return adv.view(b, k, s), stats

    def _stats(self, raw: Tensor, adv: Tensor, g: Tensor | None, rewards: Tensor, group_ids: Tensor,
               gain_steps: list[int] | None = None) -> dict:
        b, t = adv.shape
        inv, k = _group_index(group_ids, b)
        row_zero = (adv == 0).all(dim=1)  # (B,)
        group_nonzero = torch.zeros(k, dtype=torch.long).index_add_(0, inv.cpu(), (~row_zero).long().cpu())
        stats: dict[str, float] = {
            "zero_groups": float((group_nonzero == 0).sum().item()),
            "zero_rows": float(row_zero.sum().item()),
            "num_groups": float(k),
            "adv_clip_frac": float((raw.abs() > self.cfg.adv_clip).double().mean().item()),
        }
        adv_abs = adv.abs().double().mean(dim=0)
        for j in range(t):
            stats[f"adv_abs_mean_step{j}"] = float(adv_abs[j].item())
        if g is not None:
            g_abs = g.abs().mean(dim=0)
            for j in (range(t) if gain_steps is None else gain_steps):
                stats[f"gain_abs_mean_step{j}"] = float(g_abs[j].item())
            if gain_steps != []:
                stats["gain_mean"] = float((g if gain_steps is None else g[:, gain_steps]).mean().item())
            telescope = (rewards[:, -1] - rewards[:, 0]).double()
            if bool(torch.isfinite(telescope).all()):
                stats["telescope_mean"] = float(telescope.mean().item())
        return stats

    def state_dict(self) -> dict:
        """EMA state (empty for schemes without state)."""
        return {"ema": self.ema.state_dict()} if self.ema is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
