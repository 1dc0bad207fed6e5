"""The policy update of one iteration (docs/method.md §10): the objective's terms over the trained rows, the
optimizer steps, and their diagnostics. :func:`stepflow.algorithm.iteration` calls :func:`update` once per iteration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stepflow.dist import Dist, clip_grad_norm
from stepflow.errors import NonFiniteUpdate
from stepflow.rollout import Trajectory

if TYPE_CHECKING:
    from stepflow.algorithm import Learner

__all__ = ["update", "step_loss", "step_gradients", "subset_steps", "steps_per_sample", "clip_and_step"]


def update(learner: Learner, traj: Trajectory, adv: Tensor, x0_hat: Tensor | None, it: int,
           steps: list[int] | None = None, weights: Tensor | None = None, groups: Tensor | None = None,
           measure: bool = False, seeds: Tensor | None = None, mask: Tensor | None = None) -> dict[str, float]:
    """Policy update over the objective's terms (the GRPO family: the trained ``steps``, default the objective's
    :meth:`~stepflow.objectives.base.Objective.trained_steps`; the forward-process objectives: K training times per
    row drawn among them): ``updates_per_iter`` optimizer steps over shuffled rows, each accumulating (terms ×
    micro-batches), term j's loss weighted by ``weights[j]`` (S,) (mean 1; default 1). ``train.weighting`` =
    grad_rms / auto combine the steps' gradients instead (:func:`_per_step_update`); ``measure``: add this update's
    gradients to the auto-step signal estimate (``groups``: (B_local,) group ids, to split the batch into independent
    halves). adv: (B_local, T); ``seeds``: (B_local,) the rows' noise seeds (what the forward-process objectives draw
    their times and noise from, and ``train.step_subset`` each row's steps; default the row indices).

    ``train.step_subset=random_per_sample`` (DanceGRPO): row i trains only its own ``int(S·train.step_fraction)`` of
    the S terms (:func:`subset_steps`); term j runs over the chunk's rows that drew it, and each (row, term) pair's
    loss is weighted ``weights[j]/(N·int(S·fraction))``, N the chunk's rows on every rank: the released
    ``mean max(−Aρ, −A clip(ρ, 1 ± ϵ))/(grad_accum·train_timesteps)`` summed over an optimizer step's samples and
    their steps (fastvideo/train_grpo_flux.py L571-611). ``mask``: (B_local, S) bool, the same per-row subset given by
    the caller instead of drawn (the branch rollouts of :mod:`stepflow.branch_loop`: each branch row trains its own
    step only); every row must train the same number of terms.

    ``train.update_per_step`` (Granular-GRPO): one optimizer step per term, each over the chunk's rows that train
    it (its loss the mean over them, times ``weights[j]``), in the terms' order. Returns diagnostics (means over
    terms)."""
    o, pol, dist, obj = learner.train, learner.policy, learner.dist, learner.objective
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
    if not steps:  # e.g. the ODE sampler: no step has a density, nothing to train
        chunks = []
    else:
        obj.begin_update(learner, traj, it, torch.arange(traj.batch_size) if seeds is None else seeds, steps)
    todo = obj.terms(steps)
    # train.step_subset (DanceGRPO): each row trains its own int(S·step_fraction) of the S terms, drawn from its seed
    subset = (subset_steps(len(todo), torch.arange(traj.batch_size) if seeds is None else seeds, o.step_fraction)
              if o.step_subset is not None and todo else None)  # (B_local, S) bool, or None: every row every term
    if mask is not None:  # given by the rollout (branch rows), not drawn
        if subset is not None:
            raise ValueError("train.step_subset: the branch rollouts give each row its own step already; set "
                             "train.step_subset=null")
        subset = torch.as_tensor(mask, dtype=torch.bool)
        if subset.shape != (traj.batch_size, len(todo)):
            raise ValueError(f"mask: expected shape ({traj.batch_size}, {len(todo)}), got {tuple(subset.shape)}")
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
        per_row = int(dist.all_max(int(subset[0].sum()) if len(subset) else 0))
    elif subset is not None:
        per_row = steps_per_sample(len(todo), o.step_fraction)
    else:
        per_row = len(todo)
    if per_row == 0:  # int(S·step_fraction) = 0: no sample trains a step (train.py refuses such settings)
        chunks = []
    times = traj.times.to(pol.device)
    params = list(pol.trainable_parameters())
    stats = _Stats()  # row-weighted sums, detached 0-d tensors: no host sync until the end of the update
    # loop.retain_graph: the terms' velocities are the rollout's, with their graphs; their losses are summed and
    # back-propagated once per optimizer step (a graph is freed by its first backward)
    pending: list[Tensor] | None = [] if traj.kept is not None else None
    if pending is not None and (len(chunks) > 1 or o.update_per_step or learner.weighting.per_step):
        from stepflow.retain import why_not_at_runtime

        raise ValueError(f"loop.retain_graph: the rollout's graphs serve one optimizer step over every term; "
                         f"{why_not_at_runtime(learner) or 'this update takes several'}")
    pol.train()

    def optimizer_step() -> None:
        if pending:  # the kept graphs: one backward of every term's weighted loss
            learner.backward(torch.stack(pending).sum())
            pending.clear()
        dist.all_reduce_grads(params)
        norm = clip_and_step(learner, params, o.max_grad_norm)
        if norm is not None:
            stats.plain.setdefault("grad_norm", []).append(norm)
        learner.opt_steps += 1
        if learner.on_optimizer_step is not None:
            learner.on_optimizer_step(learner.opt_steps - 1)

    for chunk in chunks:
        n_global = dist.all_sum(len(chunk))
        if n_global == 0:
            continue
        learner.optimizer.zero_grad(set_to_none=True)
        mbs = [mb for mb in chunk.split(o.micro_batch_size) if len(mb)]  # a rank may hold none of a chunk's rows
        # FSDP2 / DeepSpeed: every forward and backward is a collective, so every rank runs as many micro-batches as
        # the rank with most; the extra ones are this rank's first row at loss weight 0 (no gradient, no statistic)
        pads = [torch.zeros(1, dtype=torch.long)] * (int(dist.all_max(len(mbs))) - len(mbs) if dist.lockstep else 0)

        def terms(k: int, rows_list, scale: float, last: bool = False, n_global: float = n_global,
                  pads: list = pads) -> None:  # step k, backward
            batches = [(mb, True) for mb in rows_list] + [(mb, False) for mb in pads]
            for i, (mb, real) in enumerate(batches):
                out = step_loss(learner, traj, adv, k, mb, times, x0_hat)
                # each term is a mean over its rows: weighted, the step's loss is the mean over all rows of the
                # chunk on all ranks (gradients are then summed over ranks: grad_scale undoes a strategy's mean),
                # averaged over the steps
                w = scale * len(mb) / n_global * dist.grad_scale if real else 0.0
                dist.boundary(last and i == len(batches) - 1)  # DeepSpeed: reduce and step after the chunk's last
                if pending is not None:
                    pending.append(out.pop("loss") * w)
                else:
                    learner.backward(out.pop("loss") * w)
                if real:
                    stats.add_terms(out, len(mb), k)

        if o.update_per_step:  # Granular-GRPO: an optimizer step per term, each the mean over the rows that train it
            for j, k in enumerate(todo):
                rows_j = chunk if subset is None else chunk[subset[chunk, j]]
                n_j = dist.all_sum(len(rows_j))
                if n_j == 0:  # no row of any rank trains this term: no step
                    continue
                learner.optimizer.zero_grad(set_to_none=True)
                mbs_j = [mb for mb in rows_j.split(o.micro_batch_size) if len(mb)]
                pad = [torch.zeros(1, dtype=torch.long)] * (int(dist.all_max(len(mbs_j))) - len(mbs_j)
                                                            if dist.lockstep else 0)
                with dist.accumulating():
                    terms(k, mbs_j, 1.0 if weights is None else float(weights[j]), last=True, n_global=n_j, pads=pad)
                optimizer_step()
            continue
        if learner.weighting.per_step:
            _per_step_update(learner, todo, chunk, n_global, mbs, groups, terms, params, stats.plain, measure)
        elif subset is not None:  # term j over the chunk's rows that drew it; each (row, term) pair 1/(N·per_row)
            mine = [[mb for mb in chunk[subset[chunk, j]].split(o.micro_batch_size) if len(mb)]
                    for j in range(len(todo))]
            most = torch.tensor([len(m) for m in mine], dtype=torch.float64)
            most = dist.all_max_tensor(most) if dist.lockstep else most  # one collective for every term's count
            last_j = max((j for j in range(len(todo)) if most[j] > 0), default=-1)
            with dist.accumulating():
                for j, k in enumerate(todo):
                    pad = [torch.zeros(1, dtype=torch.long)] * (int(most[j]) - len(mine[j]) if dist.lockstep else 0)
                    terms(k, mine[j], (1.0 if weights is None else float(weights[j])) / per_row, last=j == last_j,
                          pads=pad)
        else:
            with dist.accumulating():
                for j, k in enumerate(todo):
                    terms(k, mbs, (1.0 if weights is None else float(weights[j])) / len(todo),
                          last=j == len(todo) - 1)
        optimizer_step()
    pol.eval()
    res = stats.reduce(dist)
    res["train/samples_trained"], res["train/steps_trained"] = dist.all_sum(len(rows)), float(len(todo) if steps else 0)
    if subset is not None:
        res["train/steps_per_sample"] = float(per_row)
    if weights is not None:
        res.update({f"train/weight_step{k}": float(w) for k, w in zip(steps, weights)})
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
    raise NonFiniteUpdate(
        f"train: the gradient of optimizer step {learner.opt_steps + 1} is not finite (norm {float(norm)}), so the run "
        f"stopped: {when}, and checkpoints/last.ckpt holds the last finished iteration; lower train.lr, check the "
        "reward (train/nonfinite_rewards) or clip harder (train.max_grad_norm)")


def _grad_vector(params: list) -> Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def _per_step_update(learner: Learner, steps: list[int], chunk: Tensor, n_global: float, mbs: list[Tensor],
                     groups: Tensor | None, terms, params: list, stats: dict, measure: bool) -> None:
    """Each trained step's gradient separately, summed from its parts (whole prompt groups; one group: two halves),
    then combined into the parameters' .grad: ``train.weighting=grad_rms``: ``Σ_k (rms/|g_k|)·g_k / S``;
    ``train.weighting=auto``: ``Σ_k w_k·(rms/|g_k|)·g_k`` with the signal weights w (sum 1) of
    :class:`stepflow.coherence.StepSignal`, to which every step computed adds a measurement from its parts' mean
    gradients (sums over ranks). Steps of weight 0 are computed only when ``measure``. Under DDP the per-step
    gradients are summed over ranks first, so the norms and the combination are those of the global gradients.
    ``n_global``: the chunk's rows on all ranks."""
    from stepflow.coherence import StepSignal, pair_sums
    from stepflow.loss import rms_weights

    gid = groups[chunk] if groups is not None else torch.zeros(len(chunk), dtype=torch.long)
    if len(torch.unique(gid)) < 2:  # one group only: halves by position
        gid = (torch.arange(len(chunk)) >= (len(chunk) + 1) // 2).long()
    part_of = {int(r): int(g) for r, g in zip(chunk, gid)}
    ids = sorted(set(part_of.values()))
    parts = [[mb[torch.tensor([part_of[int(r)] == g for r in mb])] for mb in mbs] for g in ids]
    parts = [[mb for mb in p if len(mb)] for p in parts]
    sizes = [sum(len(mb) for mb in p) for p in parts]
    sig = learner.signal
    if sig is not None:
        w_all = sig.weights()
        todo = [k for k in steps if measure or float(w_all[sig.steps.index(k)]) > 0]
    else:
        todo = list(steps)
    n_params = sum(p.numel() for p in params)
    grads, sums = [], []
    for k in todo:
        vecs = []
        for part in parts:
            for p in params:
                p.grad = None
            terms(k, part, 1.0)
            vecs.append(_grad_vector(params))
        grads.append(sum(vecs) if vecs else torch.zeros(n_params))  # a DDP rank may hold no rows of a chunk
        if sig is not None:  # part means m_i = part_i · n_global / n_i: their pair sums
            m = [v.double() * (n_global / n) for v, n in zip(vecs, sizes)]
            sums.append(pair_sums(torch.stack(m)) if m else torch.zeros(4, dtype=torch.float64))
    if sig is not None and todo:  # one reduction over ranks for every step's sums
        sig.add(todo, [StepSignal.ratio(*row) for row in learner.dist.all_sum_tensor(torch.stack(sums)).tolist()])
    manual = learner.dist.world > 1 and learner.dist.manual_grad_sync
    if manual and grads:  # every rank combines the global per-step gradients (norms of the sum over ranks)
        grads = list(learner.dist.all_sum_tensor(torch.stack(grads)).unbind(0))
    norms = torch.stack([g.norm() for g in grads]).double() if grads else torch.zeros(0)
    coef = rms_weights(norms).double()
    if sig is not None:
        w_all = sig.weights()  # after this measurement
        coef = coef * torch.tensor([float(w_all[sig.steps.index(k)]) for k in todo], dtype=torch.float64)
        stats.setdefault("auto_steps", []).append(torch.tensor(float((coef > 0).sum())))
    else:
        coef = coef / max(1, len(todo))
    total = sum(c * g for c, g in zip(coef.tolist(), grads)) if grads else None
    if manual and total is not None:  # the caller's all_reduce_grads sums the ranks' (identical) combinations
        total = total / learner.dist.world
    off = 0
    for p in params:
        n_p = p.numel()
        p.grad = None if total is None else total[off:off + n_p].view_as(p).to(p.dtype).clone()
        off += n_p


def step_loss(learner: Learner, traj: Trajectory, adv: Tensor, k: int, rows: Tensor, times: Tensor,
              x0_hat: Tensor | None = None) -> dict[str, Tensor]:
    """The loss of term k (the GRPO family: step k) on ``rows`` (a mean over them, key ``loss``) and its detached
    diagnostics: the objective's (:meth:`stepflow.objectives.base.Objective.loss`; docs/method.md §5, §6.3, §11)."""
    return learner.objective.loss(learner, traj, adv, k, rows, times, x0_hat)


def step_gradients(learner: Learner, traj: Trajectory, adv: Tensor, steps: Sequence[int]) -> Tensor:
    """Flattened gradient (of the trained weights) of the GRPO loss of each step in ``steps`` over the whole batch:
    (len(steps), D), the input of :func:`stepflow.coherence.signal_fraction`.

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
