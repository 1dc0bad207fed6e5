"""GARDO (advantage=gardo + objective=gardo: stepflow/credits/gardo.py, stepflow/objectives/gardo.py): the diversity-
aware advantage, the rank-disagreement uncertainty, the risk compensator's gate and the reference-reset schedule
against transcriptions of the release's lines (numpy / plain torch, written independently of our code); the loss term
as the iteration wires it; the NFEs; the recipe; the refusals; LoRA and full fine-tuning; resume (the command-line
run: tests/test_league_recipes_cli.py).

References read: tinnerhrhe/GARDO@1cc77fb341a8f84013cbb51e7685805acbef3425 flow_grpo/stat_tracking.py L96-135
(``PerPromptStatTracker.update``, type 'gardo'), scripts/train_sd3_grpo_gardo.py L219-238 (``RiskCompensator``),
L633-642, L788-799, L826-837, L945-991, L1042-1043; config/gardo.py L85-108, L175-217 (geneval_sd3). The same script
is yifan123/flow_grpo@94e23ee5405ab7241fc1f75d30cac8147e2b1f53 scripts/train_sd3_gardo.py (config/grpo_gardo.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stepflow.testing.harness import compose_config, one_line_error

SMOKE = ["experiment=smoke", "reward=pickscore_tiny", "objective=gardo", "advantage=gardo", "sampler=flow_sde",
         "advantage.aux_components=[]", "train.beta_kl=0.07", "train.kl_mode=flow_grpo_parity", "loop.same_latent=false"]
#: two tiny PickScores as one reward: components ``ocr`` (seed 1) and ``pickscore`` (seed 0), so that a gate exists
MULTI = ["reward=multi", "reward@reward.rewards.ocr=pickscore_tiny", "reward@reward.rewards.pickscore=pickscore_tiny",
         "reward.rewards.ocr.seed=1", "advantage.aux_components=[ocr]"]


# ---------------------------------------------------------------- the release, transcribed
def released_gardo_tracker(prompts, rewards, dists):
    """stat_tracking.py L96-135 verbatim for type='gardo' (one call after a clear(); ``global_std`` unused there)."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    unique = np.unique(prompts)
    advantages = np.empty_like(rewards) * 0.0
    dists = np.array(dists)
    dists = dists / np.linalg.norm(dists, ord=2, axis=1, keepdims=True)
    stats = {}
    for prompt in unique:
        prompt_rewards = rewards[prompts == prompt]
        stats.setdefault(prompt, []).extend(prompt_rewards)
    for prompt in unique:
        stats[prompt] = np.stack(stats[prompt])
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(stats[prompt], axis=0, keepdims=True)
        prompt_dists = dists[prompts == prompt]
        similarity_matrix = np.dot(prompt_dists, prompt_dists.T).clip(-1, 1)
        distance_matrix = 1 - similarity_matrix
        avg_distances = np.zeros(len(distance_matrix))
        for i in range(len(distance_matrix)):
            mask = np.ones(len(distance_matrix), dtype=bool)
            mask[i] = False
            other_distances = distance_matrix[i, mask]
            avg_distances[i] = np.min(other_distances)
        prompt_dists = avg_distances
        prompt_dists = np.repeat(prompt_dists[:, np.newaxis], prompt_rewards.shape[-1], axis=1)
        prompt_dists = np.where((prompt_rewards - mean) < 0, np.ones_like(prompt_dists), prompt_dists / np.mean(prompt_dists))
        advantages[prompts == prompt] = (prompt_rewards - mean) * (prompt_dists)
    return advantages


