"""The Objective type, and the machinery the forward-process objectives share (training times, fresh noise, copies).

The update (:func:`stepflow.core.update.update`) runs, per optimizer step, every *term* of the objective over the
micro-batches of its rows and back-propagates each term's loss (a mean over the term's rows). A term is one trained
step k for the GRPO objectives (the rollout's transition X_k → X_{k+1}) and one training time per sample for the
forward-process objectives (term j of sample i at the grid time ``t_{k_ij}``, drawn per iteration).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from stepflow.config import TrainConfig
from stepflow.core.ema import ParamCopy
from stepflow.math.sde import step_std

if TYPE_CHECKING:
    from stepflow.samplers.base import Sampler

__all__ = ["Objective", "ForwardObjective", "trainable_steps", "policy_velocity", "transition"]


def transition(traj: Any, rows: Tensor, k: int, times: Tensor, device: Any) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
    """The rollout's transition of ``rows`` at step k, on ``device``: ``(X_k, X_end, τ_k, τ_end, cond)``, where
    ``end`` is k + 1, or τ_{k+m} for a merged step (``Trajectory.step_end``: a sampler that jumps m grid steps)."""
    end = traj.step_end(k) if hasattr(traj, "step_end") else k + 1
    return (traj.latents[rows, k].to(device), traj.latents[rows, end].to(device), times[k], times[end],
            traj.cond.index(rows).to(device))


def policy_velocity(learner: Any, traj: Any, k: int, rows: Tensor, x_k: Tensor, t: Tensor, cond: Any) -> Tensor:
    """The policy's velocity at the rollout's state (X_k, τ_k) of ``rows`` (R, C, H, W), with gradients: the one the
    rollout kept with its graph (``loop.retain_graph``, :mod:`stepflow.core.retain`) when it kept step k, else a new
    forward pass (the recomputation)."""
    kept = getattr(traj, "kept", None)
    if kept is not None and k in kept:
        v = kept[k]
        return v[rows.to(v.device)]
    return learner.policy.velocity(x_k, t, cond, learner.guidance)


def trainable_steps(train: TrainConfig, sampler: Sampler, times: Tensor, density: bool = True,
                    window: Sequence[int] | None = None) -> list[int]:
    """Steps to train on the grid ``times`` (T+1,): ``train.train_steps`` (None: the first int(T·timestep_fraction)
    steps), within the SDE ``window`` (None: all), and, when the objective trains the steps' densities
    (``density``), minus the steps whose noise std is 0 under ``sampler``."""
    t_steps = times.shape[0] - 1
    cand = (list(train.train_steps) if train.train_steps is not None
            else list(range(int(t_steps * train.timestep_fraction + 1e-9))))
    cand = [k for k in cand if 0 <= k < t_steps and (window is None or k in window)]
    if not density:
        return cand
    std = step_std(sampler, times[:-1], times[1:], t_guard=times[1])
    return [k for k in cand if float(std[k]) > 0]


def need(ok: bool, msg: str) -> None:
    """A field check: ``msg`` (``<field>: must be ..., got ...``) as a ValueError unless ``ok``."""
    if not ok:
        raise ValueError(msg)


class Objective:
    """The interface (and the defaults of the GRPO family). A part (``objective=<option>``): its YAML's fields are
    its keyword arguments; ``train``: the update's settings (KL weight, clip range, ...; :meth:`bind` sets them when
    the run is built). Every objective takes ``rollout_sampler`` (an option of the ``sampler`` group its rollouts use
    whatever ``sampler`` says; null: that one) and ``same_latent`` (null: ``loop.same_latent``)."""

    name = "objective"
    needs_density = True  #: trains the rollout's SDE transitions (steps without noise cannot be trained)
    forward_process = False  #: trains on re-noised final samples (no log-probs; the rollout sampler is free)
    drops_zero_advantage = True  #: rows whose advantages are 0 at every step give no gradient and are skipped
    reads_estimates = False  #: the loss reads x̂0 estimates (of :meth:`states`), so they are computed
    #: the settings that feed each term of the loss (a key of :meth:`loss`'s output; ``loss``: the total), named when
    #: that term turns non-finite and the run stops (:mod:`stepflow.core.update`); :meth:`fields_of` reads it
    loss_fields: ClassVar[dict[str, tuple[str, ...]]] = {"loss": ("train.lr",), "kl": ("train.beta_kl", "train.lr")}
    #: a row's loss reads the other rows of its prompt group (a group-level preference: DGPO, Diffusion-DPO), so
    #: :meth:`begin_update` also receives the update's advantages and the rows' group ids (``adv=``, ``groups=``)
    couples_rows = False

    def __init__(self, train: TrainConfig | None = None, rollout_sampler: str | None = None,
                 same_latent: bool | None = None):
        need(rollout_sampler is None or isinstance(rollout_sampler, str),
             f"rollout_sampler: must be null or an option of the sampler group, got {rollout_sampler!r}")
        need(same_latent is None or isinstance(same_latent, bool), f"same_latent: must be null or a bool, got {same_latent!r}")
        self.train = train if train is not None else TrainConfig()
        self.rollout_sampler, self.same_latent = rollout_sampler, same_latent
        #: per-row (B_local,) data the credit handed over for this iteration's rows on this rank (``AdvantageOut.rows``;
        #: set by the iteration before the update; empty when the credit gives none)
        self.row_info: dict[str, Tensor] = {}
        #: the update's diagnostics of this iteration (``train/<key>``, over every rank), set before :meth:`end_iteration`
        self.update_stats: dict[str, float] = {}

    @property
    def cfg(self) -> Objective:
        """The objective's settings (itself: its fields are its attributes)."""
        return self

    def bind(self, train: TrainConfig) -> Objective:
        """The update's settings of the run (``train``)."""
        self.train = train
        return self

    def fields_of(self, term: str) -> tuple[str, ...]:
        """The settings that feed ``term`` of the loss (:attr:`loss_fields` of the class or a base; a term no class
        lists: the total's)."""
        for cls in type(self).__mro__:
            own = cls.__dict__.get("loss_fields") or {}
            if term in own:
                return tuple(own[term])
        return self.fields_of("loss") if term != "loss" else ("train.lr",)

    # ---------------------------------------------------------------- what an iteration needs
    @property
    def uses_reference(self) -> bool:
        """The loss reads the reference policy π_ref (a KL term): full fine-tuning keeps a frozen copy."""
        return self.train.beta_kl > 0

    def trained_steps(self, train: TrainConfig, sampler: Sampler, grid: Tensor,
                      window: Sequence[int] | None) -> list[int]:
        """The grid steps this iteration trains (or, for the forward-process objectives, draws times among)."""
        return trainable_steps(train, sampler, grid, self.needs_density, window)

    def states(self, trained: Sequence[int], num_steps: int) -> list[int]:
        """States whose x̂0 the loss reads (besides those the credit reads)."""
        return []

    def terms(self, steps: Sequence[int]) -> list[int]:
        """The update's loss terms (the GRPO family: the trained steps)."""
        return list(steps)

    def attach(self, params: Sequence[torch.nn.Parameter]) -> None:
        """(Re)create the objective's copies of the trained parameters (at build time, and after FSDP2 sharded them)."""

    def behaviour(self):
        """Context under which the rollout (and its x̂0 estimates) run: the behaviour policy's weights."""
        return contextlib.nullcontext()

    def begin_update(self, learner: Any, traj: Any, it: int, seeds: Tensor, steps: Sequence[int],
                     **batch: Tensor) -> None:
        """Before the update of iteration ``it`` over the trained ``steps``: draw what its terms need. ``seeds``:
        (B_local,) the rows' noise seeds (a row's draws depend on it alone, not on the rank or the batch). With
        :attr:`couples_rows`, ``batch`` holds ``adv`` (B_local, T) and ``groups`` (B_local,) long, the rows' prompt-group
        ids (one id per group, the same on every rank: a group's rows may sit on several ranks)."""

    def end_iteration(self, learner: Any) -> None:
        """After the update (the copies move toward the new weights)."""

    def loss(self, learner: Any, traj: Any, adv: Tensor, term: int, rows: Tensor, times: Tensor,
             x0_hat: Tensor | None) -> dict[str, Tensor]:
        """The loss of ``term`` on ``rows`` (a mean over them, key ``loss``) and detached diagnostics."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class ForwardObjective(Objective):
    """Shared by nft, awm and advantageflow: each row trains on K grid times of its own (``times_of``), with fresh
    noise ε per (row, term), at ``x_t = (1 − t)·X_T + t·ε`` from the rollout's final latent X_T; the advantage of a
    term is the row's advantage at the grid step of its time (uniform credit: the row's one advantage)."""

    needs_density = False
    forward_process = True
    drops_zero_advantage = False  # r = 1/2 (NFT) and the proximity terms still train at A = 0

    def __init__(self, adv_clip_max: float = 5.0, **common):
        super().__init__(**common)
        need(isinstance(adv_clip_max, (int, float)) and adv_clip_max > 0, f"adv_clip_max: must be > 0, got {adv_clip_max}")
        self.adv_clip_max = adv_clip_max
        self.index: Tensor | None = None  #: (B_local, K) grid index of each row's term
        self.noise: Tensor | None = None  #: (B_local, K, C, H, W) fresh noise

    def num_terms(self, steps: Sequence[int]) -> int:
        """K, the terms (training times) per row."""
        return len(steps)

    def terms(self, steps: Sequence[int]) -> list[int]:
        return list(range(self.num_terms(steps)))

    def draw_indices(self, steps: Sequence[int], gen: torch.Generator, shared: torch.Generator) -> Tensor:
        """(K,) the grid indices of one row's terms among the candidate ``steps``, drawn with the row's generator
        ``gen`` (or, for times every row shares, with ``shared``, seeded alike on every rank)."""
        raise NotImplementedError

    def begin_update(self, learner, traj, it, seeds, steps, **batch):
        shape = tuple(traj.latents.shape[2:])
        idx, eps = [], []
        shared_seed = (learner.loop.seed * 1_000_003 + it * 7919 + 11) % (2**63 - 1)
        for s in seeds.tolist():  # the row's own stream: independent of its rank and batch
            g = torch.Generator().manual_seed((int(s) * 1_000_003 + 7) % (2**63 - 1))
            ks = self.draw_indices(steps, g, torch.Generator().manual_seed(shared_seed))
            idx.append(ks)
            eps.append(torch.randn((len(ks), *shape), generator=g))
        k = len(self.terms(steps))
        self.index = torch.stack(idx) if idx else torch.zeros(0, k, dtype=torch.long)
        self.noise = torch.stack(eps) if eps else torch.zeros(0, k, *shape)

    def point(self, learner, traj, adv: Tensor, term: int, rows: Tensor, times: Tensor):
        """(x0, ε, t (B,), x_t, cond, A (B,)) of ``term`` on ``rows``."""
        dev = learner.policy.device
        k = self.index[rows, term]
        x0 = traj.latents[rows, -1].to(dev)
        eps = self.noise[rows, term].to(dev)
        t = times[k.to(times.device)].to(dev)
        tb = t.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - tb) * x0 + tb * eps
        a = adv[rows, k].to(dev)
        return x0, eps, t, x_t, traj.cond.index(rows).to(dev), a

    def velocity_under(self, learner, copy: ParamCopy | None, x_t, t, cond) -> Tensor:
        """v of a weight copy (None: π_ref, the LoRA disabled or the frozen initial transformer), without grad."""
        pol = learner.policy
        with torch.no_grad():
            if copy is None:
                with pol.reference():
                    return pol.velocity(x_t, t, cond, learner.guidance)
            with copy.applied():
                return pol.velocity(x_t, t, cond, learner.guidance)

    def kl_terms(self, learner, v: Tensor, v_ref: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        from stepflow.math.forward import velocity_kl

        if v_ref is None:
            return v.new_zeros(()), {}
        kl = velocity_kl(v, v_ref)
        return self.train.beta_kl * kl, {"kl": kl.detach()}
