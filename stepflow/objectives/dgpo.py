"""DGPO, Direct Group Preference Optimization (Luo-Yihong/DGPO@01ceb4b, arXiv 2510.08425; docs/method.md §15.5):
a group-level DPO on the denoising-score-matching (flow-matching) errors of the rollout's final samples against a
frozen reference, with no policy gradient and no log-probs (a forward-process objective, like NFT and AWM).

The release's loss of one training time, over a batch of whole prompt groups (scripts/train_sd3_dgpo.py L162-193,
L1098-1158), with ℓ = mean_dims (ε − x0 − v)² the DSM error and G the group size:

    w_g = sg σ( Σ_{i∈g} A_i·β_dpo·(ℓ_θ,i − ℓ_ref,i) / G )          (one weight per prompt group)
    L   = mean_i  w_{g(i)}·A_i·ℓ_θ,i  +  β_kl·mean_i mean_dims (v_θ,i − v_ref,i)²

so a row's loss reads every row of its group (:attr:`~stepflow.objectives.base.Objective.couples_rows`). The update
trains micro-batches of shuffled rows, so the group weights are computed before it, in :meth:`Dgpo.begin_update`
(one no-grad pass of the policy, the reference and the old copy over every row and training time; the groups' sums
added over every rank), and the loss of a micro-batch is ``mean w·A·ℓ_θ`` with those weights: the release's
loss and gradient when the update is one optimizer step (its ``gradient_accumulation_steps`` spans the epoch), at
the price of that extra no-grad forward of the policy per row and time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from stepflow.core.ema import ParamCopy
from stepflow.objectives.base import ForwardObjective, need

__all__ = ["GroupPreference", "Dgpo", "dsm_loss", "group_sums", "dgpo_group_weights", "dgpo_should_clip",
           "dgpo_ema_ref_decay", "mix_seed"]


def mix_seed(*parts: int) -> int:
    """One generator seed from integers (the run seed, the iteration, a group id, a tag): the same on every rank."""
    s = 0
    for p in parts:
        s = (s * 1_000_003 + int(p)) % (2**63 - 1)
    return s


def dsm_loss(v: Tensor, target: Tensor) -> Tensor:
    """(B,) the per-sample DSM error ``mean_dims (target − v)²`` (dgpo:L1132, ``target_v = noise − x0``)."""
    return (target - v).square().reshape(v.shape[0], -1).mean(dim=1)


def group_sums(values: Tensor, groups: Tensor, dist: Any = None) -> Tensor:
    """(B,) each row's prompt-group sum of ``values`` (B,) over every rank's rows: ``groups`` (B,) are global ids
    (the same id on every rank), the per-group sums are added over ranks (``dist.all_sum_tensor``; every rank must
    call it). The release's ``scatter_add_`` + ``all_reduce`` (dgpo:L178-185)."""
    n = int(groups.max()) + 1 if len(groups) else 0
    if dist is not None and dist.world > 1:
        n = int(dist.all_max(n))
    sums = values.new_zeros(n).index_add_(0, groups.to(values.device), values)
    if dist is not None:
        sums = dist.all_sum_tensor(sums)
    return sums[groups.to(values.device)]


def dgpo_group_weights(adv: Tensor, dsm: Tensor, ref_dsm: Tensor, groups: Tensor, beta_dpo: float, group_size: int,
                       dist: Any = None) -> Tensor:
    """(B,) detached ``σ(Σ_{j∈g} A_j·β_dpo·(ℓ_j − ℓ_ref,j)/G)`` of each row's group g (dgpo:L175-189)."""
    per = adv * beta_dpo * (dsm.detach() - ref_dsm.detach()) / group_size
    return torch.sigmoid(group_sums(per, groups, dist)).detach()


def dgpo_should_clip(adv: Tensor, dsm: Tensor, old_dsm: Tensor, clip_range: float) -> Tensor:
    """(B,) bool, the release's PPO-style clip of the DSM loss against the old (EMA) copy (dgpo:L1134-1141):
    ``ρ = exp(−ℓ_θ + ℓ_old)``; clipped where A > 0 and ρ > 1 + c, or A ≤ 0 and ρ < 1 − c."""
    ratio = torch.exp(-dsm.detach() + old_dsm)
    return torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


def dgpo_ema_ref_decay(step: int, max_decay: float = 0.3, rate: float = 0.001) -> float:
    """The old copy's decay after optimizer step ``step`` (0-based, the release's ``global_step`` before it is
    incremented): ``min(max_decay, rate·step)`` (dgpo:L1176)."""
    return float(min(max_decay, rate * step))


