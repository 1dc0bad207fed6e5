"""The policy update of one iteration (docs/method.md §10): the objective's terms over the trained rows, the
optimizer steps, and their diagnostics. :func:`stepflow.core.algorithm.iteration` calls :func:`update` once per iteration.

The update is resolved first (:func:`plan_update`: a :class:`TermPlan`, which rows train in which optimizer steps,
which terms of which rows, at which scale), then run as one loop over its optimizer steps (:func:`optimizer_steps`,
each a list of :class:`Work` items: one term over its micro-batches). ``train.update_per_step`` is more optimizer
steps in the plan; the per-step weightings (``train.weighting=grad_rms | auto``) combine each step's gradient
themselves (:meth:`stepflow.math.weighting.Weighting.combine`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from stepflow.core.dist import Dist, clip_grad_norm
from stepflow.core.rollout import Trajectory
from stepflow.errors import NonFiniteUpdate

#: a :class:`stepflow.core.algorithm.Learner` (not imported here: the iteration imports this module)
Learner = Any

__all__ = ["update", "check_finite_loss", "step_loss", "step_gradients", "subset_steps", "steps_per_sample", "clip_and_step", "TermPlan",
           "OptStep", "Work", "plan_update", "optimizer_steps", "lockstep_pads"]


def update(learner: Learner, traj: Trajectory, adv: Tensor, x0_hat: Tensor | None, it: int,
           steps: list[int] | None = None, weights: Tensor | None = None, groups: Tensor | None = None,
           measure: bool = False, seeds: Tensor | None = None, mask: Tensor | None = None) -> dict[str, float]:
    """Policy update over the objective's terms: the plan of :func:`plan_update` (``steps``, ``weights``, ``seeds``,
    ``mask``: see there), then one loop over its optimizer steps (:func:`optimizer_steps`), each accumulating its
    work items (a term over micro-batches; each micro-batch's loss, :func:`step_loss`, a mean over its rows, weighted
    by its share of the step's rows on every rank times the item's scale) and stepping (:func:`clip_and_step`).
    ``train.weighting`` = grad_rms / auto combine the steps' gradients instead
    (:meth:`stepflow.math.weighting.Weighting.combine`); ``measure``: add this update's gradients to the auto-step signal
    estimate (``groups``: (B_local,) group ids, to split the batch into independent halves). adv: (B_local, T).
    ``loop.retain_graph``: the terms' velocities are the rollout's, with their graphs; their losses are summed and
    back-propagated once per optimizer step (a graph is freed by its first backward). Returns diagnostics (means
    over terms)."""
    plan = plan_update(learner, traj, adv, it, steps, weights, seeds, mask, groups)
    pol, dist = learner.policy, learner.dist
    times, params = traj.times.to(pol.device), list(pol.trainable_parameters())
    stats = _Stats()  # row-weighted sums, detached 0-d tensors: no host sync until the end of the update
    pending: list[Tensor] | None = [] if traj.kept is not None else None  # loop.retain_graph: the weighted losses
    watch: list[tuple[int, dict[str, Tensor]]] = []  # this optimizer step's terms (loss, diagnostics): finite?
    pol.train()

    def run(item: Work) -> None:  # one term over its micro-batches, then its lockstep pads (loss weight 0)
        for i, (mb, real) in enumerate(item.batches):
            out = step_loss(learner, traj, adv, item.k, mb, times, x0_hat)
            if real:
                watch.append((item.k, {n: v.detach() for n, v in out.items() if isinstance(v, Tensor)}))
            # each term is a mean over its rows: weighted, the step's loss is the mean over all rows of the optimizer
            # step on all ranks (gradients are then summed over ranks: grad_scale undoes a strategy's mean)
            w = item.scale * len(mb) / item.n_global * dist.grad_scale if real else 0.0
            dist.boundary(item.last and i == len(item.batches) - 1)  # DeepSpeed: reduce and step after the last
            if pending is not None:
                pending.append(out.pop("loss") * w)
            else:
                learner.backward(out.pop("loss") * w)
            if real:
                stats.add_terms(out, len(mb), item.k)

    for step in optimizer_steps(plan, dist):
        learner.optimizer.zero_grad(set_to_none=True)
        watch.clear()
        if step.work is None:  # train.weighting=grad_rms / auto: every step's gradient apart, then combined
            learner.weighting.combine(learner, plan.terms, step.rows, step.n_global, step.mbs, groups,
                                      lambda k, mbs, s=step: run(s.item(k, mbs)), params, stats.plain, measure)
        else:
            with dist.accumulating():
                for item in step.work:
                    run(item)
        if pending:  # the kept graphs: one backward of every term's weighted loss
            learner.backward(torch.stack(pending).sum())
            pending.clear()
        check_finite_loss(learner, watch)
        dist.all_reduce_grads(params)
        norm = clip_and_step(learner, params, learner.train.max_grad_norm)
        if norm is not None:
            stats.plain.setdefault("grad_norm", []).append(norm)
        learner.opt_steps += 1
        if learner.on_optimizer_step is not None:
            learner.on_optimizer_step(learner.opt_steps - 1)
    pol.eval()
    return _diagnostics(learner, plan, stats)


@dataclass
class TermPlan:
    """One update, resolved before it runs (:func:`plan_update`); :func:`optimizer_steps` makes its optimizer steps."""

    steps: list[int]  #: the trained steps (the forward-process objectives: the candidate times)
    rows: Tensor  #: (N,) this rank's trained rows (zero-advantage rows dropped), shuffled
    chunks: list[Tensor]  #: each optimizer step's rows (``per_term``: the rows of as many steps as terms)
    terms: list[int]  #: the objective's terms (the GRPO family: the trained steps)
    subset: Tensor | None  #: (B_local, S) bool, row i trains term j (step_subset / mask); None: every row every term
    per_row: int  #: how many terms each row trains
    weights: Tensor | None  #: (S,) the terms' loss weights (mean 1); None: all 1
    micro_batch: int  #: rows per forward / backward pass
    per_term: bool = False  #: ``train.update_per_step``: one optimizer step per term of each chunk
    combine: bool = False  #: the weighting combines per-step gradients (``Weighting.per_step``)

    def weight(self, j: int) -> float:
        return 1.0 if self.weights is None else float(self.weights[j])


@dataclass
class Work:
    """One term of an optimizer step: term ``k`` over ``batches`` (micro-batch, real): this rank's micro-batches,
    then its lockstep pads (:func:`lockstep_pads`; this rank's first row at loss weight 0: no gradient, no statistic).
    A real micro-batch's loss (a mean over its rows) weighs ``scale·len(mb)/n_global`` (``n_global``: the rows of
    the optimizer step, or of the term's own step, on every rank); ``last``: its last backward ends the optimizer
    step (:meth:`stepflow.core.dist.Dist.boundary`)."""

    k: int
    batches: list[tuple[Tensor, bool]]
    scale: float
    n_global: float
    last: bool = False


@dataclass
class OptStep:
    """One optimizer step: its rows on this rank and on every rank, their micro-batches and lockstep pads, and its
    work items (None: the weighting combines per-step gradients, running the terms over parts by :meth:`item`)."""

    rows: Tensor
    n_global: float
    mbs: list[Tensor]
    pads: int
    work: list[Work] | None = None

    def item(self, k: int, mbs: list[Tensor], scale: float = 1.0, last: bool = False) -> Work:
        """Term ``k`` over ``mbs`` (this step's rows or a part of them) and this step's pads."""
        return Work(k, _batches(mbs, self.pads), scale, self.n_global, last)


def plan_update(learner: Learner, traj: Trajectory, adv: Tensor, it: int, steps: list[int] | None = None,
                weights: Tensor | None = None, seeds: Tensor | None = None, mask: Tensor | None = None,
                groups: Tensor | None = None) -> TermPlan:
    """The update of iteration ``it`` resolved (:func:`update`): the trained ``steps`` (default the objective's
    :meth:`~stepflow.objectives.base.Objective.trained_steps`; the forward-process objectives: K training times per
    row drawn among them, by :meth:`~stepflow.objectives.base.Objective.begin_update`); the rows kept
    (``train.drop_zero_adv``: not those whose advantage is 0 at every step) shuffled into ``updates_per_iter``
    chunks, one optimizer step each (several ranks: as many on every rank, a rank may hold no rows of one); the
    terms, term j's loss weighted by ``weights[j]`` (S,) (mean 1; default 1). ``seeds``: (B_local,) the rows' noise
    seeds (what the forward-process objectives draw their times and noise from, and ``train.step_subset`` each
    row's steps; default the row indices).

    ``train.step_subset=random_per_sample`` (DanceGRPO): row i trains only its own ``int(S·train.step_fraction)`` of
    the S terms (:func:`subset_steps`); term j runs over the chunk's rows that drew it, and each (row, term) pair's
    loss is weighted ``weights[j]/(N·int(S·fraction))``, N the chunk's rows on every rank: the released
    ``mean max(−Aρ, −A clip(ρ, 1 ± ϵ))/(grad_accum·train_timesteps)`` summed over an optimizer step's samples and
    their steps (fastvideo/train_grpo_flux.py L571-611). ``mask``: (B_local, S) bool, the same per-row subset given by
    the caller instead of drawn (the branch rollouts of :mod:`stepflow.core.branch_loop`: each branch row trains its own
    step only); every row must train the same number of terms. ``groups``: (B_local,) the rows' prompt-group ids,
    given with the advantages to an objective whose rows' losses read their group (``Objective.couples_rows``).

    ``train.update_per_step`` (Granular-GRPO): one optimizer step per term, each over the chunk's rows that train
    it (its loss the mean over them, times ``weights[j]``), in the terms' order."""
    o, dist, obj = learner.train, learner.dist, learner.objective
    if steps is None:
        steps = obj.trained_steps(o, learner.sampler, traj.times, learner.window_steps(it))
    keep = (adv.abs().sum(1) > 0 if (o.drop_zero_adv and obj.drops_zero_advantage)
            else torch.ones(traj.batch_size, dtype=torch.bool))
    rows = torch.nonzero(keep).flatten()
    rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(learner.loop.seed * 7919 + it))]
    if dist.world > 1:  # the same number of optimizer steps on every rank (a rank may hold no rows of a chunk)
        chunks = list(rows.tensor_split(o.updates_per_iter))
    else:
        chunks = [c for c in rows.chunk(o.updates_per_iter) if len(c)] if len(rows) else []
    seeds = torch.arange(traj.batch_size) if seeds is None else seeds
    if not steps:  # e.g. the ODE sampler: no step has a density, nothing to train
        chunks = []
    elif obj.couples_rows:  # a group-level preference (DGPO, Diffusion-DPO): its rows' advantages and groups
        if groups is None:
            raise ValueError(f"objective={obj.name}: a row's loss reads its prompt group, and the update was given "
                             "no group ids (groups=)")
        obj.begin_update(learner, traj, it, seeds, steps, adv=adv, groups=torch.as_tensor(groups))
    else:
        obj.begin_update(learner, traj, it, seeds, steps)
    terms = obj.terms(steps)
    subset, per_row = _row_terms(learner, traj.batch_size, terms, seeds, mask)
    if per_row == 0:  # int(S·step_fraction) = 0: no sample trains a step (train.py refuses such settings)
        chunks = []
    # loop.retain_graph: the rollout's graphs serve one optimizer step (a graph is freed by its first backward)
    if traj.kept is not None and (len(chunks) > 1 or o.update_per_step or learner.weighting.per_step):
        from stepflow.core.retain import why_not_at_runtime

        raise ValueError(f"loop.retain_graph: the rollout's graphs serve one optimizer step over every term; "
                         f"{why_not_at_runtime(learner) or 'this update takes several'}")
    return TermPlan(steps, rows, chunks, terms, subset, per_row, weights, o.micro_batch_size,
                    per_term=bool(o.update_per_step), combine=bool(learner.weighting.per_step))


def _row_terms(learner: Learner, batch: int, terms: list[int], seeds: Tensor,
               mask: Tensor | None) -> tuple[Tensor | None, int]:
    """Which terms each row trains: (the (B_local, S) bool subset, or None for every row every term; the count per
    row). ``train.step_subset`` draws it from the rows' ``seeds``; a ``mask`` is given (a rank without rows learns
    its count from the others: one collective). Refuses what the settings cannot combine."""
    o, dist = learner.train, learner.dist
    # train.step_subset (DanceGRPO): each row trains its own int(S·step_fraction) of the S terms, drawn from its seed
    subset = subset_steps(len(terms), seeds, o.step_fraction) if o.step_subset is not None and terms else None
    if mask is not None:  # given by the rollout (branch rows), not drawn
        if subset is not None:
            raise ValueError("train.step_subset: the branch rollouts give each row its own step already; set "
                             "train.step_subset=null")
        subset = torch.as_tensor(mask, dtype=torch.bool)
        if subset.shape != (batch, len(terms)):
            raise ValueError(f"mask: expected shape ({batch}, {len(terms)}), got {tuple(subset.shape)}")
        counts = subset.sum(1)
        if len(counts) and bool((counts != counts[0]).any()):
            raise ValueError("mask: every row must train the same number of terms")
    if subset is not None and learner.weighting.per_step:
        raise ValueError(f"train.step_subset: combines the terms of each sample's own steps, which "
                         f"train.weighting={o.weighting} (whole per-step gradients) cannot; use another train.weighting")
    if o.update_per_step and learner.weighting.per_step:
        raise ValueError(f"train.update_per_step: one optimizer step per trained step, which train.weighting="
                         f"{o.weighting} (a combination of every step's gradient) cannot; use another train.weighting")
    if mask is not None:  # a rank without rows learns the count from the others
        return subset, int(dist.all_max(int(subset[0].sum()) if len(subset) else 0))
    return subset, steps_per_sample(len(terms), o.step_fraction) if subset is not None else len(terms)


def optimizer_steps(plan: TermPlan, dist: Dist) -> Iterator[OptStep]:
    """The plan's optimizer steps in order, each resolved just before it runs: its row counts and lockstep pads are
    collectives, which every rank makes in the same order between the previous step and this one. A chunk that no
    rank holds a row of takes no step. Each chunk's step holds, by the plan:

    - every term over the chunk's micro-batches, scale ``weights[j]/S`` (the step's loss: the mean over the terms);
    - ``subset``: term j over the chunk's rows that train it, padded to the rank with most of them, scale
      ``weights[j]/per_row``; the last backward any rank makes ends the step (even when no row drew the last term);
    - ``per_term``: one step per term instead, over the chunk's rows that train it (none if no rank holds one),
      scale ``weights[j]`` over those rows;
    - ``combine``: no items: the weighting runs each term over parts of the chunk (:meth:`OptStep.item`, scale 1)."""
    for chunk in plan.chunks:
        n_global = dist.all_sum(len(chunk))
        if n_global == 0:
            continue
        step = _opt_step(dist, chunk, n_global, plan.micro_batch)
        terms = list(enumerate(plan.terms))
        if plan.per_term:  # Granular-GRPO: an optimizer step per term, each the mean over the rows that train it
            for j, k in terms:
                rows = chunk if plan.subset is None else chunk[plan.subset[chunk, j]]
                n_j = dist.all_sum(len(rows))
                if n_j == 0:  # no row of any rank trains this term: no step
                    continue
                one = _opt_step(dist, rows, n_j, plan.micro_batch)
                one.work = [one.item(k, one.mbs, plan.weight(j), last=True)]
                yield one
            continue
        if plan.subset is not None:  # term j over the chunk's rows that drew it; each (row, term) pair 1/(N·per_row)
            mine = [_micro_batches(chunk[plan.subset[chunk, j]], plan.micro_batch) for j, _ in terms]
            pads = lockstep_pads(dist, [len(m) for m in mine])  # one collective for every term's count
            last = max((j for j, _ in terms if len(mine[j]) + pads[j] > 0), default=-1)
            step.work = [Work(k, _batches(mine[j], pads[j]), plan.weight(j) / plan.per_row, n_global, j == last)
                         for j, k in terms]
        elif not plan.combine:
            step.work = [step.item(k, step.mbs, plan.weight(j) / len(terms), j == len(terms) - 1) for j, k in terms]
        yield step


def lockstep_pads(dist: Dist, counts: int | list[int]) -> int | list[int]:
    """FSDP2 / DeepSpeed (:attr:`~stepflow.core.dist.Dist.lockstep`): every forward and backward is a collective, so every
    rank runs as many micro-batches as the rank with most; how many extra ones this rank runs for ``counts`` (its
    micro-batches of one step: an int, one ``all_max``; of every term: a list, one ``all_max_tensor``). 0 otherwise
    (no collective)."""
    if isinstance(counts, int):
        return int(dist.all_max(counts)) - counts if dist.lockstep else 0
    if not dist.lockstep:
        return [0] * len(counts)
    most = dist.all_max_tensor(torch.tensor(counts, dtype=torch.float64))
    return [int(m) - c for m, c in zip(most, counts)]


def _opt_step(dist: Dist, rows: Tensor, n_global: float, micro_batch: int) -> OptStep:
    mbs = _micro_batches(rows, micro_batch)
    return OptStep(rows, n_global, mbs, lockstep_pads(dist, len(mbs)))


def _micro_batches(rows: Tensor, size: int) -> list[Tensor]:
    return [mb for mb in rows.split(size) if len(mb)]  # a rank may hold none of a chunk's rows


def _batches(mbs: list[Tensor], pads: int) -> list[tuple[Tensor, bool]]:
    """(micro-batch, real): ``mbs``, then ``pads`` zero-weight ones of this rank's first row."""
    return [(mb, True) for mb in mbs] + [(torch.zeros(1, dtype=torch.long), False)] * pads


def _diagnostics(learner: Learner, plan: TermPlan, stats: _Stats) -> dict[str, float]:
    dist = learner.dist
    res = stats.reduce(dist)
    res["train/samples_trained"] = dist.all_sum(len(plan.rows))
    res["train/steps_trained"] = float(len(plan.terms) if plan.steps else 0)
    if plan.subset is not None:
        res["train/steps_per_sample"] = float(plan.per_row)
    if plan.weights is not None:
        res.update({f"train/weight_step{k}": float(w) for k, w in zip(plan.steps, plan.weights)})
    if learner.signal is not None:
        res.update({f"train/signal_step{k}": float(r) for k, r in zip(learner.signal.steps, learner.signal.rho())})
        res.update({f"train/weight_step{k}": float(w) for k, w in zip(learner.signal.steps, learner.signal.weights())})
        q, q95, tau2 = learner.signal.heterogeneity()
        if q95 < float("inf"):  # Cochran's Q over its 95 % point: the weights leave uniform above 1
            res["train/signal_heterogeneity"], res["train/signal_tau2"] = q / q95, tau2
    return res


def steps_per_sample(num_terms: int, fraction: float) -> int:
    """``train.step_subset=random_per_sample``: how many of the S terms each sample trains, ``int(S·fraction)``
    (DanceGRPO's ``train_timesteps = int(len(timesteps)·timestep_fraction)``, fastvideo/train_grpo_flux.py L570:
    a plain floor of the float product, as released)."""
    return int(num_terms * fraction)


def subset_steps(num_terms: int, seeds: Tensor, fraction: float) -> Tensor:
    """DanceGRPO's per-sample random subset of the trained steps (fastvideo/train_grpo_flux.py L551-570): row i
    permutes the S terms with ``torch.randperm`` under a generator seeded from its own noise seed ``seeds[i]`` (so the
    draw depends on the row alone: the same on any rank, in any batch, on resume) and keeps the first
    :func:`steps_per_sample` (S, fraction). seeds: (B,) long. Returns (B, S) bool, ``mask[i, j]`` = row i trains
    term j; every row has the same count."""
    n = steps_per_sample(num_terms, fraction)
    mask = torch.zeros(len(seeds), num_terms, dtype=torch.bool)
    for i, s in enumerate(seeds.tolist()):
        g = torch.Generator().manual_seed((int(s) * 1_000_003 + 13) % (2**63 - 1))  # its own stream (NFT's is + 7)
        mask[i, torch.randperm(num_terms, generator=g)[:n]] = True
    return mask


class _Stats:
    """The update's diagnostics: each term's value weighted by its rows (``add_terms``), reduced over ranks into
    row-weighted means (``ratio_min`` / ``ratio_max``: global min / max); ``plain``: per-optimizer-step values, the
    same on every rank (grad_norm, auto_steps), averaged."""

    def __init__(self) -> None:
        self.sums: dict[str, list[Tensor]] = {}
        self.rows: dict[str, float] = {}
        self.extremes: dict[str, list[Tensor]] = {"ratio_min": [], "ratio_max": []}
        self.plain: dict[str, list[Tensor]] = {}

    def add_terms(self, out: dict[str, Tensor], n: int, k: int) -> None:
        for name, v in out.items():
            if name in self.extremes:
                self.extremes[name].append(v.detach())
                continue
            names = [name, f"{name}_step{k}"] if name in ("clip_frac", "kl") else [name]
            for key in names:
                self.sums.setdefault(key, []).append(v.detach().double() * n)
                self.rows[key] = self.rows.get(key, 0.0) + n

    def reduce(self, dist: Dist) -> dict[str, float]:
        """One host sync; under several ranks one sum and one max over ranks (every rank must call it)."""
        keys = dist.union(self.sums) if dist.world > 1 else sorted(self.sums)
        sums = torch.stack([torch.stack(self.sums[k]).sum().cpu() if k in self.sums else torch.zeros((), dtype=torch.float64)
                            for k in keys]) if keys else torch.zeros(0, dtype=torch.float64)
        rows = torch.tensor([self.rows.get(k, 0.0) for k in keys], dtype=torch.float64)
        both = dist.all_sum_tensor(torch.cat([sums, rows]))
        sums, rows = both[:len(keys)], both[len(keys):]
        res = {f"train/{k}": float(sums[i] / rows[i]) for i, k in enumerate(keys) if rows[i] > 0}
        lo, hi = self.extremes["ratio_min"], self.extremes["ratio_max"]
        ext = torch.tensor([-float(torch.stack(lo).min()) if lo else -float("inf"),
                            float(torch.stack(hi).max()) if hi else -float("inf")], dtype=torch.float64)
        ext = dist.all_max_tensor(ext)
        if bool(torch.isfinite(ext).all()):
            res["train/ratio_min"], res["train/ratio_max"] = -float(ext[0]), float(ext[1])
        for k, v in self.plain.items():
            res[f"train/{k}"] = float(torch.stack([x.double() for x in v]).cpu().mean())
        return res


def clip_and_step(learner: Learner, params: list, max_norm: float) -> Tensor | None:
    """Clip the gradients to ``max_norm`` (0 = no clipping) and take the optimizer step; returns the gradient norm
    before clipping (None without clipping). DeepSpeed clips inside its own step (``gradient_clipping`` in its config)
    and reports the norm it clipped with; FSDP2's sharded gradients have their norm summed over ranks.

    A gradient whose norm is inf / nan (the norm is global, so every rank sees it) raises
    :class:`NonFiniteUpdate` before the step: no non-finite weight is taken, saved or logged, and ``last.ckpt``
    keeps the last finished iteration."""
    engine = learner.dist.engine
    if engine is not None:
        learner.optimizer.step()
        norm = torch.as_tensor(float(engine.get_global_grad_norm() or 0.0), dtype=torch.float64)
        _check_finite_grad(learner, norm, taken=True)
        return norm if max_norm > 0 else None
    norm = clip_grad_norm(params, max_norm if max_norm > 0 else float("inf"))
    _check_finite_grad(learner, norm, taken=False)
    learner.optimizer.step()
    return norm if max_norm > 0 else None


def _check_finite_grad(learner: Learner, norm: Tensor, taken: bool) -> None:
    if bool(torch.isfinite(norm)):
        return
    when = ("DeepSpeed's optimizer step has taken it; nothing was saved after it" if taken
            else "the optimizer step was not taken")
    obj = getattr(learner, "objective", None)
    own = [f for f in (obj.fields_of("loss") if obj is not None else ()) if f != "train.lr"]
    fed = f", or the objective's settings ({', '.join(own)}, objective={obj.name})" if own else ""
    raise NonFiniteUpdate(
        f"train: the gradient of optimizer step {learner.opt_steps + 1} is not finite (norm {float(norm)}), so the run "
        f"stopped: {when}, and checkpoints/last.ckpt holds the last finished iteration; lower train.lr, check the "
        f"reward (train/nonfinite_rewards) or clip harder (train.max_grad_norm){fed}")


def check_finite_loss(learner: Learner, watch: Sequence[tuple[int, dict[str, Tensor]]]) -> None:
    """Stop before the optimizer step when a term's loss of this step is inf / nan on any rank (a loss that
    overflows can leave a finite, even zero, gradient: the run would go on training nothing). ``watch``: (term, the
    term's loss and detached diagnostics) of every micro-batch of the step on this rank. One host sync (and, under
    several ranks, one collective) per optimizer step. Raises :class:`NonFiniteUpdate` naming the term and the
    settings that feed it (:meth:`stepflow.objectives.base.Objective.fields_of`)."""
    losses = [v["loss"].double().reshape(-1) for _, v in watch if "loss" in v]
    bad = bool(losses) and not bool(torch.isfinite(torch.cat([x.cpu() for x in losses])).all())
    if not learner.dist.any(bad):
        return
    obj = learner.objective
    k, out = next(((k, v) for k, v in watch if "loss" in v and not bool(torch.isfinite(v["loss"]).all())),
                  (None, {}))
    odd = [n for n, v in out.items() if n != "loss" and v.numel() and not bool(torch.isfinite(v).all())]
    named = [n for n in odd if n in {t for c in type(obj).__mro__ for t in (c.__dict__.get("loss_fields") or {})}]
    term = named[0] if named else "loss"
    where = (f"train/{term} = {float(out[term].double().reshape(-1)[0])} in term {k} of objective={obj.name}"
             if k is not None else f"on another rank, objective={obj.name}")
    fields = ", ".join(obj.fields_of(term))
    raise NonFiniteUpdate(
        f"train: the loss of optimizer step {learner.opt_steps + 1} is not finite ({where}), so the run stopped before "
        f"the step, and checkpoints/last.ckpt holds the last finished iteration; {term} is fed by {fields}: set "
        f"{'it' if ',' not in fields else 'them'} back toward the defaults (or lower train.lr)")


def step_loss(learner: Learner, traj: Trajectory, adv: Tensor, k: int, rows: Tensor, times: Tensor,
              x0_hat: Tensor | None = None) -> dict[str, Tensor]:
    """The loss of term k (the GRPO family: step k) on ``rows`` (a mean over them, key ``loss``) and its detached
    diagnostics: the objective's (:meth:`stepflow.objectives.base.Objective.loss`; docs/method.md §5, §6.3, §11)."""
    return learner.objective.loss(learner, traj, adv, k, rows, times, x0_hat)


def step_gradients(learner: Learner, traj: Trajectory, adv: Tensor, steps: Sequence[int]) -> Tensor:
    """Flattened gradient (of the trained weights) of the GRPO loss of each step in ``steps`` over the whole batch:
    (len(steps), D), the input of :func:`stepflow.math.coherence.signal_fraction`.

    The loss is the training loop's own (:func:`step_loss` of ``learner``, β·KL included); ``traj``/``adv`` come
    from one rollout and its advantages. The weights are not changed; gradients of the LoRA parameters are left
    cleared.
    """
    params = list(learner.policy.trainable_parameters())
    rows = torch.arange(traj.batch_size)
    times = traj.times.to(learner.policy.device)
    out = []
    learner.policy.train()
    try:
        for k in steps:
            for p in params:
                p.grad = None
            step_loss(learner, traj, adv, k, rows, times)["loss"].backward()
            out.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]))
    finally:
        for p in params:
            p.grad = None
        learner.policy.eval()
    return torch.stack(out)
