"""GARDO's credit (arXiv 2512.24138): the diversity-aware advantage and the uncertainty gate of the KL.

As released in tinnerhrhe/GARDO@1cc77fb (and copied into yifan123/flow_grpo@94e23ee scripts/train_sd3_gardo.py):

- advantage (flow_grpo/stat_tracking.py L96-135, ``type='gardo'``): per prompt group, the features f_i of the final
  images are L2-normalised; d_i = min_{j≠i} (1 − cos(f_i, f_j)) is a sample's distance to its nearest group mate;
  ``A_i = (R_i − mean_g R)·w_i`` with ``w_i = d_i / mean_g d`` where ``R_i ≥ mean_g R`` and 1 where below (no std
  division), then clipped to ±adv_clip (the loss's ``adv_clip_max`` 5).
- uncertainty gate (scripts/train_sd3_grpo_gardo.py L826-837, L219-238): over the whole batch, each reward is turned
  into ranks (1 = best); ``u_i = rank_main(i) − mean_aux rank_aux(i)``; the risk compensator moves its fraction β
  (start 0.1, within [0.02, 0.2]) by ×1.1 / ×0.9 when the mean of the u ≥ 0 exceeds the max / falls under the min of
  its last 20 values; the gated rows are ``u_i > percentile_{100(1−β)}{u ≥ 0}``. Only they carry the KL (the
  objective, :class:`stepflow.objectives.gardo.Gardo`, through ``Objective.row_info["kl_weight"]``).

The release's features are DINOv3 (timm ``vit_large_patch16_dinov3``) of the decoded images; here they are the
final latents X_T (the embedded world's latents are its pixels): override :meth:`Gardo.features` for another extractor.
The release's auxiliary rewards are aesthetic and ImageReward beside the main reward; here they are components of
the reward (``aux_components``), and the main reward is the reward's own score.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from stepflow.credits.base import Credit, _num
from stepflow.math.advantage import _group_index

__all__ = ["Gardo", "RiskCompensator", "diversity_advantages", "uncertainty", "ranks"]


def ranks(x: Tensor) -> Tensor:
    """Descending ranks 1..B of (B,) ``x`` (1 = the largest) as the release makes them (train_sd3_grpo_gardo.py
    L828-830: ``torch.sort(descending=True)``, then ``ranks[indices] = arange(1, B + 1)``), ties in row order (a
    stable sort: the release's unstable one breaks them in some order; its rewards are continuous, this world's are
    not). float64 (B,)."""
    _, idx = torch.sort(x.double(), descending=True, stable=True)
    r = torch.empty(len(x), dtype=torch.float64)
    r[idx] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    return r


def uncertainty(main: Tensor, aux: list[Tensor]) -> Tensor:
    """``u = rank(main) − mean_a rank(aux_a)`` (B,) float64 (GARDO's released estimate, train_sd3_grpo_gardo.py
    L827-834): positive where the main reward ranks a sample below the auxiliary rewards."""
    r = ranks(main)
    return r - torch.stack([ranks(a) for a in aux]).mean(0)


class RiskCompensator:
    """The release's adaptive fraction β of gated samples (train_sd3_grpo_gardo.py L219-238): the first update sets
    β = base; later ones multiply it by 1 + α when the batch's mean score exceeds every buffered mean, by 1 − α when it
    is under every one; β is clipped to [β_min, β_max]; the buffer keeps the last ``window`` means."""

    def __init__(self, base: float = 0.1, alpha: float = 0.1, beta_min: float = 0.02, beta_max: float = 0.2,
                 window: int = 20):
        self.base, self.alpha, self.beta_min, self.beta_max, self.window = base, alpha, beta_min, beta_max, window
        self.beta = base
        self.buffer: list[float] = []

    def update(self, scores: np.ndarray) -> None:
        m = float(np.mean(scores))
        if not self.buffer:
            self.beta = self.base
        elif m > max(self.buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif m < min(self.buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = float(np.clip(self.beta, self.beta_min, self.beta_max))
        self.buffer = [*self.buffer, m][-self.window:]

    def gate(self, u: Tensor) -> Tensor:
        """Update with the batch's u ≥ 0 and return the gated rows (B,) bool: u above their (1 − β) percentile."""
        nonneg = u[u >= 0].numpy()
        self.update(nonneg)
        threshold = np.percentile(nonneg, 100 - self.beta * 100)
        return u > float(threshold)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "buffer": list(self.buffer)}

    def load_state_dict(self, sd: dict) -> None:
        self.beta, self.buffer = float(sd["beta"]), [float(v) for v in sd["buffer"]]


def diversity_advantages(final: Tensor, features: Tensor, group_ids: Tensor, diversity: bool = True) -> Tensor:
    """GARDO's advantage (B,) float64: ``(R − mean_g R)·w`` with ``w = d / mean_g d`` above the group mean and 1 below,
    d the cosine distance of a sample's L2-normalised features (B, F) to its nearest group mate; ``diversity=False``:
    ``R − mean_g R``. A group whose distances are all 0 (identical features) keeps w = 1."""
    r = final.double()
    inv, k = _group_index(group_ids, len(r))
    adv = torch.zeros_like(r)
    f = features.double().flatten(1)
    f = f / f.norm(dim=1, keepdim=True).clamp_min(1e-300)
    for g in range(k):
        idx = torch.nonzero(inv == g).flatten()
        rg = r[idx]
        centred = rg - rg.mean()
        if not diversity:
            adv[idx] = centred
            continue
        fg = f[idx]
        dist = 1 - (fg @ fg.T).clamp(-1, 1)
        dist.fill_diagonal_(float("inf"))
        d = dist.min(1).values
        w = d / d.mean() if float(d.mean()) > 0 else torch.ones_like(d)
        adv[idx] = centred * torch.where(centred < 0, torch.ones_like(w), w)
    return adv


