"""GARDO's objective (arXiv 2512.24138): Flow-GRPO's clipped ratio + β·KL to a reference that is reset to the online
policy, the KL carried only by the rows the credit gates (:class:`stepflow.credits.gardo.Gardo`).

As released in tinnerhrhe/GARDO@1cc77fb scripts/train_sd3_grpo_gardo.py (= yifan123/flow_grpo@94e23ee
scripts/train_sd3_gardo.py):

- L945-991: per trained step j, ``policy_loss = max(−A ρ, −A clip(ρ, 1 ± ε))`` (times ``std_dev_t / mean(std_dev_t)``,
  which is 1 where a step's rows share their time, as here), ``kl_loss = mean_{gated}(μ_θ − μ_ref)² / (2 σ_t²)``
  (σ_t without √Δt: ``train.kl_mode=flow_grpo_parity``), ``loss = mean(policy_loss) + β·kl_loss`` (no KL term when no
  row is gated);
- L788-799, L1042-1043: the reference is a copy of the trained weights (the ``"old"`` LoRA adapter), made at the
  start; at the start of iteration ``it`` it is reset to the current weights when the logged KL of an optimizer step
  of the previous iteration exceeded ``kl_thres`` (``it ≠ 0``), or when ``it − (the last reset) > reset_freq``.

Here the gated mean is over the rows of an optimizer step (``row_info["kl_weight"]`` = N/G on the G gated of its N
trained rows; the release: over each micro-batch's gated rows), and the reset reads the iteration's logged KL (the
release: each optimizer step's, averaged over its micro-batches with 0 where none is gated).
"""

from __future__ import annotations

import torch

from stepflow.core.ema import ParamCopy
from stepflow.math.loss import gaussian_kl, grpo_surrogate
from stepflow.math.sde import sde_step
from stepflow.objectives.base import Objective, need, policy_velocity, transition

__all__ = ["Gardo"]


class Gardo(Objective):
    """``mean_i max(−A ρ, −A clip(ρ, 1 ± ϵ)) + β·mean_i w_i·KL_i(π_θ ‖ π_ref)`` with ``w`` the credit's
    ``row_info["kl_weight"]`` (none: 1), π_ref a copy of the trained weights reset to them every ``reset_freq``
    iterations and after an iteration whose KL (``train/kl``) exceeded ``kl_thres``. ε = ``train.clip_eps``,
    β = ``train.beta_kl`` (> 0; released 0.04 OCR, 0.07 GenEval)."""

    name = "gardo"

    def __init__(self, reset_freq: int = 15, kl_thres: float = 3e-4, **common):
        super().__init__(**common)
        need(isinstance(reset_freq, int) and not isinstance(reset_freq, bool) and reset_freq >= 0,
             f"reset_freq: must be an integer >= 0, got {reset_freq!r}")
        need(isinstance(kl_thres, (int, float)) and not isinstance(kl_thres, bool) and kl_thres > 0,
             f"kl_thres: must be a float > 0, got {kl_thres!r}")
        self.reset_freq, self.kl_thres = reset_freq, float(kl_thres)
        self.ref: ParamCopy | None = None
        self.reset_pending, self.last_reset, self.resets = False, 0, 0

    @property
    def uses_reference(self) -> bool:
        return False  # its reference is its own copy, not the LoRA-disabled / frozen initial weights

    def requirements(self, s) -> list[str]:
        if not s.train.beta_kl > 0:
            return ["train.beta_kl: objective=gardo gates and resets a KL penalty, which beta_kl=0 turns off; set "
                    "train.beta_kl > 0 (released 0.04 OCR, 0.07 GenEval) or use objective=grpo"]
        if s.loop.retain_graph is not False:
            return ["loop.retain_graph: objective=gardo evaluates its reference by swapping the trained weights in "
                    "place, which the rollout's kept graphs cannot survive; set loop.retain_graph=false"]
        if s.train.weighting in ("guard", "guard_released"):
            return [f"train.weighting: {s.train.weighting} replaces the ratio of Flow-GRPO, which objective=gardo "
                    "keeps as released; set train.weighting=none (or another weighting)"]
        return []

    def attach(self, params):
        self.ref = ParamCopy(params)

    def begin_update(self, learner, traj, it, seeds, steps):
        if (it != 0 and self.reset_pending) or it - self.last_reset > self.reset_freq:  # L789
            self.ref.blend(0.0)  # the reference becomes the current weights
            self.reset_pending, self.last_reset, self.resets = False, it, self.resets + 1

    def end_iteration(self, learner):
        if self.update_stats.get("train/kl", 0.0) > self.kl_thres:  # L1042-1043
            self.reset_pending = True

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        o, pol, dev, k = self.train, learner.policy, learner.policy.device, term
        x_k, x_next, t, t_next, cond = transition(traj, rows, k, times, dev)  # a merged step: to τ_{k+m}
        with torch.no_grad(), self.ref.applied():  # π_ref before the policy's forward (as Grpo: FSDP2's order)
            v_ref = pol.velocity(x_k, t, cond, learner.guidance)
            ref_mean = sde_step(learner.sampler, x_k, v_ref, t, t_next, t_guard=times[1], prev_sample=x_next).mean
        v = policy_velocity(learner, traj, k, rows, x_k, t, cond)
        a = adv[rows, k].to(dev)
        out = sde_step(learner.sampler, x_k, v, t, t_next, t_guard=times[1], prev_sample=x_next)
        surrogate, st = grpo_surrogate(out.log_prob, traj.log_probs[rows, k].to(dev), a, o.clip_eps)
        w = self.row_info.get("kl_weight")
        w = torch.ones(len(rows), device=dev) if w is None else w[rows.to(w.device)].to(dev)
        kl = (w * gaussian_kl(out.mean, ref_mean, out.std if o.kl_mode == "exact" else out.kl_scale)).mean()
        return {"loss": surrogate + o.beta_kl * kl, "policy_loss": surrogate.detach(), "kl": kl.detach(), **st,
                "kl_gated_frac": (w > 0).float().mean(), "ref_resets": torch.tensor(float(self.resets)),
                "adv_abs": a.abs().mean().detach()}

    def state_dict(self):
        return {"ref": self.ref.state_dict(), "reset_pending": self.reset_pending, "last_reset": self.last_reset,
                "resets": self.resets}

    def load_state_dict(self, sd):
        self.ref.load_state_dict(sd["ref"])
        self.reset_pending, self.last_reset = bool(sd["reset_pending"]), int(sd["last_reset"])
        self.resets = int(sd["resets"])