class GroupPreference(ForwardObjective):
    """A forward-process objective whose rows' losses read their prompt group: before the update
    (:meth:`begin_update`, given the advantages and the rows' group ids) it draws the training times and the noise and
    computes each (row, term)'s detached coefficient; the loss of a micro-batch is then a plain mean over its rows.
    Every forward of the training terms runs without CFG (the releases' ``cfg=False``)."""

    couples_rows = True
    drops_zero_advantage = False

    def __init__(self, **fields):
        super().__init__(**fields)
        self.t: Tensor | None = None  #: (B_local, K) each (row, term)'s time
        self.coef: Tensor | None = None  #: (B_local, K) each (row, term)'s detached loss coefficient

    def _point(self, learner, traj, term: int, rows: Tensor):
        """(x0, ε, t (R,), x_t, cond) of ``term`` on ``rows``."""
        dev = learner.policy.device
        x0 = traj.latents[rows, -1].to(dev)
        eps = self.noise[rows, term].to(dev)
        t = self.t[rows, term].to(dev)
        tb = t.view(-1, *([1] * (x0.ndim - 1)))
        return x0, eps, t, (1 - tb) * x0 + tb * eps, traj.cond.index(rows).to(dev)

    def _group_noise(self, learner, it: int, groups: Tensor, seeds: Tensor, k: int, shape: tuple, shared: bool,
                     tag: int) -> Tensor:
        """(B_local, K, *shape): one draw per (prompt group, term) shared by the group's rows (seeded by the run
        seed, the iteration and the group id: the same on every rank), or with ``shared`` false one per (row, term)
        from the row's own noise seed."""
        out, cache = [], {}
        for g, s in zip(groups.tolist(), seeds.tolist()):
            seed = mix_seed(learner.loop.seed, it, g, tag) if shared else mix_seed(s, tag)
            if seed not in cache:
                cache[seed] = torch.randn((k, *shape), generator=torch.Generator().manual_seed(seed))
            out.append(cache[seed])
        return torch.stack(out) if out else torch.zeros(0, k, *shape)

    def _no_grad_errors(self, learner, traj, term: int, rows: Tensor, copies: Sequence[Any],
                        guidance: Sequence[float], keep: int | None = None):
        """The DSM errors (each (R,)) of the weights in ``copies`` (``"policy"``: the current weights; None: π_ref;
        a :class:`ParamCopy`) at ``term`` of ``rows``, in micro-batches, without grad; ``keep``: the index in
        ``copies`` whose velocities are also returned ((R, C, H, W)), else None. Under a lockstep strategy (FSDP2,
        DeepSpeed) a rank with fewer micro-batches (online DPO: fewer pair rows) runs discarded pads on row 0."""
        pol = learner.policy
        errs: list[list[Tensor]] = [[] for _ in copies]
        kept: list[Tensor] = []
        mbs = [mb for mb in rows.split(max(1, learner.train.micro_batch_size)) if len(mb)]  # a rank may hold none
        pads = 0
        if learner.dist.lockstep:  # FSDP2 / DeepSpeed: every forward is a collective, as many on every rank
            pads = int(learner.dist.all_max(len(mbs))) - len(mbs)
        with torch.no_grad():
            for i, mb in enumerate(mbs + [torch.zeros(1, dtype=torch.long)] * pads):
                x0, eps, t, x_t, cond = self._point(learner, traj, term, mb)
                for c_i, (c, gw) in enumerate(zip(copies, guidance)):
                    if isinstance(c, str):
                        ctx = contextlib.nullcontext()
                    else:
                        ctx = pol.reference() if c is None else c.applied()
                    with ctx:
                        v = pol.velocity(x_t, t, cond, gw)
                    if i >= len(mbs):  # a lockstep pad: computed, not kept
                        continue
                    errs[c_i].append(dsm_loss(v, eps - x0))
                    if keep == c_i:
                        kept.append(v)
        dev = pol.device
        out = [torch.cat(e) if e else torch.zeros(0, device=dev) for e in errs]
        return out, (torch.cat(kept) if kept else None) if keep is not None else None


