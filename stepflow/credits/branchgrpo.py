"""BranchGRPO's credit (arXiv 2509.06040; Fredreic1849/BranchGRPO@19fbb9f fastvideo/train_branchgrpo_flux.py, the
same file as shengjun-zhang/VisualGRPO@ae619bf other_algorithms/branchgrpo_train_grpo_flux.py; docs/method.md §15.3).

One **tree** per prompt grows from one initial noise (``loop.same_latent=true``): every step k moves each node one
SDE step; at the ``split_points`` each node has ``branches`` children instead of one (their noise times
``split_noise_scale``, the log-prob under the sampler's own std). The L = branches^|split_points| leaves are the
prompt's group (``loop.group_size``). Their rewards are **fused upward** (a node's reward: the mean of its leaves, or
the path-probability weighted sum of its children's, ``fusion``), **normalised per depth** within the tree (the
nodes of one depth against each other: the per-step advantages), and every **edge** of the tree (parent at step k →
child at depth k+1) is trained once with its child's advantage, minus the edges that **depth / width pruning**
removes. The tree itself is :class:`stepflow.rollouts.tree.TreeRollout`.

Layout. A tree's nodes at depth d are numbered ``n = 0..N_d−1`` (``N_0 = 1``, ``N_{d+1} = N_d·b_d``, ``b_k`` the
factor of step k: ``branches`` at a split point, else 1); child j of node n at step k is node ``n·b_k + j`` (the
release's order: ``for node in current_nodes: for split_idx in range(num_splits)``, L402-421). Leaf ℓ lies under node
``ℓ // s_d`` of depth d, ``s_d = L / N_d``. Every per-tree quantity is stored per **leaf path**: (L, T) tables whose
entry (ℓ, k) is the edge into the depth-(k+1) node of leaf ℓ's path; the edge is *owned* by the first leaf of its
subtree (``ℓ % s_{k+1} == 0``), so each edge appears once (on the rank that holds its owner; the release's
``collect_all_transitions`` visits each edge once, L1199-1222, and in the same order: leaf-major, then step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from stepflow.credits.base import Credit

__all__ = ["BranchGrpo", "tree_factors", "node_counts", "fuse_rewards", "depth_advantages", "path_table",
           "owned_edges", "active_pruning_depths", "prune_width", "FUSIONS"]

FUSIONS = ("mean", "path_prob")


# ----------------------------------------------------------------------------------------------------------------
# the tree's shape
# ----------------------------------------------------------------------------------------------------------------
def tree_factors(split_points: Sequence[int], branches: int, num_steps: int) -> list[int]:
    """``b_k`` for k = 0..T−1: ``branches`` at a split point, else 1 (``num_splits = 2 if should_split else 1``,
    L398-399, with ``branches`` = the release's hard-coded 2)."""
    splits = set(int(p) for p in split_points)
    return [branches if k in splits else 1 for k in range(num_steps)]


def node_counts(factors: Sequence[int]) -> list[int]:
    """``N_d`` for d = 0..T: the nodes at depth d (``N_T`` = L, the leaves)."""
    out = [1]
    for b in factors:
        out.append(out[-1] * int(b))
    return out


def path_table(per_depth: Sequence[Tensor], counts: Sequence[int]) -> Tensor:
    """Per-depth node values (``per_depth[d]``: (N_d,), d = 0..T) -> the leaf-path table (L, T): entry (ℓ, k) is the
    value of the depth-(k+1) node of leaf ℓ's path (the edge into it)."""
    leaves, t_steps = counts[-1], len(counts) - 1
    cols = [per_depth[k + 1].repeat_interleave(leaves // counts[k + 1]) for k in range(t_steps)]
    return torch.stack(cols, 1) if cols else torch.zeros(leaves, 0)


def owned_edges(counts: Sequence[int]) -> Tensor:
    """(L, T) bool: leaf ℓ owns the edge into its depth-(k+1) node when it is that node's first leaf."""
    leaves, t_steps = counts[-1], len(counts) - 1
    ell = torch.arange(leaves)
    cols = [ell % (leaves // counts[k + 1]) == 0 for k in range(t_steps)]
    return torch.stack(cols, 1) if cols else torch.zeros(leaves, 0, dtype=torch.bool)


# ----------------------------------------------------------------------------------------------------------------
# the credit's math (one tree; float64)
# ----------------------------------------------------------------------------------------------------------------
def fuse_rewards(leaf_rewards: Tensor, counts: Sequence[int], fusion: str = "mean", edge_log_probs: Tensor | None = None,
                 temperature: float = 1.0) -> list[Tensor]:
    """Every node's reward from the leaves' (``compute_node_rewards_from_leaves``, L545-652), per depth
    (``out[d]``: (N_d,), float64, ``out[T]`` the leaves').

    ``mean`` (the released script: ``TREE_PROB_WEIGHTED="false"``): the mean reward of the node's leaf descendants
    (L640-646). ``path_prob`` (``--tree_prob_weighted``): bottom-up, a node with one child takes its reward (L613-615),
    a node with several the softmax over its children's edge log-probs (× ``temperature``, the release's ``alpha =
    1.0``) weighting their rewards (L617-637). edge_log_probs: (L, T) the log-prob of the edge into each leaf's
    depth-(k+1) node (needed by ``path_prob``)."""
    r = leaf_rewards.detach().to(torch.float64).flatten()
    leaves, t_steps = counts[-1], len(counts) - 1
    if r.numel() != leaves:
        raise ValueError(f"leaf_rewards: expected {leaves} leaves, got {r.numel()}")
    if fusion == "mean":
        return [r.view(counts[d], leaves // counts[d]).mean(1) for d in range(t_steps + 1)]
    if fusion != "path_prob":
        raise ValueError(f"fusion: must be one of {FUSIONS}, got {fusion!r}")
    if edge_log_probs is None or tuple(edge_log_probs.shape) != (leaves, t_steps):
        raise ValueError(f"edge_log_probs: path_prob fusion needs the (L, T) = ({leaves}, {t_steps}) edge log-probs")
    lp = edge_log_probs.detach().to(torch.float64)
    out: list[Tensor] = [r.new_zeros(0)] * (t_steps + 1)
    out[t_steps] = r
    for d in reversed(range(t_steps)):
        b = counts[d + 1] // counts[d]
        child = out[d + 1].view(counts[d], b)
        if b == 1:
            out[d] = child[:, 0].clone()
            continue
        span = leaves // counts[d + 1]
        child_lp = lp[::span, d].view(counts[d], b)  # the edge into child c: any leaf of c's subtree; its first
        out[d] = (torch.softmax(temperature * child_lp, dim=1) * child).sum(1)
    return out


def depth_advantages(node_rewards: Sequence[Tensor], eps: float = 1e-8, min_std: float = 1e-6,
                     unbiased: bool = True) -> list[Tensor]:
    """``compute_hierarchical_advantages_by_depth`` (L655-688): the nodes of one depth normalised against each other,
    ``(R − mean)/(std + eps)`` with torch's std (unbiased by default, ``rewards.std()``); 0 for a depth with one
    node, and for a depth whose std is below ``min_std`` (the release's ``std_reward < 1e-6``)."""
    out = []
    for r in node_rewards:
        if r.numel() <= 1:
            out.append(torch.zeros_like(r))
            continue
        std = r.std(unbiased=unbiased)
        out.append(torch.zeros_like(r) if float(std) < min_std else (r - r.mean()) / (std + eps))
    return out


def active_pruning_depths(depths: Sequence[int], it: int, slide: bool = False, interval: int = 1,
                          stop_depth: int | None = None, split_points: Sequence[int] = ()) -> list[int]:
    """The depths whose edges (by the child's depth) depth pruning leaves out at iteration ``it`` (0-based; the
    release's ``current_step = it + 1``), L1275-1318: ``depths`` sorted; with ``slide`` shifted up by
    ``min((it + 1) // interval, max(0, depths[0] − stop))``, ``stop`` = ``stop_depth`` or the last split point."""
    base = sorted(int(d) for d in depths)
    if not base or not slide:
        return base
    stop = (max(split_points) if split_points else 0) if stop_depth is None else int(stop_depth)
    shift = min(max(0, (it + 1) // max(1, int(interval))), max(0, base[0] - stop))
    return [d - shift for d in base]


def prune_width(edges: Tensor, adv: Tensor, counts: Sequence[int], last_split: int, mode: int,
                ratio: float = 0.5) -> Tensor:
    """Width pruning (L1322-1466) of one tree's edges ``edges`` (L, T) bool (owned, after depth pruning), by their
    unclipped advantages ``adv`` (L, T). It looks at the edges whose parent step k is after the last split
    (``sample["step"] > last_split_step``), in the release's order (leaf-major, then step) and sorts them by
    advantage, descending and stable (``sorted(..., reverse=True)`` keeps equal ones in order):

    - mode 1: per branch of the last split (the depth-(last+1) node above the edge), keep the first
      ``max(1, int(n·ratio))``. After the last split a branch is one chain of equal advantages, so this keeps the
      chain's first steps;
    - mode 2: over the tree's such edges, keep the ``keep // 2`` best and the ``keep − keep // 2`` worst,
      ``keep = max(2, int(n·ratio))``.

    Returns the kept edges (L, T) bool (the edges up to the last split untouched)."""
    if mode == 0:
        return edges
    leaves, t_steps = edges.shape
    span = leaves // counts[last_split + 1]
    cand = [(ell, k) for ell in range(leaves) for k in range(last_split + 1, t_steps) if bool(edges[ell, k])]
    keep = edges.clone()
    keep[:, last_split + 1:] = False
    groups: dict[int, list[tuple[int, int]]] = {}
    if mode == 1:
        for e in cand:
            groups.setdefault(e[0] // span, []).append(e)
    else:
        groups[0] = cand
    for group in groups.values():
        order = sorted(group, key=lambda e: float(adv[e[0], e[1]]), reverse=True)
        if mode == 1:
            kept = order[:max(1, int(len(order) * ratio))]
        else:
            n_keep = max(2, int(len(order) * ratio))
            best = n_keep // 2
            kept = order[:best] + (order[-(n_keep - best):] if n_keep - best > 0 else [])
        for ell, k in kept:
            keep[ell, k] = True
    return keep


# ----------------------------------------------------------------------------------------------------------------
# the part
# ----------------------------------------------------------------------------------------------------------------
def _int_list(name: str, v, lo: int = 0) -> list[int]:
    vals = list(v) if isinstance(v, (list, tuple)) else None
    if vals is None or any(not isinstance(x, int) or isinstance(x, bool) or x < lo for x in vals) or len(set(vals)) < len(vals):
        raise ValueError(f"{name}: must be a list of distinct integers >= {lo}, got {v!r}")
    return sorted(vals)


class BranchGrpo(Credit):
    """BranchGRPO's tree credit. Fields (released values in brackets; the module docstring says what each does):

    - ``split_points`` [0, 3, 6, 9 of 20 steps]: the steps at which every node splits; ``branches`` [2] children each;
    - ``split_noise_scale`` [4.0 in the script; argparse's default 0.3]: the split steps' noise is ``scale·ε``, their
      log-prob the sampler's (``flux_step_with_split`` L262-274);
    - ``fusion`` mean [the script] | path_prob [``--tree_prob_weighted``], ``temperature`` [1.0] of path_prob;
    - ``eps`` [1e-8], ``unbiased_std`` [true], ``min_std`` [1e-6]: the per-depth normalisation; ``adv_clip`` [5];
    - ``depth_pruning`` [empty: off] the child depths whose edges are not trained, ``depth_pruning_slide`` [true],
      ``depth_pruning_slide_interval`` [30], ``depth_pruning_stop_depth`` [9]: its sliding window (iterations);
    - ``width_pruning`` [0] 0 | 1 | 2, ``width_pruning_ratio`` [0.5];
    - ``pruning_step_ratio`` [1.0]: pruning applies while ``it + 1 <= int(loop.iterations·ratio)``.
    """

    name = "branchgrpo"
    needs_stepwise_rewards = False  #: only the leaves' final images are scored

    def __init__(self, split_points: Sequence[int] = (0, 1, 3, 4), branches: int = 2, split_noise_scale: float = 4.0,
                 fusion: str = "mean", temperature: float = 1.0, min_std: float = 1e-6,
                 depth_pruning: Sequence[int] = (), depth_pruning_slide: bool = False,
                 depth_pruning_slide_interval: int = 1, depth_pruning_stop_depth: int | None = None,
                 width_pruning: int = 0, width_pruning_ratio: float = 0.5, pruning_step_ratio: float = 1.0,
                 eps: float = 1e-8, unbiased_std: bool = True, **common):
        super().__init__(eps=eps, unbiased_std=unbiased_std, **common)
        if self.std_scope != "group":
            raise ValueError("std_scope: branchgrpo normalises each depth within its own tree; set "
                             "advantage.std_scope=group")
        if self.completes_states:
            raise ValueError("reward_source: branchgrpo scores its leaves' final images only; leave "
                             "advantage.reward_source=tweedie (its default)")
        self.split_points = _int_list("split_points", split_points)
        if not (isinstance(branches, int) and not isinstance(branches, bool) and branches >= 2):
            raise ValueError(f"branches: must be an integer >= 2 (children per split), got {branches!r}")
        self.branches = branches
        for name, v, lo in (("split_noise_scale", split_noise_scale, 0.0), ("temperature", temperature, 0.0),
                            ("min_std", min_std, 0.0)):
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= lo):
                raise ValueError(f"{name}: must be a finite float >= {lo:g}, got {v!r}")
        if split_noise_scale <= 0:
            raise ValueError(f"split_noise_scale: must be > 0, got {split_noise_scale!r}")
        self.split_noise_scale, self.temperature, self.min_std = float(split_noise_scale), float(temperature), float(min_std)
        if fusion not in FUSIONS:
            raise ValueError(f"fusion: must be one of {FUSIONS}, got {fusion!r}")
        self.fusion = fusion
        self.depth_pruning = _int_list("depth_pruning", depth_pruning, lo=1)
        if not isinstance(depth_pruning_slide, bool):
            raise ValueError(f"depth_pruning_slide: must be a bool, got {depth_pruning_slide!r}")
        if not (isinstance(depth_pruning_slide_interval, int) and not isinstance(depth_pruning_slide_interval, bool)
                and depth_pruning_slide_interval >= 1):
            raise ValueError(f"depth_pruning_slide_interval: must be an integer >= 1, got {depth_pruning_slide_interval!r}")
        if depth_pruning_stop_depth is not None and not (isinstance(depth_pruning_stop_depth, int)
                                                         and not isinstance(depth_pruning_stop_depth, bool)
                                                         and depth_pruning_stop_depth >= 0):
            raise ValueError(f"depth_pruning_stop_depth: must be null or an integer >= 0, got {depth_pruning_stop_depth!r}")
        self.depth_pruning_slide, self.depth_pruning_slide_interval = depth_pruning_slide, depth_pruning_slide_interval
        self.depth_pruning_stop_depth = depth_pruning_stop_depth
        if width_pruning not in (0, 1, 2) or isinstance(width_pruning, bool):
            raise ValueError(f"width_pruning: must be 0 (off), 1 (per last-split branch) or 2 (best and worst), got "
                             f"{width_pruning!r}")
        if width_pruning and not self.split_points:
            raise ValueError("width_pruning: prunes the edges after the last split, but advantage.split_points is "
                             "empty; give split points or set advantage.width_pruning=0")
        self.width_pruning = width_pruning
        for name, v in (("width_pruning_ratio", width_pruning_ratio), ("pruning_step_ratio", pruning_step_ratio)):
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0):
                raise ValueError(f"{name}: must be a float in [0, 1], got {v!r}")
        self.width_pruning_ratio, self.pruning_step_ratio = float(width_pruning_ratio), float(pruning_step_ratio)

    # ------------------------------------------------------------------ what the iteration asks
    def rollout_strategy(self):
        from stepflow.rollouts.tree import TreeRollout

        return TreeRollout(self)

    def states_needed(self, trained, num_steps):
        return [num_steps]

    def advantages(self, rewards, group_ids, num_steps, trained):
        raise ValueError("advantage=branchgrpo: its advantages come from its rollout trees (tree_advantages), not from "
                         "one rollout's rewards")

    def leaves(self) -> int:
        """L, the leaves of a tree (= the group)."""
        return self.branches ** len(self.split_points)

    def counts(self, num_steps: int) -> list[int]:
        return node_counts(tree_factors(self.split_points, self.branches, num_steps))

    def requirements(self, s) -> list[str]:
        """The settings a tree needs (one line each, the field and the fix)."""
        out = []
        t = s.loop.num_steps
        same = s.loop.same_latent if getattr(s.objective, "same_latent", None) is None else s.objective.same_latent
        if not same:
            out.append("loop.same_latent: advantage=branchgrpo grows one tree per prompt from one initial noise, whose "
                       "leaves are the prompt's group; set loop.same_latent=true")
        outside = [p for p in self.split_points if p >= t]
        if outside:
            out.append(f"advantage.split_points: step {outside[0]} is outside 0..{t - 1} (loop.num_steps={t}); "
                       "give split points on the grid")
        elif s.loop.group_size != self.leaves():
            out.append(f"loop.group_size: advantage=branchgrpo's trees have {self.branches}^{len(self.split_points)} = "
                       f"{self.leaves()} leaves (advantage.split_points={self.split_points}, advantage.branches="
                       f"{self.branches}), the group of each prompt; set loop.group_size={self.leaves()}")
        deep = [d for d in self.depth_pruning if d > t]
        if deep:
            out.append(f"advantage.depth_pruning: depth {deep[0]} is outside 1..{t} (a child's depth is its step + 1, "
                       f"loop.num_steps={t}); give depths on the grid")
        return out

    # ------------------------------------------------------------------ the advantages
    def should_prune(self, it: int, iterations: int) -> bool:
        """``current_step <= int(max_steps·pruning_step_ratio)`` (L1265-1271), ``current_step = it + 1``."""
        return it + 1 <= int(iterations * self.pruning_step_ratio)

    def tree_advantages(self, rewards: Tensor, group_ids: Tensor, num_steps: int, it: int = 0, iterations: int = 1,
                        log_probs: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, float]]:
        """Every tree's advantages and trained edges, over every rank's leaf rows.

        rewards: (B,) the leaves' rewards, rows grouped by prompt (``group_ids`` (B,)), leaf ℓ of a tree the ℓ-th row of
        its group; log_probs: (B, T) each leaf path's edge log-probs (``fusion=path_prob``). Returns the leaf-path
        advantages (B, T) float32 clipped to ±``adv_clip`` (entry (ℓ, k): the depth-(k+1) node's), the edges to train
        (B, T) bool (owned, not pruned), and stats."""
        b = rewards.shape[0]
        counts = self.counts(num_steps)
        leaves = counts[-1]
        adv = torch.zeros(b, num_steps, dtype=torch.float32)
        edges = torch.zeros(b, num_steps, dtype=torch.bool)
        own = owned_edges(counts)
        prune = self.should_prune(it, iterations)
        depths = set(active_pruning_depths(self.depth_pruning, it, self.depth_pruning_slide,
                                           self.depth_pruning_slide_interval, self.depth_pruning_stop_depth,
                                           self.split_points)) if prune else set()
        depth_cut = torch.tensor([k + 1 not in depths for k in range(num_steps)])
        own_rows = torch.zeros(b, num_steps, dtype=torch.bool)
        clipped, trees = 0, 0
        for g in torch.unique(group_ids, sorted=False).tolist():
            rows = torch.nonzero(group_ids == g).flatten()
            if len(rows) != leaves:
                raise ValueError(f"loop.group_size: a tree has {leaves} leaves, group {g} has {len(rows)} rows; set "
                                 f"loop.group_size={leaves}")
            lp = None if log_probs is None else log_probs[rows]
            fused = fuse_rewards(rewards[rows], counts, self.fusion, lp, self.temperature)
            raw = path_table(depth_advantages(fused, self.eps, self.min_std, self.unbiased_std), counts)
            e = own & depth_cut
            if prune and self.width_pruning:
                e = prune_width(e, raw, counts, max(self.split_points), self.width_pruning, self.width_pruning_ratio)
            adv[rows] = raw.clamp(-self.adv_clip, self.adv_clip).float()
            edges[rows], own_rows[rows] = e, own
            clipped += int((raw[own].abs() > self.adv_clip).sum())
            trees += 1
        n_own = int(own_rows.sum())
        stats = {"adv_clip_frac": clipped / max(1, n_own), "num_groups": float(trees),
                 "tree_edges": float(n_own), "tree_edges_trained": float(edges.sum()),
                 "zero_rows": float((adv == 0).all(1).sum())}
        absm = (adv.abs().double() * own_rows).sum(0) / own_rows.sum(0).clamp(min=1)
        for k in range(num_steps):  # each edge once: the mean |A| of the edges into depth k + 1
            stats[f"adv_abs_mean_step{k}"] = float(absm[k])
        return adv, edges, stats
