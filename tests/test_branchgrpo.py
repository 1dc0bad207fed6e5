"""BranchGRPO (advantage=branchgrpo: stepflow.credits.branchgrpo, stepflow.rollouts.tree; docs/method.md §15.3).

Every formula is checked against an inline transcription of the released lines (plain torch / Python, written from
the reference, never calling stepflow's functions), on small hand-made trees:

- Fredreic1849/BranchGRPO@19fbb9fc92ad1857212f3b664d6e9ff80c8b3804 fastvideo/train_branchgrpo_flux.py (``REF``; the
  identical copy is shengjun-zhang/VisualGRPO@ae619bff847b2559f7db998da8f635ca1cb7ce4e
  other_algorithms/branchgrpo_train_grpo_flux.py).

Then the tree's NFEs (the rollout's, the update's, CFG), the refusals, the recipe, LoRA / full fine-tuning, resume.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from stepflow.credits.branchgrpo import (
    BranchGrpo,
    active_pruning_depths,
    depth_advantages,
    fuse_rewards,
    node_counts,
    owned_edges,
    path_table,
    prune_width,
    tree_factors,
)
from stepflow.testing.harness import compose_config, last_train_metrics, one_line_error, smoke_config

REF = "Fredreic1849/BranchGRPO@19fbb9f fastvideo/train_branchgrpo_flux.py"


# ================================================================ the released lines, transcribed
class RefNode:
    """``TreeNode`` (REF L183-222)."""

    def __init__(self, node_id, latent, parent=None, step=0):
        self.node_id, self.latent, self.parent, self.children, self.step = node_id, latent, parent, [], step
        self.log_prob = self.reward = self.advantage = None
        self.depth = 0 if parent is None else parent.depth + 1

    def add_child(self, child):
        self.children.append(child)
        child.depth = self.depth + 1

    def is_leaf(self):
        return len(self.children) == 0

    def get_path_from_root(self):
        path, cur = [], self
        while cur is not None:
            path.append(cur)
            cur = cur.parent
        return list(reversed(path))

    def get_all_leaf_descendants(self):
        if self.is_leaf():
            return [self]
        out = []
        for c in self.children:
            out.extend(c.get_all_leaf_descendants())
        return out


def ref_flux_step_with_split(model_output, latents, eta, sigmas, index, num_splits, split_noise_scale, noises):
    """``flux_step_with_split`` (REF L229-311) with grpo=True, sde_solver=True, prev_sample=None; ``noises``: the
    ``torch.randn_like`` draws, one per split (the release's global RNG)."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    std_dev_t = torch.clamp(torch.as_tensor(std_dev_t, dtype=torch.float32), min=1e-8)
    score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma ** 2
    log_term = -0.5 * eta ** 2 * score_estimate
    prev_sample_mean = prev_sample_mean + log_term * dsigma
    two_pi = torch.as_tensor(2 * math.pi, dtype=torch.float32)
    if num_splits > 1:
        samples, lps = [], []
        for i in range(num_splits):
            noise = noises[i] * split_noise_scale
            sample = prev_sample_mean + noise * std_dev_t
            samples.append(sample)
            lp = (-((sample.detach().float() - prev_sample_mean.float()) ** 2) / (2 * (std_dev_t ** 2))
                  - torch.log(std_dev_t) - 0.5 * torch.log(two_pi))
            lps.append(lp.mean(dim=tuple(range(1, lp.ndim))))
        return torch.cat(samples, 0), pred_original_sample.repeat(num_splits, 1, 1, 1), torch.cat(lps, 0)
    prev_sample = prev_sample_mean + noises[0] * std_dev_t
    lp = (-((prev_sample.detach().float() - prev_sample_mean.float()) ** 2) / (2 * (std_dev_t ** 2))
          - torch.log(std_dev_t) - 0.5 * torch.log(two_pi))
    return prev_sample, pred_original_sample, lp.mean(dim=tuple(range(1, lp.ndim)))


def ref_tree_rollout(vfn, z, sigma_schedule, split_points, eta, scale, noise_of):
    """``run_tree_sample_step`` (REF L354-542), one tree (batch 1), mix_ode_sde_tree off: every node evaluated once
    per step (``vfn``, counted), split at ``split_points`` into 2. ``noise_of(i, position)``: the noise of the child
    created at step i in position ``position`` of ``new_nodes``. Returns (leaves, pred_original of the last step,
    velocity calls)."""
    total_steps = len(sigma_schedule) - 1
    root = RefNode("root_b0", z)
    current_nodes, calls, final_pred_originals = [root], 0, None
    for i in range(total_steps):
        new_nodes, step_pred_originals = [], []
        should_split = i in split_points
        num_splits = 2 if should_split else 1
        for node in current_nodes:
            pred = vfn(node.latent, sigma_schedule[i])
            calls += 1
            noises = [noise_of(i, len(new_nodes) + j) for j in range(num_splits)]
            nxt, pred_orig, lps = ref_flux_step_with_split(pred, node.latent.float(), eta, sigma_schedule, i,
                                                           num_splits, scale, noises)
            if should_split:
                for split_idx in range(num_splits):
                    child = RefNode(f"{node.node_id}_s{i}_{split_idx}", nxt[split_idx:split_idx + 1], node, i + 1)
                    child.log_prob = lps[split_idx:split_idx + 1]
                    node.add_child(child)
                    new_nodes.append(child)
                    step_pred_originals.append(pred_orig[split_idx:split_idx + 1])
            else:
                child = RefNode(f"{node.node_id}_t{i}", nxt[0:1], node, i + 1)
                child.log_prob = lps[0:1]
                node.add_child(child)
                new_nodes.append(child)
                step_pred_originals.append(pred_orig)
        current_nodes = new_nodes
        final_pred_originals = torch.cat(step_pred_originals, 0)
    return root, current_nodes, final_pred_originals, calls


def ref_node_rewards(root, leaf_rewards, leaf_nodes, use_prob_weighted=False):
    """``compute_node_rewards_from_leaves`` (REF L545-652), the statistics printing left out."""
    for i, leaf in enumerate(leaf_nodes):
        leaf.reward = leaf_rewards[i]
    all_nodes = []

    def collect(node):
        all_nodes.append(node)
        for c in node.children:
            collect(c)
    collect(root)
    max_depth = max(n.depth for n in all_nodes)
    by_depth = {d: [] for d in range(max_depth + 1)}
    for n in all_nodes:
        by_depth[n.depth].append(n)
    if use_prob_weighted:
        alpha = 1.0
        for depth in reversed(range(max_depth)):
            for node in by_depth[depth]:
                if not node.is_leaf():
                    children = node.children
                    if len(children) == 1:
                        node.reward = children[0].reward
                    else:
                        lps = torch.stack([c.log_prob.squeeze().to(torch.float32) for c in children])
                        weights = torch.softmax(alpha * lps, dim=0)
                        rs = torch.stack([c.reward.to(torch.float32) for c in children])
                        node.reward = torch.sum(weights * rs)
    else:
        for depth in reversed(range(max_depth)):
            for node in by_depth[depth]:
                if not node.is_leaf():
                    node.reward = torch.stack([leaf.reward for leaf in node.get_all_leaf_descendants()]).mean()
    return all_nodes, by_depth


def ref_depth_advantages(by_depth):
    """``compute_hierarchical_advantages_by_depth`` (REF L655-688)."""
    adv = {}
    for _, nodes in by_depth.items():
        if len(nodes) <= 1:
            for n in nodes:
                n.advantage = torch.tensor(0.0)
                adv[n.node_id] = n.advantage
        else:
            rewards = torch.stack([n.reward for n in nodes])
            mean, std = rewards.mean(), rewards.std()
            a = torch.zeros_like(rewards) if std < 1e-6 else (rewards - mean) / (std + 1e-8)
            for i, n in enumerate(nodes):
                n.advantage = a[i]
                adv[n.node_id] = n.advantage
    return adv


def ref_transitions(root, node_advantages):
    """``collect_all_transitions`` (REF L1199-1222): every edge once, depth-first."""
    out = []

    def collect(node):
        for child in node.children:
            out.append({"step": node.step, "parent_id": node.node_id, "child_id": child.node_id,
                        "child_depth": child.depth, "advantage": node_advantages[child.node_id],
                        "log_prob": child.log_prob})
            collect(child)
    collect(root)
    return out


def ref_depth_pruning(samples, depth_pruning, slide, interval, stop_depth, split_points, current_step):
    """REF L1275-1318 (``should_prune`` true)."""
    base = sorted(int(d) for d in depth_pruning.split(",") if d.strip())
    active = base
    if slide:
        stop = max(split_points) if split_points else 0
        if stop_depth is not None:
            stop = stop_depth
        shift = max(0, int(current_step // max(1, interval)))
        shift = min(shift, max(0, base[0] - stop))
        active = [d - shift for d in base]
    return [s for s in samples if s["child_depth"] not in set(active)]


def ref_width_pruning(samples, all_nodes, split_points, mode, ratio=0.5):
    """REF L1322-1466 (``should_prune`` true)."""
    last_split_step = max(split_points)
    last, other = [], []
    for s in samples:
        (last if s["step"] > last_split_step else other).append(s)
    nodes = {n.node_id: n for n in all_nodes}
    if mode == 1:
        def branch_of(sample):
            cur, target = sample["parent_id"], last_split_step + 1
            if sample["step"] == target:
                return cur
            while cur in nodes:
                node = nodes[cur]
                if node.step == target:
                    return cur
                if node.parent is not None:
                    cur = node.parent.node_id
                else:
                    break
            return f"unknown_{cur}"
        groups = {}
        for s in last:
            groups.setdefault(branch_of(s), []).append(s)
        kept = []
        for group in groups.values():
            keep = max(1, int(len(group) * ratio))
            kept.extend(sorted(group, key=lambda x: x["advantage"].item(), reverse=True)[:keep])
        return other + kept
    srt = sorted(last, key=lambda x: x["advantage"].item(), reverse=True)
    keep = max(2, int(len(srt) * ratio))
    best = keep // 2
    worst = keep - best
    return other + srt[:best] + (srt[-worst:] if worst > 0 else [])


# ================================================================ helpers
def _synthetic_tree(split_points, num_steps, leaf_rewards, seed=0):
    """A reference tree of the given shape (latents unused) with random edge log-probs; its leaves."""
    g = torch.Generator().manual_seed(seed)
    root = RefNode("root_b0", None)
    cur = [root]
    for i in range(num_steps):
        new = []
        for node in cur:
            for j in range(2 if i in split_points else 1):
                child = RefNode(f"{node.node_id}_{i}_{j}", None, node, i + 1)
                child.log_prob = torch.randn(1, generator=g) * 3
                node.add_child(child)
                new.append(child)
        cur = new
    return root, cur


def _our_log_probs(leaves, counts):
    """The (L, T) edge log-prob table of a reference tree's leaves (entry (ℓ, k): the edge into leaf ℓ's depth-k+1
    node, read off the leaf's path)."""
    return torch.stack([torch.cat([n.log_prob for n in leaf.get_path_from_root()[1:]]) for leaf in leaves])


def _edge_key(sample, leaves):
    """A reference transition as our (owner leaf, step): the first leaf under its child, the parent's step."""
    for ell, leaf in enumerate(leaves):
        if any(n.node_id == sample["child_id"] for n in leaf.get_path_from_root()):
            return ell, sample["step"]
    raise AssertionError(sample)


SHAPES = [([0, 2], 4), ([0, 1, 3], 5), ([1, 2], 4), ([], 3)]


# ================================================================ the tree's shape
def test_shape_by_hand():
    f = tree_factors([0, 1, 3, 4], 2, 10)
    assert f == [2, 2, 1, 2, 2, 1, 1, 1, 1, 1]
    n = node_counts(f)
    assert n == [1, 2, 4, 4, 8, 16, 16, 16, 16, 16, 16]
    assert sum(n[:-1]) == 99 and sum(n[1:]) == 114  # the recipe's NFEs and edges per tree
    # the released 20-step tree (split points 0, 3, 6, 9): 203 node evaluations, 218 edges (13.6 per leaf)
    r = node_counts(tree_factors([0, 3, 6, 9], 2, 20))
    assert sum(r[:-1]) == 203 and sum(r[1:]) == 218
    own = owned_edges(node_counts(tree_factors([0, 2], 2, 4)))  # leaves 0..3; N = 1, 2, 2, 4, 4
    assert own.tolist() == [[True] * 4, [False, False, True, True], [True, True, True, True], [False, False, True, True]]


# ================================================================ the rollout against REF L229-542
@pytest.mark.parametrize("split_points,num_steps", [([0, 2], 4), ([1], 3)])
def test_tree_rollout_matches_the_released_lines(tmp_path, split_points, num_steps):
    """grow_trees on a tiny policy == run_tree_sample_step transcribed (each node one velocity call; split-step noise
    × split_noise_scale, the log-prob under the unscaled std; leaves in the release's order), the Dance-SDE, and the
    leaf image = the last step's pred_original; the NFEs are the node count."""
    from stepflow.core.data import seeded_normal
    from stepflow.core.rollout import sampling_grid
    from stepflow.rollouts.tree import grow_trees, leaf_image_latents
    from stepflow.samplers.dance_sde import DanceSde
    from stepflow.train import build_module

    leaves = 2 ** len(split_points)
    m = build_module(smoke_config(f"loop.num_steps={num_steps}", f"loop.group_size={leaves}", "advantage=branchgrpo",
                                  f"advantage.split_points={split_points}", "sampler=dance_sde",
                                  "train.train_steps=null"), tmp_path)
    pol, plan = m.learner.policy, m.learner.plan.plan(0)
    grid = sampling_grid(pol, num_steps, "fastvideo")
    sampler, scale = DanceSde(eta=0.3), 4.0
    counts = node_counts(tree_factors(split_points, 2, num_steps))
    n0 = pol.nfe
    traj = grow_trees(pol, sampler, plan, torch.arange(leaves), counts, scale, grid)  # the first tree
    assert pol.nfe - n0 == sum(counts[:-1])
    cond = pol.encode([plan.prompts[0]])
    eps = seeded_normal(plan.step_noise_seeds[:leaves], (num_steps, *pol.latent_shape))

    def noise_of(i, pos):  # the child at position pos of step i: node (i+1, pos), seeded by its first leaf row
        return eps[pos * (leaves // counts[i + 1]), i][None]

    z = seeded_normal(plan.init_noise_seeds[:1], tuple(pol.latent_shape))
    with torch.no_grad():
        _, ref_leaves, pred_orig, calls = ref_tree_rollout(lambda x, s: pol.velocity(x, s, cond), z, grid.tolist(),
                                                           split_points, 0.3, scale, noise_of)
    assert calls == sum(counts[:-1])
    torch.testing.assert_close(traj.latents[:, -1], torch.cat([n.latent for n in ref_leaves]), atol=1e-5, rtol=1e-5)
    ref_lp = torch.stack([torch.cat([n.log_prob for n in leaf.get_path_from_root()[1:]]) for leaf in ref_leaves])
    torch.testing.assert_close(traj.log_probs, ref_lp, atol=1e-4, rtol=1e-5)
    ref_states = torch.stack([torch.cat([n.latent for n in leaf.get_path_from_root()]) for leaf in ref_leaves])
    torch.testing.assert_close(traj.latents, ref_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(leaf_image_latents(traj), pred_orig, atol=1e-5, rtol=1e-5)  # what score() decodes


# ================================================================ the credit against REF L545-688, L1199-1222
@pytest.mark.parametrize("split_points,num_steps", SHAPES)
@pytest.mark.parametrize("fusion", ["mean", "path_prob"])
def test_tree_advantages_match_the_released_lines(split_points, num_steps, fusion):
    """Fused node rewards, per-depth advantages and the edges (each once, with its child's advantage, in the
    release's depth-first order) == compute_node_rewards_from_leaves + compute_hierarchical_advantages_by_depth +
    collect_all_transitions transcribed."""
    leaves = 2 ** len(split_points)
    r = torch.tensor([0.2, 0.9, 0.4, 0.4, 0.7, 0.1, 0.3, 0.8][:leaves], dtype=torch.float32)
    root, ref_leaves = _synthetic_tree(split_points, num_steps, r)
    all_nodes, by_depth = ref_node_rewards(root, r, ref_leaves, fusion == "path_prob")
    ref_adv = ref_depth_advantages(by_depth)
    samples = ref_transitions(root, ref_adv)
    counts = node_counts(tree_factors(split_points, 2, num_steps))
    lp = _our_log_probs(ref_leaves, counts)
    fused = fuse_rewards(r, counts, fusion, lp)
    for d, nodes in by_depth.items():
        torch.testing.assert_close(fused[d].float(), torch.stack([n.reward.float() for n in nodes]), atol=1e-6, rtol=0)
    adv = path_table(depth_advantages(fused), counts)
    own = owned_edges(counts)
    ours = [(int(ell), int(k), float(adv[ell, k])) for ell, k in zip(*torch.nonzero(own, as_tuple=True))]
    theirs = [(*_edge_key(s, ref_leaves), float(s["advantage"])) for s in samples]
    assert [e[:2] for e in ours] == [e[:2] for e in theirs]  # the same edges in the same order
    assert [e[2] for e in ours] == pytest.approx([e[2] for e in theirs], abs=1e-5)
    # and through the part: several trees, clipped at ±adv_clip, the edges all owned ones without pruning
    cr = BranchGrpo(split_points=split_points, adv_clip=0.5, fusion=fusion)
    a2, e2, _ = cr.tree_advantages(torch.cat([r, r.flip(0)]), torch.tensor([3] * leaves + [1] * leaves), num_steps,
                                   log_probs=torch.cat([lp, lp]))
    torch.testing.assert_close(a2[:leaves], adv.clamp(-0.5, 0.5).float())
    assert e2[:leaves].equal(own) and e2[leaves:].equal(own)


def test_depth_advantages_by_hand():
    # depth with 2 nodes: ±(a−b)/2 over the unbiased std |a−b|/√2 -> ±1/√2 whatever the gap
    a = depth_advantages([torch.tensor([0.5]), torch.tensor([0.1, 0.7], dtype=torch.float64)])
    assert a[0].tolist() == [0.0]
    assert a[1].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-6)
    # eps = 1e-8 on the std: visible at a std of 1.4e-5 (above min_std)
    b = depth_advantages([torch.tensor([0.0, 2e-5], dtype=torch.float64)])[0]
    assert b.tolist() == pytest.approx([-1e-5 / (math.sqrt(2) * 1e-5 + 1e-8), 1e-5 / (math.sqrt(2) * 1e-5 + 1e-8)],
                                       rel=1e-9)
    # a constant depth (std < 1e-6): 0, not 0/1e-8
    assert depth_advantages([torch.tensor([0.3, 0.3 + 1e-7], dtype=torch.float64)])[0].tolist() == [0.0, 0.0]


# ================================================================ pruning against REF L1275-1466
@pytest.mark.parametrize("it,slide,stop", [(0, False, None), (0, True, None), (1, True, None), (4, True, None),
                                           (5, True, None), (40, True, None),
                                           (40, True, 3), (7, True, 6)])
def test_depth_pruning_matches_the_released_lines(it, slide, stop):
    split_points, num_steps = [0, 1, 3], 7
    r = torch.tensor([0.2, 0.9, 0.4, 0.4, 0.7, 0.1, 0.3, 0.8])
    root, ref_leaves = _synthetic_tree(split_points, num_steps, r)
    all_nodes, by_depth = ref_node_rewards(root, r, ref_leaves)
    samples = ref_transitions(root, ref_depth_advantages(by_depth))
    kept = ref_depth_pruning(samples, "6,7", slide, 2, stop, split_points, it + 1)
    cr = BranchGrpo(split_points=split_points, depth_pruning=[6, 7], depth_pruning_slide=slide,
                    depth_pruning_slide_interval=2, depth_pruning_stop_depth=stop)
    _, edges, _ = cr.tree_advantages(r, torch.zeros(8, dtype=torch.long), num_steps, it=it, iterations=100)
    assert sorted(_edge_key(s, ref_leaves) for s in kept) == sorted(map(tuple, torch.nonzero(edges).tolist()))
    assert active_pruning_depths([6, 7], it, slide, 2, stop, split_points) == sorted(
        {s["child_depth"] for s in samples} - {s["child_depth"] for s in kept})


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_width_pruning_matches_the_released_lines(mode, ratio):
    split_points, num_steps = [0, 2], 6
    r = torch.tensor([0.2, 0.9, 0.4, 0.7])
    root, ref_leaves = _synthetic_tree(split_points, num_steps, r)
    all_nodes, by_depth = ref_node_rewards(root, r, ref_leaves)
    samples = ref_transitions(root, ref_depth_advantages(by_depth))
    kept = ref_width_pruning(samples, all_nodes, split_points, mode, ratio)
    cr = BranchGrpo(split_points=split_points, width_pruning=mode, width_pruning_ratio=ratio)
    _, edges, _ = cr.tree_advantages(r, torch.zeros(4, dtype=torch.long), num_steps)
    assert sorted(_edge_key(s, ref_leaves) for s in kept) == sorted(map(tuple, torch.nonzero(edges).tolist()))
    # the function alone, on ties: mode 1 keeps each chain's first steps (a chain's edges share their advantage)
    counts = node_counts(tree_factors(split_points, 2, num_steps))
    e = prune_width(owned_edges(counts), torch.zeros(4, num_steps), counts, 2, 1, 0.5)
    assert e[:, 3:].tolist() == [[True, False, False]] * 4


def test_pruning_stops_after_the_step_ratio():
    cr = BranchGrpo(split_points=[0, 2], depth_pruning=[4], pruning_step_ratio=0.5)
    r = torch.tensor([0.2, 0.9, 0.4, 0.7])
    _, early, _ = cr.tree_advantages(r, torch.zeros(4, dtype=torch.long), 4, it=4, iterations=10)  # step 5 <= 5
    _, late, _ = cr.tree_advantages(r, torch.zeros(4, dtype=torch.long), 4, it=5, iterations=10)  # step 6 > 5
    assert not early[:, 3].any() and late[:, 3].any()


# ================================================================ the loop: NFEs, DDP layout, refusals, recipe
def _metrics(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as fh:
        return [r for r in csv.DictReader(fh) if r.get("cost/nfe")]


TREE = ["advantage=branchgrpo", "advantage.split_points=[0,2]", "sampler=dance_sde", "train.train_steps=null",
        "reward=pickscore_tiny"]


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_nfes_are_what_the_tree_spends(tmp_path, monkeypatch, guidance):
    """2 trees of T = 4, split at 0 and 2 (N = 1, 2, 2, 4, 4): 9 node evaluations each in the rollout, 12 edges each
    trained (a forward and a backward: 2 forward-equivalents more), the leaf images free; CFG doubles all of it."""
    from stepflow.train import run

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    run(smoke_config(*TREE, "loop.iterations=1", f"loop.guidance={guidance}", "train.drop_zero_adv=false"), tmp_path)
    m = _metrics(tmp_path)[0]
    c = 2 if guidance > 1 else 1
    assert float(m["cost/nfe_rollout"]) == c * 2 * 9
    assert float(m["cost/nfe_estimate"]) == 0 and float(m["cost/reward_images"]) == 8
    assert float(m["train/branch_rows"]) == 24 == float(m["train/samples_trained"])
    assert float(m["cost/nfe_backward"]) == c * 24
    assert float(m["cost/nfe"]) == c * (18 + 24)
    assert float(m["cost/nfe_fwd_equiv"]) == c * (18 + 24) + 2 * c * 24
    assert float(m["train/ratio_min"]) == pytest.approx(1, abs=1e-5) == float(m["train/ratio_max"])  # on-policy
    assert all(math.isfinite(float(m[k])) for k in ("train/grad_norm", "train/reward_mean", "train/policy_loss"))


def test_a_tree_split_over_ranks_is_grown_by_both(tmp_path):
    """Ranks 0 and 1 each holding half of one tree's leaves grow the shared prefix both, get the leaf paths the
    one-rank tree has, and own disjoint edges whose union is the tree's."""
    from stepflow.core.rollout import sampling_grid
    from stepflow.rollouts.tree import grow_trees
    from stepflow.train import build_module

    m = build_module(smoke_config(*TREE[:-1], "advantage.split_points=[0,1,2]", "loop.group_size=8",
                                  "loop.prompts_per_iter=1"), tmp_path)
    pol, plan = m.learner.policy, m.learner.plan.plan(0)
    counts = node_counts(tree_factors([0, 1, 2], 2, 4))
    grid = sampling_grid(pol, 4, "model")
    whole = grow_trees(pol, m.learner.sampler, plan, torch.arange(8), counts, 4.0, grid)
    n0 = pol.nfe
    half = [grow_trees(pol, m.learner.sampler, plan, torch.arange(4) + 4 * r, counts, 4.0, grid) for r in (0, 1)]
    assert pol.nfe - n0 == 2 * (1 + 1 + 2 + 4)  # each rank: the nodes above its 4 leaves (1, 1, 2, 4 at depths 0..3)
    torch.testing.assert_close(torch.cat([h.latents for h in half]), whole.latents, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([h.log_probs for h in half]), whole.log_probs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("args,field", [
    (["loop.same_latent=false"], "loop.same_latent"),
    (["loop.group_size=8"], "loop.group_size"),
    (["advantage.split_points=[0,7]"], "advantage.split_points"),
    (["advantage.depth_pruning=[9]"], "advantage.depth_pruning"),
    (["advantage.width_pruning=1", "advantage.split_points=[]"], "advantage.width_pruning"),
    (["advantage.width_pruning=3"], "advantage.width_pruning"),
    (["advantage.fusion=max"], "advantage.fusion"),
    (["advantage.std_scope=global"], "advantage.std_scope"),
    (["advantage.branches=1"], "advantage.branches"),
    (["advantage.split_noise_scale=0"], "advantage.split_noise_scale"),
    (["sampler=ode"], "sampler=ode"),
    (["window=fixed"], "window=fixed"),
    (["objective=nft"], "objective=nft"),
    (["train.step_subset=random_per_sample"], "train.step_subset"),
])
def test_settings_a_tree_cannot_use_are_one_line(cli, args, field):
    r = cli("stepflow.train", "experiment=smoke", *TREE[:-1], *args)
    line = one_line_error(r, field)
    assert line.startswith(f"stepflow: error: {field}") and len(r.stderr.strip().splitlines()) == 1, r.stderr[-1500:]
    if field in ("sampler=ode", "window=fixed", "objective=nft"):
        assert "rollout tree" in line and "ODE anchor" not in line, line


def test_the_recipe_composes():
    from stepflow.train import settings

    cfg = compose_config("train", ["experiment=league/branchgrpo"])
    s = settings(cfg)
    assert s.advantage.name == "branchgrpo" and s.sampler.name == "dance_sde" and s.advantage.leaves() == 16
    assert cfg.loop.group_size == 16 and cfg.loop.same_latent and cfg.loop.time_grid == "fastvideo"
    assert cfg.train.train_steps is None and cfg.train.updates_per_iter == 5 and cfg.train.clip_eps == 1e-3
    counts = s.advantage.counts(cfg.loop.num_steps)
    assert sum(counts[:-1]) == 99 and sum(counts[1:]) == 114


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_two_iterations_lora_and_full(tmp_path, monkeypatch, finetune):
    from stepflow.train import run

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    extra = (["model=sd3_tiny", "model.finetune=full", "loop.num_steps=3", "eval.max_prompts=2", "eval.guidance=1"]
             if finetune == "full" else [])
    module = run(smoke_config(*TREE, *extra), tmp_path)
    assert module.policy.finetune == finetune
    rows = _metrics(tmp_path)
    assert len(rows) == 2 and module.iteration == 2
    for r in rows:
        for k in ("train/grad_norm", "train/reward_mean", "train/policy_loss"):
            assert math.isfinite(float(r[k])), k
        assert float(r["train/samples_trained"]) > 0


def test_resume_is_exact(tmp_path, monkeypatch):
    """3 iterations in one go == 2 + a resume (the sliding depth pruning reads the iteration)."""
    from stepflow.train import run

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    args = [*TREE, "advantage.depth_pruning=[4]", "advantage.depth_pruning_slide=true", "eval.max_prompts=2",
            "train.updates_per_iter=2"]
    a = run(smoke_config(*args, "loop.iterations=3"), tmp_path / "a")
    run(smoke_config(*args, "loop.iterations=2"), tmp_path / "b")
    b = run(smoke_config(*args, "loop.iterations=3", f"ckpt_path={tmp_path / 'b' / 'checkpoints' / 'last.ckpt'}"),
            tmp_path / "b")
    for p, q in zip(a.policy.trainable_parameters(), b.policy.trainable_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    last = [last_train_metrics(a), last_train_metrics(b)]
    assert last[0].keys() == last[1].keys()
    assert all(math.isclose(last[0][k], last[1][k], rel_tol=1e-5, abs_tol=1e-7) for k in last[0])


def test_the_update_gets_every_edge_once(tmp_path, monkeypatch):
    """The strategy's phases by hand: the update's rows are the trees' edges, each once (per tree and step k, the
    distinct X_{k+1} of the leaf paths, N_{k+1} of them), each trained at its step only, with the advantage of its
    child (the leaf-path table's entry of every leaf under that child)."""
    from stepflow.core.algorithm import Phases
    from stepflow.train import build_module

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    m = build_module(smoke_config(*TREE, "train.drop_zero_adv=false"), tmp_path)
    lr = m.learner
    strat = lr.rollout
    ctx = strat.context(lr, 0)
    plan = lr.plan.plan(0)
    col = strat.collect(lr, plan, ctx, Phases(lr.policy))
    col = strat.score(lr, col, plan, ctx)
    cred = strat.credit(lr, col, col.scores.rewards, plan, ctx)
    b = strat.training_batch(lr, col, cred, plan, ctx)
    counts = node_counts(tree_factors([0, 2], 2, 4))
    assert b.traj.batch_size == 2 * sum(counts[1:])
    assert (b.mask.sum(1) == 1).all() and ctx.trained == [0, 1, 2, 3]
    leaf = col.traj
    for e in range(b.traj.batch_size):
        k = int(b.mask[e].nonzero())
        assert (b.adv[e].nonzero().flatten().tolist() in ([k], []))
        x_next = b.traj.latents[e, k + 1]
        under = [i for i in range(leaf.batch_size) if torch.equal(leaf.latents[i, k + 1], x_next)]
        assert under and all(plan.group_ids[i] == b.groups[e] for i in under)
        assert all(float(cred.train[i, k]) == float(b.adv[e, k]) for i in under)
        torch.testing.assert_close(b.traj.latents[e, k], leaf.latents[under[0], k])
        assert float(b.traj.log_probs[e, k]) == float(leaf.log_probs[under[0], k])
    for g in (0, 1):
        rows = (b.groups == g).nonzero().flatten()
        for k in range(4):
            at_k = [e for e in rows.tolist() if bool(b.mask[e, k])]
            assert len(at_k) == counts[k + 1]
            assert len({b.traj.latents[e, k + 1].sum().item() for e in at_k}) == counts[k + 1]