class Dgpo(GroupPreference):
    """DGPO (Luo-Yihong/DGPO): ``mean sg(w_g)·A·ℓ_θ + β_kl·mean‖v_θ − v_ref‖²`` with the group weights
    ``w_g = σ(Σ_g A·β_dpo·(ℓ_θ − ℓ_ref)/G)``, A the credit's advantage clipped to ±``adv_clip_max``, at ``num_times``
    distinct grid times drawn among the first ``trunc_steps + 1`` steps and shared by every row, with noise shared by
    each prompt group (``shared_noise``); the DSM loss of a row is detached where its ratio to the old copy leaves
    ``1 ± clip_range`` (``clip_dsm``, PPO-style); the old copy ``θ_old ← d·θ_old + (1 − d)·θ`` with
    d = min(ema_ref_max_decay, ema_ref_rate·step) after every update, the rollout policy after ``switch_ema_ref``
    optimizer steps and, with ``use_ema_ref``, the DGPO reference (TDM-R1's dynamic reference)."""

    name = "dgpo"

    def __init__(self, beta_dpo: float = 100.0, num_times: int = 4, trunc_steps: int = 4, shared_noise: bool = True,
                 clip_dsm: bool = True, clip_kl: bool = False, clip_range: float = 0.01, use_ema_ref: bool = False,
                 switch_ema_ref: int = 500, ema_ref_max_decay: float = 0.3, ema_ref_rate: float = 0.001,
                 ref_guidance: float = 1.0, **fields):
        super().__init__(**fields)
        num = (int, float)

        def _int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        need(isinstance(beta_dpo, num) and beta_dpo > 0, f"beta_dpo: must be > 0, got {beta_dpo!r}")
        need(_int(num_times) and num_times >= 1, f"num_times: must be an integer >= 1, got {num_times!r}")
        need(_int(trunc_steps) and trunc_steps >= 0, f"trunc_steps: must be an integer >= 0, got {trunc_steps!r}")
        for name, v in (("shared_noise", shared_noise), ("clip_dsm", clip_dsm), ("clip_kl", clip_kl),
                        ("use_ema_ref", use_ema_ref)):
            need(isinstance(v, bool), f"{name}: must be true or false, got {v!r}")
        need(isinstance(clip_range, num) and clip_range > 0, f"clip_range: must be > 0, got {clip_range!r}")
        need(_int(switch_ema_ref) and switch_ema_ref >= 0, f"switch_ema_ref: must be an integer >= 0, got {switch_ema_ref!r}")
        need(isinstance(ema_ref_max_decay, num) and 0 <= ema_ref_max_decay < 1,
             f"ema_ref_max_decay: must be in [0, 1), got {ema_ref_max_decay!r}")
        need(isinstance(ema_ref_rate, num) and ema_ref_rate >= 0, f"ema_ref_rate: must be >= 0, got {ema_ref_rate!r}")
        need(isinstance(ref_guidance, num) and ref_guidance >= 1, f"ref_guidance: must be >= 1 (1 = no CFG), got {ref_guidance!r}")
        self.beta_dpo, self.num_times, self.trunc_steps, self.shared_noise = beta_dpo, num_times, trunc_steps, shared_noise
        self.clip_dsm, self.clip_kl, self.clip_range, self.use_ema_ref = clip_dsm, clip_kl, clip_range, use_ema_ref
        self.switch_ema_ref, self.ema_ref_max_decay, self.ema_ref_rate = switch_ema_ref, ema_ref_max_decay, ema_ref_rate
        self.ref_guidance = float(ref_guidance)
        self.old: ParamCopy | None = None  #: the release's ``ema_ref`` (the old policy)
        self.steps_done = 0  #: optimizer steps taken (the release's ``global_step`` at the next rollout)

    # ---------------------------------------------------------------- what an iteration needs
    @property
    def uses_reference(self) -> bool:
        return not self.use_ema_ref or self.train.beta_kl > 0

    @property
    def _needs_old(self) -> bool:
        return self.clip_dsm or self.clip_kl or self.use_ema_ref

    def attach(self, params):
        self.old = ParamCopy(params)

    def behaviour(self):
        """The rollout's weights: the old copy once more than ``switch_ema_ref`` optimizer steps were taken
        (dgpo:L799-800), else the current ones."""
        return self.old.applied() if self.steps_done > self.switch_ema_ref else contextlib.nullcontext()

    def trained_steps(self, train, sampler, grid, window):
        """The candidate grid steps: ``0 .. trunc_steps`` (dgpo:L1063, the noisiest ones)."""
        return list(range(min(self.trunc_steps + 1, grid.shape[0] - 1)))

    def num_terms(self, steps: Sequence[int]) -> int:
        return min(self.num_times, len(steps))

    def requirements(self, s) -> list[str]:
        out = []
        if s.train.train_steps is not None:
            out.append("train.train_steps: objective=dgpo draws its own shared training times (objective.num_times among "
                       "the steps 0..objective.trunc_steps); set train.train_steps=null")
        if self.trunc_steps >= s.loop.num_steps:
            out.append(f"objective.trunc_steps: the candidate times are the grid steps 0..trunc_steps of loop.num_steps="
                       f"{s.loop.num_steps}, got {self.trunc_steps}; set objective.trunc_steps <= {s.loop.num_steps - 1}")
        elif self.num_times > self.trunc_steps + 1:
            out.append(f"objective.num_times: draws {self.num_times} distinct times among the {self.trunc_steps + 1} steps "
                       f"0..objective.trunc_steps; lower objective.num_times or raise objective.trunc_steps")
        return out

    # ---------------------------------------------------------------- the update
    def begin_update(self, learner, traj, it, seeds, steps, adv=None, groups=None, **batch):
        need(adv is not None and groups is not None, "objective=dgpo: begin_update needs adv= and groups=")
        shape, b, k = tuple(traj.latents.shape[2:]), traj.batch_size, self.num_terms(steps)
        groups = groups.long().cpu()
        # shared times, the same on every rank (dgpo:L51-72, random.sample of M among 0..trunc_steps)
        shared = torch.Generator().manual_seed(mix_seed(learner.loop.seed, it, 11))
        ks = torch.tensor(list(steps), dtype=torch.long)[torch.randperm(len(steps), generator=shared)[:k]]
        self.index = ks.expand(b, k).clone()
        self.t = traj.times.cpu()[self.index]
        # one noise per (prompt group, time) (dgpo:L74-108, drawn afresh at every time, L1102-1105)
        self.noise = self._group_noise(learner, it, groups, seeds, k, shape, self.shared_noise, 13)
        dev = learner.policy.device
        a = adv.to(torch.float32)[torch.arange(b)[:, None], self.index].clamp(-self.adv_clip_max, self.adv_clip_max)
        self.adv_k = a  # (B_local, K)
        rows = torch.arange(b)
        copies: list[Any] = ["policy", None]  # θ, π_ref (with ref_guidance: the release's kl_cfg)
        guid = [1.0, self.ref_guidance]
        if self._needs_old:
            copies.append(self.old)
            guid.append(1.0)
        keep_ref = 1 if self.train.beta_kl > 0 else None
        weights, olds, vrefs, margins = [], [], [], []
        for j in range(k):
            errs, v_ref = self._no_grad_errors(learner, traj, j, rows, copies, guid, keep_ref)
            dsm, ref = errs[0], errs[1]
            ref_dgpo = errs[2] if self.use_ema_ref else ref  # TDM-R1's dynamic reference (dgpo:L1122-1124)
            w = dgpo_group_weights(a[:, j].to(dev), dsm, ref_dgpo, groups, self.beta_dpo, learner.loop.group_size,
                                   learner.dist)
            weights.append(w)
            margins.append(dsm - ref_dgpo)
            olds.append(errs[2] if self._needs_old else dsm)
            vrefs.append(v_ref)
        self.weight = torch.stack(weights, 1) if k else torch.zeros(b, 0, device=dev)
        self.old_dsm = torch.stack(olds, 1) if k else torch.zeros(b, 0, device=dev)
        self.margin = torch.stack(margins, 1) if k else torch.zeros(b, 0, device=dev)
        self.v_ref = torch.stack(vrefs, 1) if keep_ref is not None and k else None

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        x0, eps, t, x_t, cond = self._point(learner, traj, term, rows)
        dev = x0.device
        v = learner.policy.velocity(x_t, t, cond, 1.0)  # the release's predict_v(cfg=False)
        a = self.adv_k[rows, term].to(dev)
        w = self.weight[rows.to(self.weight.device), term].to(dev)
        dsm = dsm_loss(v, eps - x0)
        out: dict[str, Tensor] = {"dsm_loss": dsm.mean().detach()}
        clip = None
        if self.clip_dsm or self.clip_kl:
            clip = dgpo_should_clip(a, dsm, self.old_dsm[rows.to(dev), term].to(dev), self.clip_range)
            out["clip_frac"] = clip.float().mean().detach()
            if self.clip_dsm:
                dsm = torch.where(clip, dsm.detach(), dsm)
        pl = (w * a * dsm).mean()
        loss = pl
        if self.train.beta_kl > 0:
            kl = (v - self.v_ref[rows.to(dev), term]).square().reshape(len(rows), -1).mean(dim=1)
            if self.clip_kl and clip is not None:
                kl = torch.where(clip, kl.detach(), kl)
            kl = kl.mean()
            loss = loss + self.train.beta_kl * kl
            out["kl"] = kl.detach()
        out.update({"loss": loss, "policy_loss": pl.detach(), "group_weight": w.mean().detach(),
                    "dsm_margin": self.margin[rows.to(dev), term].mean().detach(), "adv_abs": a.abs().mean().detach()})
        return out

    def end_iteration(self, learner):
        """The old copy moves after the update (once per iteration: the release's once per optimizer step, which is
        the same with one optimizer step per rollout)."""
        self.old.blend(dgpo_ema_ref_decay(max(0, learner.opt_steps - 1), self.ema_ref_max_decay, self.ema_ref_rate))
        self.steps_done = int(learner.opt_steps)

    def state_dict(self):
        return {"old": self.old.state_dict(), "steps_done": self.steps_done}

    def load_state_dict(self, sd):
        self.old.load_state_dict(sd["old"])
        self.steps_done = int(sd.get("steps_done", 0))