class Gardo(Credit):
    """GARDO's diversity-aware advantage of the final reward (repeated over the T steps) and its uncertainty gate.
    Fields: ``diversity`` (the bonus; False: R − mean_g R), ``std_norm`` (False, released: no std division; True:
    divided by ``std_scope``'s std + ``eps``), ``aux_components`` (the reward components ranked against the main
    reward for the gate; [] = no gate: the KL on every row), the risk compensator's ``gate_base``, ``gate_alpha``,
    ``gate_min``, ``gate_max``, ``gate_window``. Its state (β and the buffer) is checkpointed."""

    name = "gardo"
    needs_stepwise_rewards = False

    def __init__(self, diversity: bool = True, std_norm: bool = False,
                 aux_components: list[str] | tuple[str, ...] = ("aesthetic", "imagereward"), gate_base: float = 0.1,
                 gate_alpha: float = 0.1, gate_min: float = 0.02, gate_max: float = 0.2, gate_window: int = 20,
                 **common):
        super().__init__(**common)
        for name, v in (("diversity", diversity), ("std_norm", std_norm)):
            if not isinstance(v, bool):
                raise ValueError(f"{name}: must be a bool, got {v!r}")
        aux = list(aux_components) if isinstance(aux_components, (list, tuple)) else None
        if aux is None or not all(isinstance(a, str) and a for a in aux):
            raise ValueError(f"aux_components: must be a list of reward component names, got {aux_components!r}")
        _num("gate_min", gate_min, 0.0, 1.0, lo_open=True)
        _num("gate_max", gate_max, gate_min, 1.0)
        _num("gate_base", gate_base, gate_min, gate_max)
        _num("gate_alpha", gate_alpha, 0.0, 1.0)
        if not (isinstance(gate_window, int) and not isinstance(gate_window, bool) and gate_window >= 1):
            raise ValueError(f"gate_window: must be an integer >= 1, got {gate_window!r}")
        self.diversity, self.std_norm, self.aux_components = diversity, std_norm, aux
        self.gate_base, self.gate_alpha, self.gate_min, self.gate_max = gate_base, gate_alpha, gate_min, gate_max
        self.gate_window = gate_window
        self.risk = RiskCompensator(gate_base, gate_alpha, gate_min, gate_max, gate_window)
        self._gated: Tensor | None = None

    def requirements(self, s) -> list[str]:
        if s.loop.group_size < 2:
            return [f"loop.group_size: advantage=gardo measures each sample's distance to its nearest group mate, "
                    f"which needs groups of >= 2 samples, got {s.loop.group_size}; raise loop.group_size"]
        return []

    def features(self, learner, col) -> Tensor:
        """(B_local, F) features of this rank's final images: the final latents X_T, flattened (the release: DINOv3 of
        the decoded images; override for another extractor)."""
        return col.traj.latents[:, -1].flatten(1).float()

    def row_inputs(self, learner, col):
        comps = col.scores.components
        missing = [a for a in self.aux_components if a not in comps]
        if missing:
            raise ValueError(f"advantage.aux_components: the reward has no component {', '.join(missing)} (it has "
                             f"{', '.join(sorted(comps)) or 'none'}); name components of the reward, or set "
                             "advantage.aux_components=[] (no gate)")
        out = {f"aux/{a}": comps[a].float() for a in self.aux_components}
        if self.diversity:
            out["features"] = self.features(learner, col)
        return out

    def advantages(self, rewards, group_ids, num_steps, trained):
        final = rewards[:, -1]
        feats = self.inputs.get("features")
        if self.diversity and feats is None:
            raise ValueError("advantage.diversity: the features of the final images were not gathered "
                             "(Gardo.row_inputs)")
        a = diversity_advantages(final, feats if feats is not None else final.view(-1, 1), group_ids, self.diversity)
        if self.std_norm:
            if self.std_scope == "global":
                std = final.double().std(unbiased=self.unbiased_std).expand(len(final))
            else:
                inv, k = _group_index(group_ids, len(final))
                std = torch.stack([final.double()[inv == g].std(unbiased=self.unbiased_std)
                                   for g in range(k)])[inv]
            a = a / (std + self.eps)
        stats: dict[str, float] = {}
        self._gated = None
        if self.aux_components:
            u = uncertainty(final, [self.inputs[f"aux/{n}"] for n in self.aux_components])
            self._gated = self.risk.gate(u)
            stats = {"gate_frac": float(self._gated.double().mean()), "gate_beta": float(self.risk.beta)}
        return a.float().view(-1, 1).expand(-1, int(num_steps)).contiguous(), None, stats

    def row_outputs(self, adv):
        """``kl_weight`` (B,): the gated rows' KL weight ``N/G`` (N the rows with a non-zero advantage, which the
        update trains, G the gated ones among them) and 0 elsewhere, so that the per-row mean of ``kl_weight·KL`` is
        the release's mean over the gated rows; no gate: 1 everywhere."""
        if self._gated is None:
            return {"kl_weight": torch.ones(adv.shape[0])}
        live = adv.abs().sum(1) > 0
        g = self._gated & live
        n, m = int(live.sum()), int(g.sum())
        return {"kl_weight": g.float() * (n / m) if m else torch.zeros(adv.shape[0])}

    def state_dict(self):
        return {"risk": self.risk.state_dict()}

    def load_state_dict(self, state):
        if "risk" in state:
            self.risk.load_state_dict(state["risk"])
