"""Online Diffusion-DPO on each prompt group's best and worst sample (yifan123/flow_grpo@ac4c86e
scripts/train_sd3_dpo.py, config/dpo.py; Flow-Factory ``dpo``; docs/method.md §15.6).

Per group the winner w and the loser l (the max / min advantage: with ``advantage=best_worst`` the release's
``PerPromptStatTracker(type='dpo')``, +1 / −1 / 0) are re-noised with one noise ε and one time t (per pair and
training time), and the Diffusion-DPO loss of the flow-matching errors ℓ = mean_dims (ε − x0 − v)² against the
reference is (train_sd3_dpo.py L926-939)

    L = mean_pairs −log σ( −β/2·[(ℓ_θ,w − ℓ_ref,w) − (ℓ_θ,l − ℓ_ref,l)] ).

Its gradient is ``mean_pairs β/2·σ(β/2·m)·(∇ℓ_θ,w − ∇ℓ_θ,l)``, m the bracket: a detached coefficient per pair times the
rows' own errors. The update trains micro-batches of shuffled rows (a pair's rows may sit in different micro-batches
or on different ranks), so the coefficients are computed before it (:meth:`OnlineDpo.begin_update`: a no-grad pass of
the policy and the reference over the pairs' rows, the margins added over ranks) and the loss of a micro-batch is
``mean c·ℓ_θ`` over its rows: the release's gradient when the update is one optimizer step (its
``gradient_accumulation_steps`` spans the epoch); ``train/policy_loss`` logs the DPO loss itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from stepflow.core.ema import ParamCopy
from stepflow.objectives.base import need
from stepflow.objectives.dgpo import GroupPreference, dsm_loss, group_sums, mix_seed

__all__ = ["OnlineDpo", "pair_signs", "dpo_times", "dpo_loss", "ROLLOUT_FROM"]

ROLLOUT_FROM = ("reference", "current")


def pair_signs(score: Tensor, groups: Tensor) -> Tensor:
    """(B,) +1 for each group's winner (its first row of maximal ``score``), −1 for its loser (its first row of
    minimal score), 0 elsewhere; a group whose scores are all equal has no pair (Flow-Factory's pairing by the
    advantage, ``trainers/dpo.py`` ``_form_pairs_from_advantages``; the tie rule of the release is the credit's:
    :class:`stepflow.credits.best_worst.BestWorst`)."""
    out = torch.zeros(len(score), dtype=torch.float32)
    for g in torch.unique(groups).tolist():
        idx = torch.nonzero(groups == g).flatten()
        s = score[idx]
        hi, lo = s.max(), s.min()
        if not bool(hi > lo):
            continue
        out[idx[torch.nonzero(s == hi).flatten()[0]]] = 1.0
        out[idx[torch.nonzero(s == lo).flatten()[0]]] = -1.0
    return out


def dpo_times(z: Tensor, logit_mean: float = 0.0, logit_std: float = 1.0, shift: float = 3.0,
              num_train_timesteps: int = 1000) -> Tensor:
    """The release's training σ from standard normal draws ``z`` (train_sd3_dpo.py L890-903): diffusers'
    ``compute_density_for_timestep_sampling('logit_normal')`` ``u = sigmoid(m + s·z)``, the index ``int(u·N)`` into
    the ``FlowMatchEulerDiscreteScheduler`` of N training steps, whose σ are ``shift(1 − idx/N)`` with
    ``shift(s) = shift·s/(1 + (shift − 1)·s)`` (SD3.5: 3)."""
    u = torch.sigmoid(logit_mean + logit_std * z)
    idx = (u * num_train_timesteps).long()
    base = (num_train_timesteps - idx).to(torch.float64) / num_train_timesteps
    return (shift * base / (1 + (shift - 1) * base)).to(torch.float32)


def dpo_loss(dsm_w: Tensor, dsm_l: Tensor, ref_w: Tensor, ref_l: Tensor, beta: float) -> Tensor:
    """(P,) ``−log σ(−β/2·[(ℓ_w − ℓ_ref,w) − (ℓ_l − ℓ_ref,l)])`` (train_sd3_dpo.py L931-937)."""
    return -F.logsigmoid(-0.5 * beta * ((dsm_w - ref_w) - (dsm_l - ref_l)))


class OnlineDpo(GroupPreference):
    """Online Diffusion-DPO (yifan123/flow_grpo ``train_sd3_dpo.py``): the mean over the prompt groups' (winner,
    loser) pairs of ``−log σ(−β/2·[(ℓ_θ,w − ℓ_ref,w) − (ℓ_θ,l − ℓ_ref,l)])`` at ``num_times`` training times per pair
    (null: ``int(T·train.timestep_fraction)``, the release's 39 of 40), each with a fresh logit-normal σ
    (:func:`dpo_times`; ``time_shift`` null: the policy's own shift) and noise shared by the pair. The reference is
    a copy of the initial weights (the release's "ref" adapter), refreshed from the trained ones every
    ``ref_update_every`` optimizer steps (null: never, the release's 10^7); the rollouts run under it
    (``rollout_from=reference``, as released) or under the current weights (``current``, Flow-Factory's)."""

    name = "online_dpo"
    drops_zero_advantage = True  # only the pairs train (the release keeps the rows with a nonzero advantage)

    def __init__(self, beta: float = 100.0, num_times: int | None = None, logit_mean: float = 0.0,
                 logit_std: float = 1.0, time_shift: float | None = None, num_train_timesteps: int = 1000,
                 rollout_from: str = "reference", ref_update_every: int | None = None, **fields):
        super().__init__(**fields)
        num = (int, float)

        def _int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        need(isinstance(beta, num) and beta > 0, f"beta: must be > 0, got {beta!r}")
        need(num_times is None or (_int(num_times) and num_times >= 1),
             f"num_times: must be null or an integer >= 1, got {num_times!r}")
        need(isinstance(logit_mean, num), f"logit_mean: must be a float, got {logit_mean!r}")
        need(isinstance(logit_std, num) and logit_std > 0, f"logit_std: must be > 0, got {logit_std!r}")
        need(time_shift is None or (isinstance(time_shift, num) and time_shift > 0),
             f"time_shift: must be null (the policy's shift) or > 0, got {time_shift!r}")
        need(_int(num_train_timesteps) and num_train_timesteps >= 1,
             f"num_train_timesteps: must be an integer >= 1, got {num_train_timesteps!r}")
        need(rollout_from in ROLLOUT_FROM, f"rollout_from: must be one of {', '.join(ROLLOUT_FROM)}, got {rollout_from!r}")
        need(ref_update_every is None or (_int(ref_update_every) and ref_update_every >= 1),
             f"ref_update_every: must be null (never) or an integer >= 1, got {ref_update_every!r}")
        self.beta, self.num_times, self.logit_mean, self.logit_std = beta, num_times, logit_mean, logit_std
        self.time_shift, self.num_train_timesteps = time_shift, num_train_timesteps
        self.rollout_from, self.ref_update_every = rollout_from, ref_update_every
        self.ref: ParamCopy | None = None

    @property
    def uses_reference(self) -> bool:
        return False  # its reference is its own copy (the release's "ref" adapter), not π_ref of the policy

    def attach(self, params):
        self.ref = ParamCopy(params)

    def behaviour(self):
        """The rollout's weights: the reference copy (the release samples with ``set_adapter("ref")``, L617-618)."""
        return self.ref.applied() if self.rollout_from == "reference" else contextlib.nullcontext()

    def trained_steps(self, train, sampler, grid, window):
        return list(range(grid.shape[0] - 1))

    def num_terms(self, steps: Sequence[int]) -> int:
        if self.num_times is not None:
            return self.num_times
        return max(1, int(len(steps) * self.train.timestep_fraction + 1e-9))

    def requirements(self, s) -> list[str]:
        out = []
        if s.train.beta_kl > 0:
            out.append("train.beta_kl: objective=online_dpo has no KL term (its β is objective.beta, the DPO "
                       "temperature); set train.beta_kl=0")
        if s.train.train_steps is not None:
            out.append("train.train_steps: objective=online_dpo draws a logit-normal time per pair and training time; "
                       "set train.train_steps=null (objective.num_times sets how many)")
        return out

    def begin_update(self, learner, traj, it, seeds, steps, adv=None, groups=None, **batch):
        need(adv is not None and groups is not None, "objective=online_dpo: begin_update needs adv= and groups=")
        dist, dev, b, k = learner.dist, learner.policy.device, traj.batch_size, self.num_terms(steps)
        shape = tuple(traj.latents.shape[2:])
        groups = groups.long().cpu()
        # the pairs over every rank's rows (a group's winner and loser may sit on different ranks)
        score = adv.to(torch.float32).mean(1).cpu()
        sign = dist.local_rows(pair_signs(dist.gather_rows(score), dist.gather_rows(groups))).cpu()
        n_pairs = dist.all_sum(float((sign > 0).sum()))
        keep = (adv.abs().sum(1) > 0 if (self.train.drop_zero_adv and self.drops_zero_advantage)
                else torch.ones(b, dtype=torch.bool))
        n_rows = dist.all_sum(float(keep.sum()))  # the rows the update's mean runs over
        # one σ and one noise per (pair, time): drawn per prompt group, the same on every rank (L884-899)
        shift = float(self.time_shift if self.time_shift is not None else learner.policy.shift)
        z, eps = [], []
        cache: dict[int, tuple[Tensor, Tensor]] = {}
        for g in groups.tolist():
            if g not in cache:
                gen = torch.Generator().manual_seed(mix_seed(learner.loop.seed, it, g, 17))
                cache[g] = (torch.randn(k, generator=gen), torch.randn((k, *shape), generator=gen))
            z.append(cache[g][0])
            eps.append(cache[g][1])
        self.t = (dpo_times(torch.stack(z), self.logit_mean, self.logit_std, shift, self.num_train_timesteps)
                  if z else torch.zeros(0, k))
        self.noise = torch.stack(eps) if eps else torch.zeros(0, k, *shape)
        self.index = torch.zeros(b, k, dtype=torch.long)
        scale = n_rows / (2 * n_pairs) if n_pairs else 0.0  # the update's mean over n_rows -> the mean over pairs
        pair = torch.nonzero(sign != 0).flatten()
        self.coef = torch.zeros(b, k, device=dev)
        self.value = torch.zeros(b, k, device=dev)
        self.acc = torch.zeros(b, k, device=dev)
        s = sign.to(dev)
        for j in range(k):
            errs, _ = self._no_grad_errors(learner, traj, j, pair, ["policy", self.ref], [1.0, 1.0])
            delta = torch.zeros(b, device=dev)
            if len(pair):
                delta[pair.to(dev)] = errs[0] - errs[1]
            m = group_sums(s * delta, groups, dist)  # (ℓ_θ,w − ℓ_ref,w) − (ℓ_θ,l − ℓ_ref,l) of each row's pair
            inside = -0.5 * self.beta * m
            on = (s != 0).float()
            self.coef[:, j] = s * self.beta * torch.sigmoid(-inside) * scale
            self.value[:, j] = on * -F.logsigmoid(inside) * scale
            self.acc[:, j] = on * (inside > 0).float() * scale

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        x0, eps, t, x_t, cond = self._point(learner, traj, term, rows)
        dev = x0.device
        v = learner.policy.velocity(x_t, t, cond, 1.0)  # the release trains without CFG (embeds of the prompts only)
        dsm = dsm_loss(v, eps - x0)
        r = rows.to(dev)
        c = self.coef[r, term]
        return {"loss": (c * dsm).mean(), "policy_loss": self.value[r, term].mean(),
                "implicit_acc": self.acc[r, term].mean(), "dsm_loss": dsm.mean().detach(),
                "adv_abs": adv[rows].abs().mean().detach().to(dev)}

    def end_iteration(self, learner):
        """The reference copy takes the trained weights every ``ref_update_every`` optimizer steps (L614-615)."""
        if self.ref_update_every and learner.opt_steps > 0 and learner.opt_steps % self.ref_update_every == 0:
            self.ref.blend(0.0)

    def state_dict(self):
        return {"ref": self.ref.state_dict()}

    def load_state_dict(self, sd):
        self.ref.load_state_dict(sd["ref"])
