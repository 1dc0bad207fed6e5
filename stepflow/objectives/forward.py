"""The forward-process objectives: DiffusionNFT, AWM and AdvantageFlow (docs/method.md §11; the math in
:mod:`stepflow.math.forward`). Each trains on the rollout's final latents re-noised at K grid times per sample; none
reads a log-prob, so any rollout sampler works (the released ones: DPM-Solver-2 for NFT, SDE-then-ODE for AWM)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stepflow.core.ema import ParamCopy
from stepflow.math.forward import (
    advantageflow_loss,
    advantageflow_stable,
    awm_advantage,
    awm_ema_decay,
    awm_log_prob,
    awm_policy_loss,
    awm_train_indices,
    nft_loss,
    nft_old_decay,
    nft_reward,
    velocity_kl,
)
from stepflow.objectives.base import ForwardObjective, need

__all__ = ["Nft", "Awm", "AdvantageFlow"]

#: objective.log_prob -> the release's ``kind`` argument of its log-prob reshaping
_AWM_KIND = dict(ghuber="ghuber", uniform="Uniform", t="t", t2="t**2", huber="huber")
NFT_ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")


class _WithOld(ForwardObjective):
    """An "old" copy of the trained weights that rolls out (the behaviour policy) and anchors the loss, moved toward
    the new weights after every iteration: ``θ_old ← d·θ_old + (1 − d)·θ``, d = :func:`~stepflow.math.forward.nft_old_decay`
    (``objective.decay_type``) at the optimizer-step counter."""

    def __init__(self, decay_type: int = 1, **fields):
        super().__init__(**fields)
        need(decay_type in (0, 1, 2) and not isinstance(decay_type, bool),
             f"decay_type: must be 0, 1 or 2, got {decay_type!r}")
        self.decay_type = decay_type
        self.old: ParamCopy | None = None

    def attach(self, params):
        self.old = ParamCopy(params)

    def behaviour(self):
        return self.old.applied()

    def end_iteration(self, learner):
        self.old.blend(nft_old_decay(learner.opt_steps, self.cfg.decay_type))

    def num_terms(self, steps: Sequence[int]) -> int:
        return max(1, int(len(steps) * self.train.timestep_fraction + 1e-9))

    def draw_indices(self, steps, gen, shared):
        """NFT: a random permutation of the candidate grid times per sample, its first K (nft:L810-817)."""
        perm = torch.randperm(len(steps), generator=gen)[: self.num_terms(steps)]
        return torch.tensor(steps, dtype=torch.long)[perm]

    def trained_steps(self, train, sampler, grid, window):
        t_steps = grid.shape[0] - 1
        return list(train.train_steps) if train.train_steps is not None else list(range(t_steps))

    def state_dict(self):
        return {"old": self.old.state_dict()}

    def load_state_dict(self, sd):
        self.old.load_state_dict(sd["old"])


class Nft(_WithOld):
    """DiffusionNFT (NVlabs/DiffusionNFT): ``L = mean A_max·(r·L⁺ + (1 − r)·L⁻)/β + β_kl·mean‖v_θ − v_ref‖²`` with the
    implicit policies v^± of the current and the old weights (:func:`~stepflow.math.forward.nft_loss`), r the advantage
    mapped to [0, 1] (:func:`~stepflow.math.forward.nft_reward`), at ``int(T·train.timestep_fraction)`` random grid times
    per sample."""

    name = "nft"
    loss_fields = {"loss": ("objective.beta", "objective.adv_clip_max", "train.beta_kl"),
                   "policy_loss": ("objective.beta", "objective.adv_clip_max"),
                   "unweighted_policy_loss": ("objective.beta",), "positive_loss": ("objective.beta",),
                   "negative_loss": ("objective.beta",)}

    def __init__(self, beta: float = 1.0, adv_mode: str = "all", **fields):
        super().__init__(**fields)
        need(isinstance(beta, (int, float)) and beta > 0, f"beta: must be > 0, got {beta}")
        need(adv_mode in NFT_ADV_MODES, f"adv_mode: must be one of {', '.join(NFT_ADV_MODES)}, got {adv_mode!r}")
        self.beta, self.adv_mode = beta, adv_mode

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        c = self.cfg
        x0, eps, t, x_t, cond, a = self.point(learner, traj, adv, term, rows, times)
        v_old = self.velocity_under(learner, self.old, x_t, t, cond)
        v_ref = self.velocity_under(learner, None, x_t, t, cond) if self.train.beta_kl > 0 else None
        v = learner.policy.velocity(x_t, t, cond, learner.guidance)
        r = nft_reward(a, c.adv_clip_max, c.adv_mode)
        pl, diag = nft_loss(v, v_old, x_t, x0, t, r, c.beta, c.adv_clip_max)
        kl, kd = self.kl_terms(learner, v, v_ref)
        return {"loss": pl + kl, **diag, **kd, "adv_abs": a.abs().mean().detach()}


class AdvantageFlow(_WithOld):
    """AdvantageFlow (arXiv 2605.26013): ``ℓ = A‖f_θ − x0‖² + γ‖f_θ − f_old‖² + λ‖f_θ − f_ref‖²``, f = x_t − t·v, at
    NFT's training times, with f_old from the old copy (NFT's schedule, ``decay_type``; inferred: the paper's "rollout
    policy"). A is the credit's advantage divided by ``adv_clip_max`` (in [−1, 1]), and ``γ + λ > 1`` is required, so
    every sample's loss is strictly convex (A + γ + λ > 0)."""

    name = "advantageflow"
    loss_fields = {"loss": ("objective.gamma", "objective.lam", "objective.adv_clip_max", "train.lr")}

    def __init__(self, gamma: float = 1.5, lam: float = 0.0, **fields):
        super().__init__(**fields)
        need(isinstance(gamma, (int, float)) and isinstance(lam, (int, float)) and gamma >= 0 and lam >= 0,
             f"gamma / lam: must be >= 0, got {gamma} / {lam}")
        need(gamma + lam > 1, f"gamma: gamma + lam must be > 1 (advantages lie in [-1, 1], so A + gamma + lam > 0 "
                              f"keeps every sample's loss convex), got {gamma} + {lam}")
        self.gamma, self.lam = gamma, lam

    @property
    def uses_reference(self) -> bool:
        return self.cfg.lam > 0

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        c = self.cfg
        x0, eps, t, x_t, cond, a = self.point(learner, traj, adv, term, rows, times)
        tb = t.view(-1, *([1] * (x0.ndim - 1)))
        f_old = x_t - tb * self.velocity_under(learner, self.old, x_t, t, cond)
        f_ref = x_t - tb * self.velocity_under(learner, None, x_t, t, cond) if c.lam > 0 else f_old
        f = x_t - tb * learner.policy.velocity(x_t, t, cond, learner.guidance)
        a = (a / c.adv_clip_max).clamp(-1.0, 1.0)
        loss, diag = advantageflow_loss(f, x0, f_old, f_ref, a, c.gamma, c.lam)
        unstable = (~advantageflow_stable(a, c.gamma, c.lam)).float().mean()
        return {"loss": loss, **diag, "unstable_frac": unstable, "adv_abs": a.abs().mean().detach()}


