"""Forward-process (re-noising) losses: DiffusionNFT, AWM and AdvantageFlow (league.md §1, §2; followups.md §3.4).

These methods never score a sampler's transitions. They take the rollout's clean final latents ``x0`` and a reward
advantage, re-noise ``x0`` to a training time ``t`` with fresh noise and regress the velocity there, weighted by the
advantage. The sampler is a black box, so any solver works. This module holds only the pure math: tensors in,
tensors out, no policy objects. The caller runs the models (current, old/EMA, reference) at ``x_t``.

Conventions (method.md §1, the same as :mod:`stepflow.math.sde`):

- ``x_t = (1 − t)·x0 + t·ε``; ``t = 1`` is noise, ``t = 0`` is data; the velocity is ``v ≈ ε − x0``;
  Tweedie ``x̂0 = x_t − t·v``;
- tensors are (B, C, H, W) (any (B, ...) works); a time ``t`` is a python float, a 0-d or a (B,) tensor;
  "mean_dims" is the mean over all non-batch dims;
- the math is fp32 (inputs promoted with ``.float()``, differentiably), except where the released code computes in
  float64 (NFT's adaptive weight and the quotient it promotes; AWM's log-prob). Those places say so;
- the model outputs of the old / EMA / reference policies, ``x0``, ``x_t`` and advantages are detached inside;
  only the current velocity ``v`` (or ``f``) carries a gradient;
- diagnostics are detached 0-d tensors (no host sync); call ``.item()`` when logging.

Sources, read from the released code:

- DiffusionNFT: NVlabs/DiffusionNFT @ 24af555, ``scripts/train_nft_sd3.py`` (cited below as ``nft:L``), ``config/nft.py``.
- AWM: scxue/advantage_weighted_matching @ be51372, ``advantage_weighted_matching/scripts/train_sd3_awm.py``
  (cited as ``awm:L``), ``config/dgx_awm.py``.
- AdvantageFlow (arXiv 2605.26013): no code and no full text. The loss is as restated by MeanFlowAdvantage (eq. 2).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stepflow.math.loss import grpo_surrogate

__all__ = [
    "noised",
    "x0_from_velocity",
    "velocity_kl",
    "NFT_ADV_MODES",
    "NFT_DECAY_TYPES",
    "nft_reward",
    "nft_loss",
    "nft_old_decay",
    "AWM_WEIGHTINGS",
    "awm_advantage",
    "awm_log_prob",
    "awm_policy_loss",
    "awm_train_indices",
    "awm_ema_decay",
    "advantageflow_loss",
    "advantageflow_stable",
    "advantageflow_target",
]

NFT_ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
NFT_DECAY_TYPES = (0, 1, 2)
AWM_WEIGHTINGS = ("ghuber", "Uniform", "t", "t**2", "huber")
_NFT_WEIGHT_MIN = 1e-5  # nft:L945, L953 ``.clip(min=0.00001)``
_AWM_TINY = 1e-10  # awm:L247-249


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def _time(t, like: Tensor, dtype=torch.float32) -> Tensor:
    """``t`` (float, 0-d or (B,)) as a (B, 1, ..., 1) tensor that broadcasts against ``like`` (B, ...)."""
    b = like.shape[0]
    t = torch.as_tensor(t, device=like.device).to(dtype)
    if t.ndim == 0:
        t = t.expand(b)
    elif t.shape != (b,):
        raise ValueError(f"t: expected a scalar or shape ({b},), got {tuple(t.shape)}")
    return t.reshape(b, *([1] * (like.ndim - 1)))


def _mean_dims(z: Tensor) -> Tensor:
    """Mean over all non-batch dims: (B, ...) -> (B,)."""
    return z.reshape(z.shape[0], -1).mean(dim=1)


def _same_shape(ref: Tensor, **others: Tensor) -> None:
    for name, x in others.items():
        if x.shape != ref.shape:
            raise ValueError(f"{name}: expected shape {tuple(ref.shape)}, got {tuple(x.shape)}")


def _per_sample(name: str, x: Tensor, b: int) -> None:
    if x.shape != (b,):
        raise ValueError(f"{name}: expected shape ({b},), got {tuple(x.shape)}")


# ----------------------------------------------------------------------------------------------------------------
# shared forward-process pieces
# ----------------------------------------------------------------------------------------------------------------
def noised(x0: Tensor, eps: Tensor, t) -> Tensor:
    """The forward process ``x_t = (1 − t)·x0 + t·ε`` (nft:L868-870, awm:L1232, L1268). x0, eps: (B, ...); t: float or
    (B,). Returns fp32 (B, ...)."""
    _same_shape(x0, eps=eps)
    te = _time(t, x0)
    return (1.0 - te) * x0.float() + te * eps.float()


def x0_from_velocity(x_t: Tensor, v: Tensor, t) -> Tensor:
    """Tweedie ``x̂0 = x_t − t·v`` (differentiable in ``v``). x_t, v: (B, ...); t: float or (B,). Returns fp32."""
    _same_shape(x_t, v=v)
    return x_t.float() - _time(t, x_t) * v.float()


def velocity_kl(v: Tensor, v_ref: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """``mean_batch mean_dims (v − sg(v_ref))²``: DiffusionNFT's KL to the reference (weight β_kl = ``train.beta``,
    nft:L966-970), and AWM's ``kl_weight='Uniform'`` terms to the reference (weight β) and to the EMA adapter
    (weight ``ema_beta``) (awm:L1332-1350). v (with grad), v_ref: (B, ...). Returns a 0-d tensor in ``dtype``
    (AWM computes it in float64 on its ``.double()`` model outputs: pass ``dtype=torch.float64`` for parity)."""
    _same_shape(v, v_ref=v_ref)
    return _mean_dims((v.to(dtype) - v_ref.detach().to(dtype)) ** 2).mean()


# ----------------------------------------------------------------------------------------------------------------
# §1 DiffusionNFT
# ----------------------------------------------------------------------------------------------------------------
def nft_reward(adv: Tensor, adv_clip_max: float = 5.0, mode: str = "all") -> Tensor:
    """DiffusionNFT's advantage → "optimality probability" ``r ∈ [0, 1]`` (nft:L910-929).

    ``A_c = clip(A, ±A_max)``, then by ``mode`` (``train.adv_mode``, default ``"all"``, config/nft.py L62):

    - ``all``: ``A_c`` as is, so ``r = A_c/(2 A_max) + 1/2`` spans [0, 1] (A = 0 → 0.5, A ≥ A_max → 1, A ≤ −A_max → 0);
    - ``positive_only``: ``A_c ← clip(A_c, 0, A_max)``, so r ∈ [0.5, 1] (negatives become 0.5);
    - ``negative_only``: ``A_c ← clip(A_c, −A_max, 0)``, so r ∈ [0, 0.5] (positives become 0.5);
    - ``one_only``: ``A_c ← 1 if A_c > 0 else 0``. This replaces the *advantage*, not r, so r ∈ {0.5 + 1/(2 A_max), 0.5}
      = {0.6, 0.5} at A_max = 5 (not {1, 0});
    - ``binary``: ``A_c ← sign(A_c)``, so r ∈ {0.6, 0.5, 0.4} at A_max = 5 (A = 0 → 0.5).

    Then ``r = clamp(A_c/A_max/2 + 0.5, 0, 1)``. adv: (B,) (or any shape; the map is elementwise). Returns fp32.
    """
    if mode not in NFT_ADV_MODES:
        raise ValueError(f"mode: must be one of {NFT_ADV_MODES}, got {mode!r}")
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max: must be > 0, got {adv_clip_max!r}")
    a = torch.clamp(adv.detach().float(), -adv_clip_max, adv_clip_max)
    if mode == "positive_only":
        a = torch.clamp(a, 0, adv_clip_max)
    elif mode == "negative_only":
        a = torch.clamp(a, -adv_clip_max, 0)
    elif mode == "one_only":
        a = torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))
    elif mode == "binary":
        a = torch.sign(a)
    return torch.clamp((a / adv_clip_max) / 2.0 + 0.5, 0, 1)


def _nft_side(x_t: Tensor, v_side: Tensor, te: Tensor, x0: Tensor) -> Tensor:
    """``mean_dims (x̂0 − x0)² / sg(clamp_min(mean_dims |x̂0 − x0|, 1e-5))`` for ``x̂0 = x_t − t·v_side``
    (nft:L939-957). The weight is float64 (``.double()`` in the code), and it promotes the quotient to float64.
    Returns (B,) float64."""
    x0_hat = x_t - te * v_side
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (x0_hat.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=_NFT_WEIGHT_MIN)
    return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(v: Tensor, v_old: Tensor, x_t: Tensor, x0: Tensor, t, r: Tensor, beta: float,
             adv_clip_max: float = 5.0) -> tuple[Tensor, dict[str, Tensor]]:
    """DiffusionNFT's negative-aware policy loss at one training time (nft:L934-960), to be minimised.

    ``v⁺ = β·v + (1 − β)·sg(v_old)`` (implicit positive policy, L934); ``v⁻ = (1 + β)·sg(v_old) − β·v`` (implicit
    negative policy, L935-937); ``x̂0^± = x_t − t·v^±``;
    ``L^± = mean_dims (x̂0^± − x0)² / sg(clamp_min(mean_dims |x̂0^± − x0|, 1e-5))`` (adaptive weighting, L939-957);
    ``loss = mean_batch( A_max · (r·L⁺/β + (1 − r)·L⁻/β) )`` (L959-960; the code divides each term by β, then
    scales by A_max, then averages).

    v (with grad), v_old: (B, ...) velocities of the current and the old ("old" adapter, no grad) policy at ``x_t``;
    x_t, x0: (B, ...); t: float or (B,) (the code's ``timesteps/1000``, per sample); r: (B,) from :func:`nft_reward`;
    beta: ``config.beta`` (1.0 by default, 0.1 for OCR / multi-reward), > 0; adv_clip_max: A_max.
    The KL to the reference (β_kl·:func:`velocity_kl`) is added by the caller (L966-970).

    Precision: the velocities are promoted to fp32 before mixing (the code mixes them in the autocast dtype); the
    weight and the quotient are float64 as in the code, so the loss is a **float64** 0-d tensor (as is the code's);
    r stays fp32 as in the code. With fp32 inputs the loss and its gradient equal the released lines bit for bit.
    Diagnostics (detached 0-d): ``policy_loss``, ``unweighted_policy_loss`` (the mean before ×A_max, L964),
    ``positive_loss``, ``negative_loss`` (batch means of L⁺, L⁻), ``old_deviate`` (mean (v − v_old)², L932), ``r_mean``.
    """
    if not beta > 0:
        raise ValueError(f"beta: must be > 0, got {beta!r}")
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max: must be > 0, got {adv_clip_max!r}")
    _same_shape(v, v_old=v_old, x_t=x_t, x0=x0)
    _per_sample("r", r, v.shape[0])
    v = v.float()
    v_old = v_old.detach().float()
    x_t = x_t.detach().float()
    x0 = x0.detach().float()
    r = r.detach().float()  # fp32 as in the code: (1 − r) is rounded in fp32, then promoted by the float64 L⁻
    te = _time(t, v)
    v_pos = beta * v + (1.0 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v
    loss_pos = _nft_side(x_t, v_pos, te, x0)
    loss_neg = _nft_side(x_t, v_neg, te, x0)
    ori = r * loss_pos / beta + (1.0 - r) * loss_neg / beta
    loss = (ori * adv_clip_max).mean()
    with torch.no_grad():
        stats = {
            "policy_loss": loss.detach(),
            "unweighted_policy_loss": ori.detach().mean(),
            "positive_loss": loss_pos.detach().mean(),
            "negative_loss": loss_neg.detach().mean(),
            "old_deviate": ((v.detach() - v_old) ** 2).mean(),
            "r_mean": r.mean(),
        }
    return loss, stats


def nft_old_decay(step: int, decay_type: int = 1) -> float:
    """The old policy's EMA decay ``d`` in ``θ_old ← d·θ_old + (1 − d)·θ``, applied after every epoch at the
    optimiser-step counter ``step`` (``return_decay``, nft:L169-189; used at L1035-1039).

    ``0 if step < flat else min((step − flat)·uprate, uphold)`` with (flat, uprate, uphold) =
    type 0: (0, 0, 0), always 0 (on-policy); type 1 (default, config/nft.py L60): (0, 0.001, 0.5), min(0.001·step, 0.5);
    type 2 (OCR, L78): (75, 0.0075, 0.999), 0 before step 75, then min(0.0075·(step − 75), 0.999).
    """
    params = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}
    if decay_type not in params:
        raise ValueError(f"decay_type: must be one of {NFT_DECAY_TYPES}, got {decay_type!r}")
    flat, uprate, uphold = params[decay_type]
    if step < flat:
        return 0.0
    return float(min((step - flat) * uprate, uphold))


# ----------------------------------------------------------------------------------------------------------------
# §2 AWM
# ----------------------------------------------------------------------------------------------------------------
def awm_advantage(adv: Tensor, adv_clip_max: float = 5.0, advantage_max: float | None = 1.0) -> Tensor:
    """AWM's advantage: ``clip(A, ±adv_clip_max) / adv_clip_max · advantage_max`` → [−advantage_max, advantage_max]
    (awm:L1293-1299). With ``advantage_max=None`` only the clip is applied (the code's ``is not None`` branch).
    adv: (B,). Returns fp32, detached."""
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max: must be > 0, got {adv_clip_max!r}")
    a = torch.clamp(adv.detach().float(), -adv_clip_max, adv_clip_max)
    if advantage_max is not None:
        a = a / adv_clip_max * advantage_max
    return a


def awm_log_prob(v: Tensor, target: Tensor, t, kind: str = "ghuber", p: float = 0.25) -> Tensor:
    """AWM's surrogate "log-prob" ``−w(ℓ, t)`` of one re-noised sample (``compute_log_prob_awm``, awm:L210-252).

    ``ℓ = mean_dims (v − target)²`` with ``target = ε − x0``, computed in **float64** (L238-239). Then by ``kind``
    (``train.weighting``; the released configs use ``ghuber`` with p = ``train.ghuber_power`` = 0.25):

    - ``ghuber``: ``−((ℓ + 1e-10)^p − (1e-10)^p)·t/p`` (L248-249; note the ×t);
    - ``Uniform``: ``−ℓ``;  ``t``: ``−t·ℓ``;  ``t**2``: ``−t²·ℓ``;
    - ``huber``: ``−(sqrt(ℓ + 1e-10) − 1e-5)·t`` (L246-247).

    v (with grad), target: (B, ...); t: float or (B,) (the code's ``timesteps/1000``, shared by the micro-batch but
    allowed per sample here). The code takes the difference ``ε.double() − x0.double()`` in float64: pass
    ``target = eps.double() - x0.double()`` for bit parity (any dtype is accepted and cast to float64).
    Returns (B,) float64. Not a density: it is a weighted flow-matching loss, negated.
    """
    if kind not in AWM_WEIGHTINGS:
        raise ValueError(f"kind: must be one of {AWM_WEIGHTINGS}, got {kind!r}")
    if kind == "ghuber" and not p > 0:
        raise ValueError(f"p: must be > 0, got {p!r}")
    _same_shape(v, target=target)
    b = v.shape[0]
    tt = _time(t, v).reshape(b)  # fp32, as the code's ``timestep``; float64 · fp32 promotes to float64
    sq = _mean_dims((v.double() - target.detach().double()) ** 2)  # ℓ ≥ 0; the code's log_prob is −ℓ
    if kind == "Uniform":
        return -sq
    if kind == "t":
        return -sq * tt
    if kind == "t**2":
        return -sq * tt**2  # t² in fp32, then promoted (the code's ``log_prob * timestep.view(-1)**2``)
    if kind == "huber":
        return -(torch.sqrt(sq + _AWM_TINY) - 1e-5) * tt
    tiny = torch.tensor(_AWM_TINY, dtype=torch.float64, device=v.device)
    return -(torch.pow(sq + _AWM_TINY, p) - torch.pow(tiny, p)) * tt / p


def awm_policy_loss(logp: Tensor, logp_old: Tensor, adv: Tensor,
                    clip_range: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """AWM's clipped surrogate on the surrogate log-probs (awm:L1301-1327, ``loss_type='exp_first'``), to be minimised:
    GRPO's own (:func:`stepflow.math.loss.grpo_surrogate`) with AWM's names and checks.

    ``ρ = exp(logp − sg(logp_old))``; ``loss = mean max(−A·ρ, −A·clip(ρ, 1 − c, 1 + c))``, c = ``train.clip_range``
    (1 in the released configs, so effectively off). logp (with grad), logp_old, adv: equal shapes (N,), one entry
    per (training time, sample). For ``exp_first`` flatten the (T, B) log-probs and repeat A over T, as the code
    does (L1317). For ``sum_first`` pass log-probs already averaged over T (L1301-1304).

    On-policy (``off_policy=False``), logp_old is logp detached (L1283-1284), so ρ ≡ 1 and
    ``∇loss = −mean A·∇logp = mean A·∇w(ℓ, t)``. The computation runs in logp's dtype (float64 from
    :func:`awm_log_prob`). Diagnostics (detached 0-d): ``clip_frac`` (mean of |ρ − 1| > c, L1356-1360),
    ``ratio_mean``, ``ratio_min``, ``ratio_max``.
    """
    if not clip_range > 0:
        raise ValueError(f"clip_range: must be > 0, got {clip_range!r}")
    if not (logp.shape == logp_old.shape == adv.shape) or logp.ndim != 1:
        raise ValueError(f"logp/logp_old/adv: expected equal (N,) shapes, got "
                         f"{tuple(logp.shape)}, {tuple(logp_old.shape)}, {tuple(adv.shape)}")
    return grpo_surrogate(logp, logp_old, adv, clip_range)


def awm_train_indices(num_steps: int, n: int = 6, frac: float = 0.9, generator: torch.Generator | None = None,
                      *, short: str = "each_once") -> list[int]:
    """AWM's trained grid indices, ``time_type='discrete_wo_init'`` (awm:L1197-1205): one index per stratum.

    ``M = int(num_steps·frac)``; ``b = linspace(1, M, n + 1)`` (float32); stratum j is
    ``[floor b_j, floor b_{j+1})``; ``idx_j = floor b_j + floor(u_j·(floor b_{j+1} − floor b_j))``, u_j ~ U[0, 1)
    from ``torch.rand(n, generator=generator)``. Index 0 (t = 1) and the tail ``[M, num_steps)`` are never drawn.
    The released defaults (14 steps, n = 6, frac = 0.9) give strata [1,2) [2,4) [4,6) [6,8) [8,10) [10,12). The
    training time is ``grid[idx]``, shared by the whole micro-batch.

    Small grids (stepflow's miniature worlds run 4-10 steps). When ``M − 1 ≥ n`` every stratum holds at least one
    index and the strata are disjoint, so the draw is exactly the released one. When ``M − 1 < n`` some strata are
    empty (floor b_j = floor b_{j+1}). The released code then returns the stratum's lower bound, which is also the
    previous stratum's (excluded) upper bound, so some indices repeat and the times are unevenly weighted
    (e.g. 6 steps: ``[1, 1, 2, 3, 3, 4]``). ``short`` picks what happens then:

    - ``"each_once"`` (default): return every eligible index ``1 .. M−1`` once, in order (``M − 1 < n`` of them,
      no draw, the generator untouched);
    - ``"released"``: the released draw, repeats included.

    Returns the ``n`` (or ``M − 1``) indices in increasing order. Raises ``ValueError`` when ``M < 2`` (no index
    is eligible).
    """
    if short not in ("each_once", "released"):
        raise ValueError(f"short: must be 'each_once' or 'released', got {short!r}")
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n!r}")
    if not 0 < frac <= 1:
        raise ValueError(f"frac: must be in (0, 1], got {frac!r}")
    m = int(num_steps * frac)
    if m < 2:
        raise ValueError(f"num_steps: int({num_steps}·{frac}) = {m} leaves no index in [1, {m}); "
                         "need int(num_steps·frac) >= 2")
    if m - 1 < n and short == "each_once":
        return list(range(1, m))
    boundaries = torch.linspace(1, m, steps=n + 1)
    lower = boundaries[:-1].long()
    upper = boundaries[1:].long()
    u = torch.rand(n, generator=generator)
    return (lower + (u * (upper - lower)).long()).tolist()


def awm_ema_decay(step: int, kl_ema_decay: float = 0.3, rate: float = 0.001, kind: str = "linear") -> float:
    """The decay of AWM's "ema" adapter (the target of the weight-``ema_beta`` KL term), in
    ``θ_ema ← d·θ_ema + (1 − d)·θ`` after every epoch at the optimiser-step counter ``step`` (awm:L1409-1417):
    ``linear`` (released configs): ``d = min(kl_ema_decay, rate·step)``, rate 0.001 hard-coded in the code;
    ``constant``: ``d = kl_ema_decay``."""
    if kind == "constant":
        return float(kl_ema_decay)
    if kind != "linear":
        raise ValueError(f"kind: must be 'linear' or 'constant', got {kind!r}")
    return float(min(kl_ema_decay, rate * step))


# ----------------------------------------------------------------------------------------------------------------
# AdvantageFlow (followups.md §3.4)
# ----------------------------------------------------------------------------------------------------------------
def _coef(c, b: int, device) -> Tensor:
    """A float or (B,) coefficient as a (B,) fp32 tensor."""
    c = torch.as_tensor(c, dtype=torch.float32, device=device)
    if c.ndim == 0:
        return c.expand(b)
    _per_sample("coefficient", c, b)
    return c.detach()


def advantageflow_stable(adv: Tensor, gamma, lam) -> Tensor:
    """Whether each sample's AdvantageFlow loss is strictly convex in f: ``A + γ + λ > 0`` (its Hessian in f is
    ``2(A + γ + λ)/D·I`` with the mean over D dims). adv: (B,); gamma, lam: float or (B,). Returns (B,) bool."""
    a = adv.detach().float()
    b = a.shape[0]
    return (a + _coef(gamma, b, a.device) + _coef(lam, b, a.device)) > 0


def advantageflow_target(x0: Tensor, f_old: Tensor, f_ref: Tensor, adv: Tensor, gamma, lam) -> Tensor:
    """The per-sample minimiser ``f* = (A·x0 + γ·f_old + λ·f_ref) / (A + γ + λ)`` of :func:`advantageflow_loss`.

    x0, f_old, f_ref: (B, ...); adv: (B,); gamma, lam: float or (B,). Returns fp32 (B, ...), detached. Rows with
    ``A + γ + λ ≤ 0`` have no minimiser (the loss is then concave or linear in f) and come back as NaN. Mask them
    with :func:`advantageflow_stable`.
    """
    _same_shape(x0, f_old=f_old, f_ref=f_ref)
    b = x0.shape[0]
    _per_sample("adv", adv, b)
    a = adv.detach().float()
    g = _coef(gamma, b, x0.device)
    lm = _coef(lam, b, x0.device)
    den = a + g + lm
    shape = (b, *([1] * (x0.ndim - 1)))
    num = (a.view(shape) * x0.detach().float() + g.view(shape) * f_old.detach().float()
           + lm.view(shape) * f_ref.detach().float())
    safe = torch.where(den > 0, den, torch.ones_like(den)).view(shape)
    return torch.where((den > 0).view(shape), num / safe, torch.full_like(num, float("nan")))


def advantageflow_loss(f: Tensor, x0: Tensor, f_old: Tensor, f_ref: Tensor, adv: Tensor, gamma,
                       lam) -> tuple[Tensor, dict[str, Tensor]]:
    """AdvantageFlow's advantage-weighted least squares in x0 space (arXiv 2605.26013, followups.md §3.4).

    ``ℓ_i = A_i·mean_dims(f − x0)² + γ·mean_dims(f − sg f_old)² + λ·mean_dims(f − sg f_ref)²``;
    ``loss = mean_batch ℓ_i``, with ``f = x_t − t·v_θ(x_t, t)`` the current x0-prediction (:func:`x0_from_velocity`),
    ``f_old`` / ``f_ref`` those of the rollout (old) and reference policies at the same ``x_t``.

    What was inferred: the paper's full text and code are not available. The loss is as restated by the
    MeanFlowAdvantage paper (eq. 2), which writes squared norms ‖·‖². Here each norm is a **mean over dims** (the
    stepflow convention, so the scale does not depend on the latent size); this scales every term by the same 1/D,
    so the minimiser :func:`advantageflow_target` and the convexity condition :func:`advantageflow_stable`
    (``A + γ + λ > 0``) are unchanged. In velocity space the same loss is
    ``t²·(A‖v − (ε − x0)‖² + γ‖v − v_old‖² + λ‖v − v_ref‖²)``. How A is normalised or clipped and the values of
    γ and λ are not known; the caller chooses them.

    f (with grad), x0, f_old, f_ref: (B, ...); adv: (B,); gamma, lam: float or (B,) (≥ 0 in intended use). Returns
    ``(loss 0-d fp32, stats)``, with stats ``fit`` (mean_i A_i·mean_dims(f − x0)²), ``prox_old``, ``prox_ref`` (the
    unweighted batch means of the two proximity distances) and ``unstable_frac`` (the fraction of rows with
    A + γ + λ ≤ 0, where the loss is not convex), all detached.
    """
    _same_shape(f, x0=x0, f_old=f_old, f_ref=f_ref)
    b = f.shape[0]
    _per_sample("adv", adv, b)
    f = f.float()
    a = adv.detach().float()
    g = _coef(gamma, b, f.device)
    lm = _coef(lam, b, f.device)
    d_fit = _mean_dims((f - x0.detach().float()) ** 2)
    d_old = _mean_dims((f - f_old.detach().float()) ** 2)
    d_ref = _mean_dims((f - f_ref.detach().float()) ** 2)
    loss = (a * d_fit + g * d_old + lm * d_ref).mean()
    with torch.no_grad():
        stats = {
            "fit": (a * d_fit).detach().mean(),
            "prox_old": d_old.detach().mean(),
            "prox_ref": d_ref.detach().mean(),
            "unstable_frac": ((a + g + lm) <= 0).float().mean(),
        }
    return loss, stats
