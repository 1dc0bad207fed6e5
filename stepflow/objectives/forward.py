"""The forward-process objectives: DiffusionNFT, AWM and AdvantageFlow (docs/method.md §11; the math in
:mod:`stepflow.forward`). Each trains on the rollout's final latents re-noised at K grid times per sample; none
reads a log-prob, so any rollout sampler works (the released ones: DPM-Solver-2 for NFT, SDE-then-ODE for AWM)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stepflow.ema import ParamCopy
from stepflow.forward import (
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
from stepflow.objectives.base import ForwardObjective

__all__ = ["Nft", "Awm", "AdvantageFlow"]

_AWM_KIND = {"ghuber": "ghuber", "uniform": "Uniform", "t": "t", "t2": "t**2", "huber": "huber"}


class _WithOld(ForwardObjective):
    """An "old" copy of the trained weights that rolls out (the behaviour policy) and anchors the loss, moved toward
    the new weights after every iteration: ``θ_old ← d·θ_old + (1 − d)·θ``, d = :func:`~stepflow.forward.nft_old_decay`
    (``objective.decay_type``) at the optimizer-step counter."""

    def __init__(self, cfg, train):
        super().__init__(cfg, train)
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
    implicit policies v^± of the current and the old weights (:func:`~stepflow.forward.nft_loss`), r the advantage
    mapped to [0, 1] (:func:`~stepflow.forward.nft_reward`), at ``int(T·train.timestep_fraction)`` random grid times
    per sample."""

    name = "nft"

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

    def __init__(self, cfg, train):
        super().__init__(cfg, train)
        if not cfg.gamma + cfg.lam > 1:
            raise ValueError(f"objective.gamma / objective.lam: gamma + lam must be > 1 (advantages lie in [-1, 1], "
                             f"so A + gamma + lam > 0 keeps every sample's loss convex), got {cfg.gamma} + {cfg.lam}")

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
    flow-matching "log-prob" (:func:`~stepflow.forward.awm_log_prob`) with A in [−1, 1], on-policy (the old log-prob
    is the current one detached, as released with ``off_policy=False``), + ``β·‖v_θ − v_ref‖² + ema_beta·‖v_θ −
    v_ema‖²`` with a fast EMA copy (d = min(kl_ema_decay, ema_rate·step) after every iteration), at ``num_times``
    stratified grid indices in ``[1, int(T·times_frac))`` shared by every row of the update."""

    name = "awm"

    def __init__(self, cfg, train):
        super().__init__(cfg, train)
        self.ema: ParamCopy | None = None

    def attach(self, params):
        self.ema = ParamCopy(params)

    def trained_steps(self, train, sampler, grid, window):
        return list(range(grid.shape[0] - 1))

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