class Awm(ForwardObjective):
    """Advantage Weighted Matching (scxue/advantage_weighted_matching): the clipped surrogate on AWM's reshaped
    flow-matching "log-prob" (:func:`~stepflow.math.forward.awm_log_prob`) with A in [−1, 1], on-policy (the old log-prob
    is the current one detached, as released with ``off_policy=False``), + ``β·‖v_θ − v_ref‖² + ema_beta·‖v_θ −
    v_ema‖²`` with a fast EMA copy (d = min(kl_ema_decay, ema_rate·step) after every iteration), at ``num_times``
    stratified grid indices in ``[1, int(T·times_frac))`` shared by every row of the update."""

    name = "awm"
    loss_fields = {"loss": ("objective.p", "objective.log_prob", "objective.clip_range", "objective.advantage_max",
                            "objective.ema_beta", "train.beta_kl"),
                   "policy_loss": ("objective.p", "objective.log_prob", "objective.clip_range", "objective.advantage_max"),
                   "ema_kl": ("objective.ema_beta",)}

    def __init__(self, num_times: int = 6, times_frac: float = 0.9, log_prob: str = "ghuber", p: float = 0.25,
                 clip_range: float = 1.0, advantage_max: float = 1.0, ema_beta: float = 1.0, kl_ema_decay: float = 0.3,
                 ema_rate: float = 0.001, **fields):
        super().__init__(**fields)
        num = (int, float)
        need(isinstance(num_times, int) and not isinstance(num_times, bool) and num_times >= 1,
             f"num_times: must be an integer >= 1, got {num_times!r}")
        need(isinstance(times_frac, num) and 0 < times_frac <= 1, f"times_frac: must be in (0, 1], got {times_frac}")
        need(log_prob in _AWM_KIND, f"log_prob: must be one of {', '.join(_AWM_KIND)}, got {log_prob!r}")
        need(isinstance(p, num) and p > 0, f"p: must be > 0, got {p}")
        need(isinstance(clip_range, num) and clip_range > 0, f"clip_range: must be > 0, got {clip_range}")
        need(isinstance(advantage_max, num) and advantage_max > 0, f"advantage_max: must be > 0, got {advantage_max}")
        need(isinstance(ema_beta, num) and ema_beta >= 0, f"ema_beta: must be >= 0, got {ema_beta}")
        need(isinstance(kl_ema_decay, num) and 0 <= kl_ema_decay < 1, f"kl_ema_decay: must be in [0, 1), got {kl_ema_decay}")
        need(isinstance(ema_rate, num) and ema_rate >= 0, f"ema_rate: must be >= 0, got {ema_rate}")
        self.num_times, self.times_frac, self.log_prob, self.p = num_times, times_frac, log_prob, p
        self.clip_range, self.advantage_max, self.ema_beta = clip_range, advantage_max, ema_beta
        self.kl_ema_decay, self.ema_rate = kl_ema_decay, ema_rate
        self.ema: ParamCopy | None = None

    def attach(self, params):
        self.ema = ParamCopy(params)

    def trained_steps(self, train, sampler, grid, window):
        return list(range(grid.shape[0] - 1))

    def requirements(self, s) -> list[str]:
        """AWM draws its own stratified training times in [1, int(T·times_frac))."""
        out = []
        if s.train.train_steps is not None:
            out.append("train.train_steps: objective=awm draws its own stratified times (objective.num_times, "
                       "objective.times_frac); set train.train_steps=null")
        if int(s.loop.num_steps * self.times_frac) < 2:
            out.append(f"objective.times_frac: int(loop.num_steps·times_frac) = {int(s.loop.num_steps * self.times_frac)} "
                       "leaves no training time in [1, it); raise loop.num_steps or objective.times_frac")
        return out

    def num_terms(self, steps):
        return len(awm_train_indices(len(steps), self.cfg.num_times, self.cfg.times_frac, torch.Generator()))

    def draw_indices(self, steps, gen, shared):
        return torch.tensor(awm_train_indices(len(steps), self.cfg.num_times, self.cfg.times_frac, shared),
                            dtype=torch.long)

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        c = self.cfg
        x0, eps, t, x_t, cond, a = self.point(learner, traj, adv, term, rows, times)
        v_ref = self.velocity_under(learner, None, x_t, t, cond) if self.train.beta_kl > 0 else None
        v_ema = self.velocity_under(learner, self.ema, x_t, t, cond) if c.ema_beta > 0 else None
        v = learner.policy.velocity(x_t, t, cond, learner.guidance)
        a = awm_advantage(a, c.adv_clip_max, c.advantage_max)
        logp = awm_log_prob(v, eps.double() - x0.double(), t, _AWM_KIND[c.log_prob], c.p)
        pl, diag = awm_policy_loss(logp, logp.detach(), a.double(), c.clip_range)
        loss = pl.float()
        kl, kd = self.kl_terms(learner, v, v_ref)
        out = {"loss": loss + kl, **diag, **kd}
        if v_ema is not None:
            ema_kl = velocity_kl(v, v_ema)
            out["loss"] = out["loss"] + c.ema_beta * ema_kl
            out["ema_kl"] = ema_kl.detach()
        out["policy_loss"] = pl.detach().float()
        out["adv_abs"] = a.abs().mean().detach()
        return out

    def end_iteration(self, learner):
        self.ema.blend(awm_ema_decay(learner.opt_steps, self.cfg.kl_ema_decay, self.cfg.ema_rate))

    def state_dict(self):
        return {"ema": self.ema.state_dict()}

    def load_state_dict(self, sd):
        self.ema.load_state_dict(sd["ema"])
