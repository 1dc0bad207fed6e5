"""BranchGRPO's tree rollout (docs/method.md §15.3; Fredreic1849/BranchGRPO@19fbb9f fastvideo/train_branchgrpo_flux.py
``run_tree_sample_step`` L354-542, ``train_one_step_tree`` L947-1647): one tree per prompt, the prompt's group its
leaves. The credit (:class:`stepflow.credits.branchgrpo.BranchGrpo`) says the tree's shape and how its rewards become
advantages; this module grows the trees, scores the leaves and hands the update the tree's edges.

- ``rollout``: every tree grows from its prompt's one initial noise X_0 (``loop.same_latent``). At step k each node
  of depth k is evaluated **once** (one velocity, one NFE; the CFG doubles it as everywhere) and moves one step under
  ``sampler``; at a split point it has ``branches`` children, each with its own noise times
  ``advantage.split_noise_scale`` (the log-prob under the sampler's std, as released), else one child. Shared prefixes
  are evaluated once, so a tree costs ``Σ_{d<T} N_d`` NFEs (the nodes of depths 0..T−1), not L·T. A rank grows only
  the nodes above its own leaves: when a group straddles two ranks both grow the shared prefix (and both count it:
  the NFEs are what the ranks spend). The noise of the edge into node (d+1, c) is row-seeded: ε_{d} of the
  step-noise seed of the node's first leaf row (:func:`stepflow.core.data.seeded_normal`), so a tree does not depend
  on the rank, the batch or a resume; the first leaf's path is the ordinary rollout of its row.
- ``reward``: one call over the leaves' images. The image of a leaf is the x̂0 of its last step's start,
  ``X_{T−1} − τ_{T−1}·v`` (the release decodes ``pred_original`` of the last step, L826-848; with τ_T = 0 it is the
  Euler step's end); that velocity is the rollout's, so the images cost no NFE.
- ``advantage``: :meth:`BranchGrpo.tree_advantages` over every rank's leaves (a tree with a non-finite leaf reward is
  dropped whole).
- ``update``: one **edge row** per trained edge: its owner leaf's path (whose X_k, X_{k+1}, log-prob and velocity at
  step k are the edge's), trained at step k only (the per-row term mask of :func:`stepflow.core.update.update`) with
  the child's advantage. The edges are shuffled and split into ``train.updates_per_iter`` optimizer steps, each the
  mean over its edges (the release: a backward per edge, an optimizer step every ``gradient_accumulation_steps``
  edges, L1481-1596).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stepflow.core.data import IterationPlan, seeded_normal
from stepflow.core.rollout import Scores, Trajectory, _decode
from stepflow.errors import NonFiniteRewardsError
from stepflow.math.advantage import AdvantageOut
from stepflow.math.solvers import x0_from_v
from stepflow.policies.base import encode_rows
from stepflow.rollouts.base import Collected, Credited, RolloutStrategy, TrainBatch, stop_point

__all__ = ["TreeRollout", "grow_trees", "leaf_layout", "leaf_image_latents"]


class TreeRollout(RolloutStrategy):
    """The trees of ``credit`` (a :class:`stepflow.credits.branchgrpo.BranchGrpo`)."""

    name = "tree"
    branched = True
    trains = "trains GRPO on the edges of one rollout tree per prompt (split at advantage.split_points)"
    sde_hint = "sampler=dance_sde (BranchGRPO) or another SDE"

    def __init__(self, credit):
        self.part = credit

    def context(self, learner, it):
        ctx = super().context(learner, it)
        ctx.need = [learner.loop.num_steps]  # the leaves' final images only
        return ctx

    def collect(self, learner, mine, ctx, phases):
        plan = learner.plan.plan(ctx.it)  # the global plan: a tree's leaves may sit on several ranks
        per = len(plan) // learner.dist.world
        rows = torch.arange(len(mine)) + learner.dist.rank * per  # this rank's rows (the plan's contiguous shard)
        if [plan.prompts[i] for i in rows.tolist()] != list(mine.prompts):
            raise RuntimeError("advantage=branchgrpo: this rank's rows are not its shard of the iteration's plan")
        cr = self.part
        with phases("rollout"):  # the trees: every node of depths 0..T-1 evaluated once
            traj = grow_trees(learner.policy, learner.sampler, plan, rows,
                              cr.counts(learner.loop.num_steps), cr.split_noise_scale, ctx.grid, learner.guidance)
        stop_point(learner)
        return Collected(traj, None, None, {})

    def score(self, learner, col, mine, ctx):
        traj, t = col.traj, learner.loop.num_steps
        images = _decode(learner.policy, leaf_image_latents(traj), learner.loop.decode_chunk)
        out = learner.reward(images, list(mine.prompts), list(mine.meta))
        rewards = torch.full((traj.batch_size, t + 1), float("nan"))
        rewards[:, t] = out.scores.float().cpu()
        col.scores = Scores(rewards, {k: v.float().cpu() for k, v in out.components.items()}, images=len(images))
        return col

    def credit(self, learner, col, rewards, plan, ctx):
        t = learner.loop.num_steps
        r = rewards[:, t]
        lp = learner.dist.gather_rows(col.traj.log_probs.float()) if self.part.fusion == "path_prob" else None
        bad = ~torch.isfinite(r)
        dropped = torch.zeros_like(bad)
        for g in torch.unique(plan.group_ids[bad]).tolist():  # a tree with a non-finite leaf: the whole tree
            dropped |= plan.group_ids == g
        if int(dropped.sum()) > learner.loop.max_nonfinite_frac * len(r):
            raise NonFiniteRewardsError(
                f"{int(bad.sum())} of {len(r)} leaves of iteration {ctx.it} have a NaN / inf reward, dropping "
                f"{int(dropped.sum())} leaves with their trees (more than loop.max_nonfinite_frac="
                f"{learner.loop.max_nonfinite_frac}); check the reward")
        adv = torch.zeros(len(r), t, dtype=torch.float32)
        edges = torch.zeros(len(r), t, dtype=torch.bool)
        keep = ~dropped
        stats: dict[str, float] = {}
        if bool(keep.any()):
            adv[keep], edges[keep], stats = self.part.tree_advantages(
                r[keep], plan.group_ids[keep], t, ctx.it, learner.loop.iterations, None if lp is None else lp[keep])
        col.extra["edges"] = edges
        return Credited(AdvantageOut(adv, None, stats), dropped, adv)

    def training_batch(self, learner, col, cred, mine, ctx):
        adv_l = learner.dist.local_rows(cred.train)
        e_l = learner.dist.local_rows(col.extra["edges"]).clone()
        steps = list(ctx.trained)
        off = [k for k in range(e_l.shape[1]) if k not in steps]
        e_l[:, off] = False  # train.train_steps / timestep_fraction: the edges of the trained steps only
        rows, ks = torch.nonzero(e_l, as_tuple=True)  # leaf-major, then step: the release's edge order
        traj = col.traj
        edge = Trajectory(latents=traj.latents[rows], velocities=traj.velocities[rows], log_probs=traj.log_probs[rows],
                          trainable=traj.trainable[rows], times=traj.times, cond=traj.cond.index(rows),
                          prompts=[traj.prompts[i] for i in rows.tolist()], meta=[traj.meta[i] for i in rows.tolist()])
        n = len(rows)
        adv = torch.zeros(n, traj.num_steps, dtype=torch.float32)
        adv[torch.arange(n), ks] = adv_l[rows, ks]
        pos = {k: j for j, k in enumerate(steps)}
        mask = torch.zeros(n, len(steps), dtype=torch.bool)
        if n:
            mask[torch.arange(n), torch.tensor([pos[int(k)] for k in ks])] = True
        w = learner.weighting.weights(learner.sampler, ctx.grid, ctx.trained, None)
        return TrainBatch(edge, adv, None, w, mine.group_ids[rows], False, mask=mask)

    def metrics(self, learner, col, batch, ctx):
        return {"train/branch_rows": float(learner.dist.all_sum(batch.traj.batch_size))}

    def stepwise(self, col):
        return False


def leaf_image_latents(traj: Trajectory) -> Tensor:
    """The latents the leaves are rewarded on (B, C, H, W): the x̂0 of the last step's start, ``X_{T−1} − τ_{T−1}·v``
    (the release's ``pred_original`` of the last step, L826-848), not the SDE sample X_T."""
    t = traj.num_steps
    return x0_from_v(traj.latents[:, t - 1], traj.velocities[:, t - 1], traj.times[t - 1])


def leaf_layout(plan: IterationPlan, rows: Tensor, leaves: int) -> list[tuple[int, list[int], list[int]]]:
    """The trees of ``rows`` (global indices into ``plan``): one per prompt group, in order of first appearance, as
    (the group's first global row, its L global rows in order = leaves 0..L−1, the leaves ``rows`` holds)."""
    gid = plan.group_ids.tolist()
    members: dict[int, list[int]] = {}
    for i, g in enumerate(gid):
        members.setdefault(g, []).append(i)
    out, seen = [], {}
    mine = rows.tolist()
    for i in mine:
        g = gid[i]
        if g not in seen:
            grp = members[g]
            if len(grp) != leaves:
                raise ValueError(f"loop.group_size: advantage=branchgrpo's trees have {leaves} leaves, the group of "
                                 f"{plan.prompts[i]!r} has {len(grp)} rows; set loop.group_size={leaves}")
            seeds = plan.init_noise_seeds[grp]
            if bool((seeds != seeds[0]).any()):
                raise ValueError("loop.same_latent: advantage=branchgrpo grows one tree per prompt from one initial "
                                 "noise; set loop.same_latent=true")
            seen[g] = len(out)
            out.append((grp[0], grp, []))
        out[seen[g]][2].append(out[seen[g]][1].index(i))
    return out


@torch.no_grad()
def grow_trees(policy, sampler, plan: IterationPlan, rows: Tensor, counts: list[int], split_noise_scale: float,
               grid: Tensor, guidance: float = 1.0) -> Trajectory:
    """Grow the trees of the leaf rows ``rows`` (global indices into ``plan``; see the module docstring) on ``grid``
    (T+1,) with node counts ``counts`` (N_0..N_T, :func:`stepflow.credits.branchgrpo.node_counts`). Returns the leaf
    paths of ``rows`` as a :class:`~stepflow.core.rollout.Trajectory` (row i: X_0..X_T of its path, the velocity at
    each of its nodes, the log-prob of each of its edges under the sampler)."""
    dev, t_steps, leaves = policy.device, len(counts) - 1, counts[-1]
    times = grid.to(dev)
    if times.shape != (t_steps + 1,):
        raise ValueError(f"grid: expected shape ({t_steps + 1},), got {tuple(times.shape)}")
    trees = leaf_layout(plan, rows, leaves)
    shape = tuple(policy.latent_shape)
    cond = encode_rows(policy, [plan.prompts[first] for first, _, _ in trees], [plan.meta[first] for first, _, _ in trees])
    need = sorted({g for _, grp, _ in trees for g in grp})  # the noise of every node's first leaf row
    at = {g: j for j, g in enumerate(need)}
    eps = seeded_normal(plan.step_noise_seeds[need], (t_steps, *shape), dev)  # (|need|, T, ...)
    x = seeded_normal(plan.init_noise_seeds[[first for first, _, _ in trees]], shape, dev)
    nodes = [(t, 0) for t in range(len(trees))]  # the active nodes of depth d: (tree, node index)
    index = [{nd: j for j, nd in enumerate(nodes)}]
    states, vels, lps, trn = [x], [], [], []
    for d in range(t_steps):
        tree_of = torch.tensor([t for t, _ in nodes])
        v = policy.velocity(x, times[d], cond.index(tree_of.to(cond.tokens.device)), guidance)
        b = counts[d + 1] // counts[d]
        span = leaves // counts[d + 1]  # leaves under a depth-(d+1) node
        parent, kids, noise = [], [], []
        for p, (t, n) in enumerate(nodes):
            held = trees[t][2]
            for j in range(b):
                c = n * b + j
                if any(c * span <= ell < (c + 1) * span for ell in held):
                    parent.append(p)
                    kids.append((t, c))
                    noise.append(eps[at[trees[t][1][c * span]], d] * (split_noise_scale if b > 1 else 1.0))
        pi = torch.tensor(parent, dtype=torch.long, device=x.device)
        out = sampler.rollout_step(x[pi], v[pi], d, times, noise=torch.stack(noise), x0_prev=None)
        x = out.next
        vels.append(v); states.append(x); lps.append(out.log_prob)
        trn.append(out.trainable.expand(len(kids)) if out.trainable.ndim == 0 else out.trainable)
        nodes = kids
        index.append({nd: j for j, nd in enumerate(nodes)})
    # each row's path: its node at every depth
    where = {}
    for t, (_, grp, _) in enumerate(trees):
        for ell, g in enumerate(grp):
            where[g] = (t, ell)
    path = torch.tensor([[index[d][(where[g][0], where[g][1] // (leaves // counts[d]))] for d in range(t_steps + 1)]
                         for g in rows.tolist()], dtype=torch.long).view(len(rows), t_steps + 1)
    lat = torch.stack([states[d][path[:, d].to(dev)] for d in range(t_steps + 1)], 1)
    vel = torch.stack([vels[d][path[:, d].to(dev)] for d in range(t_steps)], 1)
    lp = torch.stack([lps[d][path[:, d + 1].to(dev)] for d in range(t_steps)], 1)
    tr = torch.stack([trn[d][path[:, d + 1].to(dev)] for d in range(t_steps)], 1)
    tree_rows = torch.tensor([where[g][0] for g in rows.tolist()], dtype=torch.long)
    return Trajectory(latents=lat, velocities=vel, log_probs=lp, trainable=tr, times=times, cond=cond.index(tree_rows.to(cond.tokens.device)),
                      prompts=[plan.prompts[g] for g in rows.tolist()], meta=[plan.meta[g] for g in rows.tolist()])