class ReleasedRiskCompensator:
    """train_sd3_grpo_gardo.py L219-238 verbatim."""

    def __init__(self, base=0.1, beta=0.1):
        self.risk_buffer = []
        self.base = base
        self.alpha = 0.1
        self.beta = beta
        self.beta_min = 0.02
        self.beta_max = 0.2

    def update(self, pad_scores):
        if len(self.risk_buffer) == 0:
            self.beta = self.base
        elif np.mean(pad_scores) > max(self.risk_buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(pad_scores) < min(self.risk_buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, self.beta_min, self.beta_max)
        self.risk_buffer.append(np.mean(pad_scores))
        if len(self.risk_buffer) > 20:
            self.risk_buffer = self.risk_buffer[-20:]


def released_gate(gathered_rewards, main, aux, dynamic_controller):
    """train_sd3_grpo_gardo.py L826-837 verbatim (the item list: the auxiliary rewards, then the main one)."""
    reward_std = []
    for item in [*aux, main]:
        _, indices = torch.sort(torch.tensor(gathered_rewards[item]), descending=True)
        ranks = torch.empty_like(torch.tensor(gathered_rewards[item])).long()
        ranks[indices] = torch.arange(1, len(gathered_rewards[item]) + 1)
        reward_std.append(ranks.float())
    reward_std = reward_std[-1] - (reward_std[0] + reward_std[1]) / 2
    dynamic_controller.update(np.array([p for p in reward_std.cpu().numpy() if p >= 0]))
    threshold = np.percentile(np.array([p for p in reward_std.cpu().numpy() if p >= 0]), 100 - dynamic_controller.beta * 100)
    return reward_std, reward_std > threshold


def released_reset_epochs(kl_per_epoch, reset_freq, thres):
    """The epochs at which the release copies the weights into the reference (L642, L788-799, L1042-1043; beta > 0)."""
    reset, prev_epoch, out = False, 0, []
    for epoch, kl in enumerate(kl_per_epoch):
        if (epoch != 0 and reset is True) or (epoch - prev_epoch) > reset_freq:
            out.append(epoch)
            reset = False
            prev_epoch = epoch
        if kl > thres:  # info["kl_loss"] > thres after an optimizer step of this epoch
            reset = True
    return out


def _batch(seed=0, groups=3, size=5, dim=6):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(groups * size, generator=g, dtype=torch.float64)
    feats = torch.randn(groups * size, dim, generator=g, dtype=torch.float64)
    gid = torch.arange(groups).repeat_interleave(size)[torch.randperm(groups * size, generator=g)]
    return rewards, feats, gid


# ---------------------------------------------------------------- formulas
def test_diversity_advantage_matches_the_released_tracker():
    from stepflow.credits.gardo import diversity_advantages

    for seed in range(3):
        rewards, feats, gid = _batch(seed)
        ref = released_gardo_tracker([f"p{int(i)}" for i in gid], rewards.view(-1, 1).repeat(1, 4).numpy(), feats.numpy())
        ours = diversity_advantages(rewards, feats, gid)
        np.testing.assert_allclose(ours.numpy(), ref[:, 0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(ref[:, 1:], ref[:, :1].repeat(3, 1))  # the release repeats it over the steps
    # by hand: one group of 3, features e1, e1, e2 -> d = (0, 0, 1), mean 1/3; rewards (0.8, 0.2, 0.5): mean 0.5
    a = diversity_advantages(torch.tensor([0.8, 0.2, 0.5]), torch.tensor([[1.0, 0], [1, 0], [0, 1]]), torch.zeros(3))
    assert a.tolist() == pytest.approx([0.3 * 0.0, -0.3 * 1.0, 0.0], abs=1e-7)  # above the mean: w = d/mean d = 0; below: w = 1
    # without the bonus: R − mean
    assert diversity_advantages(torch.tensor([0.8, 0.2, 0.5]), torch.zeros(3, 2), torch.zeros(3),
                                diversity=False).tolist() == pytest.approx([0.3, -0.3, 0.0], abs=1e-7)


def test_uncertainty_gate_and_risk_compensator_match_the_release_over_iterations():
    from stepflow.credits.gardo import RiskCompensator, uncertainty

    ours, rel = RiskCompensator(), ReleasedRiskCompensator()
    g = torch.Generator().manual_seed(4)
    betas = []
    for it in range(30):  # the auxiliary rewards agree more, then less, with the main one: β moves down, then up
        n = 200
        c = 0.9 - 0.08 * it if it < 10 else 0.1 + 0.045 * (it - 10)
        main = torch.rand(n, generator=g, dtype=torch.float64)
        aes = main * (1 - c) + torch.rand(n, generator=g, dtype=torch.float64) * c
        ir = main * (1 - c) + torch.rand(n, generator=g, dtype=torch.float64) * c
        u_ref, gate_ref = released_gate({"aesthetic": aes.numpy(), "imagereward": ir.numpy(), "main": main.numpy()},
                                        "main", ["aesthetic", "imagereward"], rel)
        u = uncertainty(main, [aes, ir])
        torch.testing.assert_close(u.float(), u_ref)
        gate = ours.gate(u)
        assert torch.equal(gate, gate_ref), it
        assert ours.beta == pytest.approx(float(rel.beta)) and ours.buffer == pytest.approx(rel.risk_buffer)
        betas.append(ours.beta)
    steps = np.diff(betas)
    assert (steps > 1e-12).any() and (steps < -1e-12).any()  # both branches of the compensator ran


def test_reference_reset_schedule_matches_the_release(tmp_path):
    from stepflow.objectives.gardo import Gardo

    p = torch.nn.Parameter(torch.zeros(3))
    kls = [0.0, 5e-4, 0.0, 0.0, 1e-4, 0.0, 0.0, 0.0, 4e-4, 4e-4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    obj = Gardo(reset_freq=5, kl_thres=3e-4)
    obj.attach([p])
    got = []
    for it, kl in enumerate(kls):
        with torch.no_grad():
            p.fill_(float(it))  # the weights of iteration it
        before = obj.resets
        obj.begin_update(None, None, it, None, None)
        if obj.resets > before:
            got.append(it)
            assert float(obj.ref.shadow[0][0]) == float(it)  # the reference is the current weights
        obj.update_stats = {"train/kl": kl}
        obj.end_iteration(None)
    assert got == released_reset_epochs(kls, 5, 3e-4) == [2, 8, 9, 10, 16]


def test_credit_hands_the_gated_kl_weight_to_the_objective():
    from stepflow.credits.gardo import Gardo, RiskCompensator, diversity_advantages, uncertainty

    rewards, feats, gid = _batch(1, groups=4, size=6)
    aux = torch.rand(24, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    rewards[gid == 2] = 0.5  # a constant group: zero advantages, not trained, not counted in N
    c = Gardo(aux_components=["aux"])
    out = c(rewards.view(-1, 1).repeat(1, 5).float(), gid, 4, [0, 1, 2],
            {"features": feats.float(), "aux/aux": aux.float()})
    a = diversity_advantages(rewards.float(), feats.float(), gid).clamp(-5, 5)
    torch.testing.assert_close(out.advantages, a.float().view(-1, 1).expand(-1, 4))
    gate = RiskCompensator().gate(uncertainty(rewards.float(), [aux.float()]))
    live = gid != 2
    n, m = int(live.sum()), int((gate & live).sum())
    assert m > 0
    torch.testing.assert_close(out.rows["kl_weight"], (gate & live).float() * n / m)
    assert float(out.rows["kl_weight"][live].mean()) == pytest.approx(1.0)  # the gated mean over the trained rows
    assert c.state_dict()["risk"]["beta"] == pytest.approx(0.1)


# ---------------------------------------------------------------- the term as the iteration wires it
def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    return build_module(compose_config("train", [*SMOKE, *overrides]), tmp_path)


def test_the_term_is_the_released_loss_with_the_gated_kl(tmp_path):
    """One term: the release's L967-991 (clipped surrogate, mean over the gated rows of (μ_θ − μ_ref)²/(2 σ_t²), β) on
    the policy's velocities and the reference copy's, the gate given as the credit's kl_weight."""
    from stepflow.core.rollout import rollout
    from stepflow.core.update import step_loss
    from stepflow.math.sde import sde_step

    m = _module(tmp_path)
    lr, obj = m.learner, m.learner.objective
    traj = rollout(lr.policy, lr.plan.plan(0), lr.sampler, lr.loop.num_steps, lr.guidance)
    b = traj.batch_size
    adv = torch.randn(b, lr.loop.num_steps, generator=torch.Generator().manual_seed(2)) * 3
    g = torch.Generator().manual_seed(0)
    for s in obj.ref.shadow:  # a reference away from the current weights
        s.add_(torch.randn(s.shape, generator=g) * 0.05)
    with torch.no_grad():  # and weights away from the rollout's
        for p in lr.policy.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    idx = torch.zeros(b, dtype=torch.bool)
    idx[[1, 4, 6]] = True
    obj.row_info = {"kl_weight": idx.float() * b / int(idx.sum())}
    k, times = 1, traj.times
    out = step_loss(lr, traj, adv, k, torch.arange(b), times)
    with torch.no_grad():
        x, xn = traj.latents[:, k], traj.latents[:, k + 1]
        new = sde_step(lr.sampler, x, lr.policy.velocity(x, times[k], traj.cond, lr.guidance), times[k], times[k + 1],
                       t_guard=times[1], prev_sample=xn)
        with obj.ref.applied():
            v_ref = lr.policy.velocity(x, times[k], traj.cond, lr.guidance)
        prev_sample_mean_ref = sde_step(lr.sampler, x, v_ref, times[k], times[k + 1], t_guard=times[1],
                                        prev_sample=xn).mean
        log_prob, prev_sample_mean, std_dev_t = new.log_prob, new.mean, new.kl_scale.view(-1, 1, 1, 1)
        # --- L967-991, verbatim (config values inlined)
        advantages = torch.clamp(adv[:, k], -5, 5)
        ratio = torch.exp(log_prob - traj.log_probs[:, k])
        unclipped_loss = -advantages * ratio
        clipped_loss = -advantages * torch.clamp(ratio, 1.0 - 1e-4, 1.0 + 1e-4)
        policy_loss = (std_dev_t[:, 0, 0, 0] / torch.mean(std_dev_t[:, 0, 0, 0])) * torch.maximum(unclipped_loss,
                                                                                                  clipped_loss)
        kl_loss = torch.mean((torch.square(prev_sample_mean[idx] - prev_sample_mean_ref[idx])) / (2 * std_dev_t[idx] ** 2))
        loss = torch.mean(policy_loss) + 0.07 * torch.mean(kl_loss)
    assert float(kl_loss) > 0
    assert float(out["loss"]) == pytest.approx(float(loss), rel=1e-5, abs=1e-9)
    assert float(out["kl"]) == pytest.approx(float(kl_loss), rel=1e-5)


# ---------------------------------------------------------------- cost, recipe, refusals, fine-tuning, resume
def test_nfes_are_counted_by_the_common_rules(tmp_path):
    """The recipe on 1 prompt x 4 samples: T rollout NFEs per sample; per sample and trained step one forward of the
    policy, one of the reference (no grad) and one backward (2 forward-equivalents)."""
    from stepflow.train import build_module

    cfg = compose_config("train", ["experiment=league/gardo", "model=shapes_tiny", "reward=pickscore_tiny",
                                   "advantage.aux_components=[]", "loop.prompts_per_iter=1", "loop.group_size=4",
                                   "loop.iterations=1", "eval.every=0", "eval.at_start=false"])
    m = build_module(cfg, tmp_path).iterate()
    b, t, s = 4, 10, 8
    assert m["train/steps_trained"] == s and m["train/samples_trained"] == b
    assert (m["cost/nfe_rollout"], m["cost/nfe"], m["cost/nfe_backward"]) == (b * t, b * t + 2 * b * s, b * s)
    assert m["cost/nfe_fwd_equiv"] == b * t + 2 * b * s + 2 * b * s


def test_league_recipe_composes_with_the_released_settings():
    from stepflow.train import settings

    s = settings(compose_config("train", ["experiment=league/gardo"]))
    o, a = s.objective, s.advantage
    assert (type(o).__name__, o.reset_freq, o.kl_thres, type(a).__name__, a.aux_components, a.diversity,
            a.std_norm) == ("Gardo", 15, 3e-4, "Gardo", ["strict"], True, False)
    assert (s.train.beta_kl, s.train.kl_mode, s.train.clip_eps, s.train.timestep_fraction, s.train.updates_per_iter) \
        == (0.07, "flow_grpo_parity", 1e-4, 0.89, 2)
    assert (s.sampler.name, s.sampler.a, s.loop.same_latent, s.loop.guidance) == ("flow_sde", 0.7, False, 1.0)


@pytest.mark.parametrize("overrides,field", [
    (["train.beta_kl=0"], "train.beta_kl"),
    (["objective.reset_freq=-1"], "objective.reset_freq"),
    (["objective.kl_thres=0"], "objective.kl_thres"),
    (["advantage.gate_min=0"], "advantage.gate_min"),
    (["advantage.gate_base=0.5"], "advantage.gate_base"),
    (["advantage.aux_components=[1]"], "advantage.aux_components"),
    (["advantage.diversity=maybe"], "advantage.diversity"),
    (["loop.group_size=1", "loop.prompts_per_iter=4"], "loop.group_size"),
    (["loop.retain_graph=true"], "loop.retain_graph"),
    (["train.weighting=guard"], "train.weighting"),
    (["advantage.aux_components=[aesthetic]"], "advantage.aux_components"),  # at run time: no such component
])
def test_settings_gardo_cannot_use_are_one_line(cli, overrides, field):
    r = cli("stepflow.train", *SMOKE, "loop.iterations=1", *overrides)
    assert one_line_error(r, field).startswith(f"stepflow: error: {field}")


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_trains_with_lora_and_full_finetuning(tmp_path, finetune):
    extra = ["model=sd3_tiny", "model.finetune=full", "loop.num_steps=3"] if finetune == "full" else []
    m = _module(tmp_path, "loop.iterations=1", *extra)
    before = [p.detach().clone() for p in m.learner.policy.trainable_parameters()]
    res = m.iterate()
    assert math.isfinite(res["train/policy_loss"]) and res["train/grad_norm"] > 0 and res["train/kl"] >= 0
    assert any(float((p - q).abs().max()) > 0 for p, q in zip(m.learner.policy.trainable_parameters(), before))
    ref = m.learner.objective.ref  # the reference is a copy of the trained weights (not the LoRA-off policy)
    assert len(ref.shadow) == len(before) and all(torch.equal(s, q) for s, q in zip(ref.shadow, before))


@pytest.mark.slow
def test_resume_is_exact_with_the_reference_and_the_gate(tmp_path):
    """3 iterations in one go and 2 + a resume to 3 (a reset at iteration 2: reset_freq 1) end with the same weights,
    reference, gate state and metrics."""
    from stepflow.train import run

    args = [*SMOKE, *MULTI, "eval.every=0", "eval.max_prompts=2", "objective.reset_freq=1"]
    a = run(compose_config("train", [*args, "loop.iterations=3"]), tmp_path / "a")
    run(compose_config("train", [*args, "loop.iterations=2"]), tmp_path / "b")
    b = run(compose_config("train", [*args, "loop.iterations=3",
                                     f"ckpt_path={tmp_path / 'b' / 'checkpoints' / 'last.ckpt'}"]), tmp_path / "b")
    for p, q in zip(a.policy.trainable_parameters(), b.policy.trainable_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    oa, ob = a.objective.state_dict(), b.objective.state_dict()
    assert (oa["resets"], oa["last_reset"]) == (ob["resets"], ob["last_reset"]) == (1, 2)
    for s, u in zip(oa["ref"]["shadow"], ob["ref"]["shadow"]):
        torch.testing.assert_close(s, u, rtol=0, atol=1e-7)
    assert a.learner.advantage.state_dict() == b.learner.advantage.state_dict()
    assert len(a.learner.advantage.state_dict()["risk"]["buffer"]) == 3
    last = [{k: v for k, v in [h for h in m.history if "train/reward_mean" in h][-1].items() if k.startswith("train/")}
            for m in (a, b)]
    assert last[0].keys() == last[1].keys(), set(last[0]) ^ set(last[1])
    assert "train/gate_frac" in last[0] and "train/kl" in last[0]
    assert all(math.isclose(last[0][k], last[1][k], rel_tol=1e-5, abs_tol=1e-7) for k in last[0])
