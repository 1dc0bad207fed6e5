"""The branch-rollout iterations (stepflow.core.branch_loop: advantage=tempflow | g2rpo) and TurningPoint-GRPO's credit
(advantage=turning_point), against loops written out here: Flow-GRPO's SDE step and Euler completions by hand, the
rewards of the hand-made images, the released advantages by hand (numpy-style statistics), and the released losses'
gradients (TempFlow-GRPO: the noise-weighted clipped surrogate, one optimizer step; Granular-GRPO: one optimizer step
per trained step)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from stepflow.core.data import IterationPlan, seeded_normal
from stepflow.errors import StepflowError
from stepflow.testing.harness import compose_config

BASE = ["experiment=smoke", "reward=pickscore_tiny", "sampler=flow_sde"]
TEMPFLOW = ["advantage=tempflow", "advantage.branches=2", "loop.same_latent=false", "train.weighting=noise",
            "train.timestep_fraction=0.75"]
G2RPO = ["advantage=g2rpo", "loop.same_latent=true", "train.update_per_step=true", "train.train_steps=[0,1]"]


def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    m = build_module(compose_config("train", [*BASE, *overrides]), tmp_path)
    m.learner.optimizer = m._own_optimizer()
    return m


# ------------------------------------------------------------------------------------------------ by hand
def _flow_grpo_step(x, v, t, t_next, a, t1):
    """Flow-GRPO's sde_step_with_logprob (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py): mean and std."""
    dt = t_next - t  # < 0
    tt = t1 if float(t) == 1.0 else t
    std_dev_t = math.sqrt(float(t) / (1 - float(tt))) * a
    mean = x * (1 + std_dev_t ** 2 / (2 * t) * dt) + v * (1 + std_dev_t ** 2 * (1 - t) / (2 * t)) * dt
    return mean, std_dev_t * math.sqrt(-float(dt))


def _surrogate(lr, traj, adv, r, k, times, clip=1e-4):
    """The released clipped surrogate max(−Aρ, −A clip(ρ, 1 ± ϵ)) of branch row r at step k, with ρ from Flow-GRPO's
    step and torch's Normal (a differentiable 0-d tensor under the policy's current weights)."""
    x_k = traj.latents[r:r + 1, k]
    v = lr.policy.velocity(x_k, times[k], traj.cond.index([r]), 1.0)
    mean, sd = _flow_grpo_step(x_k, v, times[k], times[k + 1], 0.7, times[1])
    lp = Normal(mean, sd).log_prob(traj.latents[r:r + 1, k + 1]).flatten(1).mean(1)
    ratio = torch.exp(lp - traj.log_probs[r:r + 1, k])
    a = adv[r:r + 1, k]
    return torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip)).mean()


def _euler(pol, x, times, cond, start):
    """Euler ODE from state index ``start`` to the end of ``times``."""
    for i in range(start, len(times) - 1):
        x = x + (times[i + 1] - times[i]) * pol.velocity(x, times[i], cond, 1.0)
    return x


def _hand_branches(m, plan, k_br, steps, grans=(1,), jump_last=False):
    """For each row i, branch j, step k, granularity g: (X_{k+1}, log-prob under torch's Normal, reward of the image
    completed on σ[k+2::g] + 0; ``jump_last``: a suffix that misses 0 has its last time replaced by 0, as Granular-GRPO
    releases it), with the anchor an Euler loop from the row's initial noise."""
    lr = m.learner
    pol, times = lr.policy, lr.grid()
    out = {}
    with torch.no_grad():
        cond = pol.encode(plan.prompts)
        x0 = seeded_normal(plan.init_noise_seeds, tuple(pol.latent_shape))
        states = [x0]
        for i in range(len(times) - 1):
            states.append(states[-1] + (times[i + 1] - times[i]) * pol.velocity(states[-1], times[i], cond, 1.0))
        for k in steps:
            v = pol.velocity(states[k], times[k], cond, 1.0)
            mean, std = _flow_grpo_step(states[k], v, times[k], times[k + 1], 0.7, times[1])
            for j in range(k_br):
                seeds = plan.step_noise_seeds.long() * 1009 + 31 * k + j
                nxt = mean + std * seeded_normal(seeds, tuple(pol.latent_shape))
                lp = Normal(mean, std).log_prob(nxt).flatten(1).mean(1)
                for g in grans:
                    sub = list(times[k + 2::g])
                    if sub and float(sub[-1]) != 0.0 and jump_last:
                        sub[-1] = times[-1]
                    elif not sub or float(sub[-1]) != 0.0:
                        sub.append(times[-1])
                    grid = torch.stack([times[k + 1], *sub])
                    fin = _euler(pol, nxt, grid, cond, 0)
                    r = lr.reward(pol.decode(fin), plan.prompts, plan.meta).scores.float()
                    out[(k, j, g)] = (nxt, lp, r)
    return out


def _capture_update(monkeypatch):
    import stepflow.core.algorithm as bl

    seen = {}
    real = bl.update

    def spy(learner, traj, adv, *a, **kw):
        seen.update(traj=traj, adv=adv.clone(), mask=kw.get("mask"), weights=a[3] if len(a) > 3 else None)
        return real(learner, traj, adv, *a, **kw)

    monkeypatch.setattr(bl, "update", spy)
    return seen


def _min_group_std(r, groups) -> float:
    """The smallest unbiased std of ``r`` over the groups."""
    return min(float(r[groups == g].double().std()) for g in set(groups.tolist()))


def _colnorm(r, groups, eps, ddof):
    """(r − mean_group) / (std_group + eps) of one column, by hand."""
    out = torch.zeros_like(r, dtype=torch.float64)
    for g in set(groups.tolist()):
        idx = [i for i in range(len(r)) if int(groups[i]) == g]
        vals = r[idx].double()
        mu = vals.mean()
        sd = math.sqrt(float(((vals - mu) ** 2).sum()) / (len(idx) - ddof))
        out[idx] = (vals - mu) / (sd + eps)
    return out


# ------------------------------------------------------------------------------------------------ anchors
def test_anchor_rows_one_per_prompt_and_initial_noise():
    from stepflow.core.branch_loop import anchor_rows

    z = torch.tensor
    plan = IterationPlan(["a", "a", "a", "b", "b"], [{}] * 5, z([0, 0, 0, 1, 1]), z([10, 11, 12, 13, 14]),
                         z([7, 7, 8, 7, 7]))
    sub, amap = anchor_rows(plan)
    assert sub.prompts == ["a", "a", "b"] and sub.init_noise_seeds.tolist() == [7, 8, 7]
    assert amap.tolist() == [0, 0, 1, 2, 2]
    assert sub.group_ids.tolist() == [0, 0, 1]


# ------------------------------------------------------------------------------------------------ TempFlow-GRPO
def test_tempflow_branches_advantages_and_gradient_are_the_released_ones(tmp_path, monkeypatch):
    """One TempFlow iteration: the branch rows the update trains hold the hand-made SDE branches of the ODE anchor
    (X_{k+1}, log-prob under torch's Normal), their advantages are each step's column normalised within the prompt's
    N·K branches (population std + 1e-4) from the rewards of the hand-completed images, each row trains its own
    step only, and the optimizer step's gradient is that of mean_k w_k · mean_rows max(−Aρ, −A clip(ρ, 1 ± ϵ)),
    w_k = σ_k√Δt_k / mean over the trained steps (train_sd3_pr.py:954-955, normalised)."""
    import stepflow.core.algorithm as alg
    import stepflow.core.update as upd

    m = _module(tmp_path, *TEMPFLOW, "train.micro_batch_size=5")
    lr = m.learner
    seen = _capture_update(monkeypatch)
    grads = []
    real_step = upd.clip_and_step

    def capture(learner, ps, max_norm):
        grads.append(torch.cat([p.grad.flatten().clone() for p in ps]))
        return None  # no optimizer step: the weights stay those of the rollout

    monkeypatch.setattr(upd, "clip_and_step", capture)
    res = alg.iteration(lr, 0)
    monkeypatch.setattr(upd, "clip_and_step", real_step)
    plan = lr.plan.plan(0)
    steps = [0, 1, 2]  # int(4 · 0.75) of the smoke world's 4 steps
    hand = _hand_branches(m, plan, 2, steps)
    traj, adv, mask = seen["traj"], seen["adv"], seen["mask"]
    b, kb, s_n = len(plan), 2, len(steps)
    assert traj.batch_size == b * kb * s_n and mask.shape == (b * kb * s_n, s_n) and (mask.sum(1) == 1).all()
    for s, k in enumerate(steps):
        rewards = torch.stack([hand[(k, j, 1)][2] for j in range(kb)], 1).reshape(b * kb)  # row i*K + j
        want_adv = _colnorm(rewards, plan.group_ids.repeat_interleave(kb), 1e-4, 0).clamp(-5, 5)
        for i in range(b):
            for j in range(kb):
                r = (i * kb + j) * s_n + s
                nxt, lp, _ = hand[(k, j, 1)]
                torch.testing.assert_close(traj.latents[r, k + 1], nxt[i], atol=2e-5, rtol=1e-4)
                torch.testing.assert_close(traj.log_probs[r, k], lp[i], atol=2e-4, rtol=1e-4)
                assert bool(mask[r, s]) and traj.trainable[r].tolist() == [q == k for q in range(4)]
                assert float(adv[r, k]) == pytest.approx(float(want_adv[i * kb + j]), abs=1e-4)
                assert float(adv[r].abs().sum() - adv[r, k].abs()) == 0.0  # nothing at the other steps
        assert res.rewards[:, k].tolist() == pytest.approx(
            torch.stack([hand[(k, j, 1)][2] for j in range(kb)], 1).mean(1).tolist(), abs=1e-5)
    # the gradient: the released loss written out on the branch rows (ratio 1 on the first step: ∇ of −A·ρ)
    times = lr.grid()
    std = torch.tensor([_flow_grpo_step(torch.zeros(1), torch.zeros(1), times[k], times[k + 1], 0.7, times[1])[1]
                        for k in steps])
    w = std / std.mean()
    torch.testing.assert_close(seen["weights"].double(), w.double(), atol=1e-6, rtol=1e-5)
    params = list(lr.policy.trainable_parameters())
    for p in params:
        p.grad = None  # the update leaves its gradient in .grad (the next step's zero_grad clears it)
    lr.policy.train()
    keep = [r for r in range(traj.batch_size) if float(adv[r].abs().sum()) > 0]  # drop_zero_adv
    total = 0.0
    for r in keep:
        k = steps[int(torch.nonzero(mask[r]))]
        total = total + float(w[steps.index(k)]) * _surrogate(lr, traj, adv, r, k, times) / len(keep)
    total.backward()
    want = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    lr.policy.eval()
    assert len(grads) == 1  # one optimizer step (updates_per_iter = 1) over every branch row
    torch.testing.assert_close(grads[0], want, atol=1e-7, rtol=2e-4)
    assert float(want.abs().max()) > 0
    # the NFEs: anchors 8 rows x 4 steps (same_latent false: 8 anchors); branches 8 x 2 x (3 + 2 + 1)
    assert res.phases.nfe["rollout"] == 8 * 4 and res.phases.nfe["estimate"] == 8 * 2 * 6
    assert res.scores.images == 8 * 2 * 3 + 8


def test_tempflow_one_anchor_per_shared_noise(tmp_path):
    """With loop.same_latent=true the group's rows share one anchor: T NFEs per prompt, not per row."""
    import stepflow.core.algorithm as alg

    m = _module(tmp_path, *TEMPFLOW[:2], "loop.same_latent=true", "train.timestep_fraction=0.75")
    res = alg.iteration(m.learner, 0)
    assert res.phases.nfe["rollout"] == 2 * 4  # 2 prompts x 4 steps
    assert res.update["train/branch_rows"] == 8 * 2 * 3


# ------------------------------------------------------------------------------------------------ Granular-GRPO
def test_g2rpo_advantages_sum_granularities_and_each_step_takes_its_own_optimizer_step(tmp_path, monkeypatch):
    """Granular-GRPO: rewards of completions at granularities 1 and 2, A = Σ_g (R − mean)/(std_unbiased + 1e-8) per
    (step, granularity) within the prompt's rows (train_g2rpo_hps.py:660-693), and one optimizer step per trained
    step: step k's gradient is that of mean over its rows of the clipped surrogate at the weights the previous
    step left (the loop over t_idx calling optimizer.step())."""
    import stepflow.core.algorithm as alg
    import stepflow.core.update as upd

    m = _module(tmp_path, *G2RPO, "train.lr=0.05")
    lr = m.learner
    seen = _capture_update(monkeypatch)
    params = list(lr.policy.trainable_parameters())
    record = []
    real_step = upd.clip_and_step

    def capture(learner, ps, max_norm):
        record.append(([p.detach().clone() for p in ps], torch.cat([p.grad.flatten().clone() for p in ps])))
        return real_step(learner, ps, max_norm)

    monkeypatch.setattr(upd, "clip_and_step", capture)
    start = [p.detach().clone() for p in params]
    alg.iteration(lr, 0)
    monkeypatch.setattr(upd, "clip_and_step", real_step)
    assert len(record) == 2  # one per trained step
    # the hand advantages need the rollout weights
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    plan = lr.plan.plan(0)
    hand = _hand_branches(m, plan, 1, [0, 1], grans=(1, 2), jump_last=True)
    traj, adv = seen["traj"], seen["adv"]
    for s, k in enumerate([0, 1]):
        want = sum(_colnorm(hand[(k, 0, g)][2], plan.group_ids, 1e-8, 1) for g in (1, 2)).clamp(-5, 5)
        got = adv[torch.arange(len(plan)) * 2 + s, k]
        # the hand completions are batched apart from the loop's, so their fp32 rewards differ by up to ~1e-6
        # (measured 6e-7), and each granularity's normalisation divides that by its group's std (here as small as
        # 0.004): the advantage tolerance is that reward tolerance over the smallest std, per granularity
        # (a wrong ddof moves the advantages by 15 %, an eps of 1e-4 by 2.5 %)
        tol = 1e-4 + sum(2e-6 / _min_group_std(hand[(k, 0, g)][2], plan.group_ids) for g in (1, 2))
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=1e-4)
    times = lr.grid()
    lr.policy.train()
    for s, k in enumerate([0, 1]):
        before, g_rec = record[s]
        with torch.no_grad():
            for p, w in zip(params, before):
                p.copy_(w)
        rows = [r for r in range(traj.batch_size) if bool(seen["mask"][r, s]) and float(adv[r].abs().sum()) > 0]
        total = 0.0
        for r in rows:
            total = total + _surrogate(lr, traj, adv, r, k, times) / len(rows)
        for p in params:
            p.grad = None
        total.backward()
        want = torch.cat([p.grad.flatten() for p in params])
        torch.testing.assert_close(g_rec, want, atol=1e-7, rtol=2e-4)
        assert float(want.abs().max()) > 0
    lr.policy.eval()
    for p in params:
        p.grad = None
    assert not all(torch.equal(a, b) for a, b in zip(record[0][0], record[1][0]))  # step 1 saw step 0's weights


def test_update_per_step_without_branches_is_one_step_per_trained_step(tmp_path):
    """train.update_per_step on an ordinary rollout: as many optimizer steps as trained steps per chunk."""
    import stepflow.core.algorithm as alg

    m = _module(tmp_path, "train.update_per_step=true", "train.train_steps=[0,2,3]", "advantage=uniform")
    res = alg.iteration(m.learner, 0)
    assert m.learner.opt_steps == 3 and res.update["train/steps_trained"] == 3.0


# ------------------------------------------------------------------------------------------------ TurningPoint-GRPO
def test_turning_point_scheme_by_hand():
    """advantage=turning_point on a worked example (two rows of one prompt, T = 3, the window 0..1): row 0 R = (0.1,
    0.3, 0.2 | 0.5), row 1 R = (0.4, 0.2, 0.3 | 0.1). Both first steps are consistent turning points (s_1 > 0 and
    sign(d_1)·sign(R_sde − R_1) > 0), one per sign of Δ, so balancing keeps both: r = (R_sde − R_0, d_2) = (0.4, −0.1)
    and (−0.3, 0.1); each column normalised: ±0.35/(0.35 + 1e-4), ∓0.1/(0.1 + 1e-4); step 2 (outside) 0."""
    from stepflow.math.advantage import AdvantageConfig, AdvantageEstimator

    est = AdvantageEstimator(AdvantageConfig(scheme="turning_point", reward_source="completion"))
    assert est.states_needed([0, 1], 3) == [0, 1, 2, 3]
    rewards = torch.tensor([[0.1, 0.3, 0.2, 0.5], [0.4, 0.2, 0.3, 0.1]])
    out = est(rewards, torch.tensor([0, 0]), 3, [0, 1])
    a0, a1 = 0.35 / (0.35 + 1e-4), 0.1 / (0.1 + 1e-4)
    torch.testing.assert_close(out.advantages, torch.tensor([[a0, -a1, 0.0], [-a0, a1, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.gains[:, :2], torch.tensor([[0.4, -0.1], [-0.3, 0.1]]), atol=1e-6, rtol=0)
    assert out.stats["turning_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="window starting at step 0"):
        est(rewards, torch.tensor([0, 0]), 3, [1, 2])


def test_turning_point_reads_the_pure_ode_image_and_the_completions(tmp_path, monkeypatch):
    """With reward_source=completion the rewards the credit reads are R_0 = the image of a pure-ODE rollout from the
    same noise, R_t = the rollout's X_t completed by the ODE, R_T = the rollout's own image."""
    import stepflow.core.algorithm as alg
    import stepflow.rollouts.trajectory as strategy
    from stepflow.core.rollout import rollout
    from stepflow.math.sde import SamplerConfig

    m = _module(tmp_path, "advantage=turning_point", "window=fixed", "window.size=3", "sampler=cps")
    lr = m.learner
    seen = {}
    real = strategy.finite_advantages

    def spy(learner, rewards, *a, **kw):
        seen["r"] = rewards.clone()
        return real(learner, rewards, *a, **kw)

    monkeypatch.setattr(strategy, "finite_advantages", spy)
    res = alg.iteration(lr, 0)
    plan = lr.plan.plan(0)
    with torch.no_grad():
        ode = rollout(lr.policy, plan, SamplerConfig(name="ode"), 4, 1.0)
        r0 = lr.reward(lr.policy.decode(ode.latents[:, -1]), plan.prompts, plan.meta).scores.float()
    # the same images scored in another batch (40 vs 8 images): equal to the reward model's batch round-off
    torch.testing.assert_close(seen["r"][:, 0], r0, atol=1e-4, rtol=0)
    assert float((seen["r"][:, 1] - r0).abs().max()) > 1e-3  # the next state's completion is another image
    assert bool(torch.isfinite(seen["r"]).all())  # states 0..3 and the final image
    assert res.update["train/steps_trained"] == 3.0


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("overrides, needle", [
    (["advantage=tempflow", "objective=nft", "sampler=dpm2"], "objective=nft"),
    (["advantage=tempflow", "window=fixed"], "window=fixed"),
    (["advantage=g2rpo", "train.step_subset=random_per_sample"], "train.step_subset"),
    (["advantage=tempflow", "train.weighting=auto"], "train.weighting=auto"),
    (["advantage=tempflow", "sampler=ode"], "sampler=ode"),
    (["advantage=tempflow", "advantage.reward_source=completion"], "reward_source"),
    (["advantage=g2rpo", "advantage.granularities=[1,0]"], "granularities"),
    (["advantage=tempflow", "advantage.branches=0"], "branches"),
    (["advantage=turning_point", "window=fixed", "window.start=1"], "window that starts at step 0"),
    (["train.update_per_step=true", "train.weighting=grad_rms"], "update_per_step"),
])
def test_settings_refuse(overrides, needle):
    from stepflow.train import settings

    with pytest.raises((StepflowError, ValueError), match=needle):
        settings(compose_config("train", [*BASE, *overrides]))


def test_league_recipes_compose_as_released():
    from stepflow.train import settings

    t = settings(compose_config("train", ["experiment=league/tempflow"]))
    assert (t.advantage.scheme, t.advantage.branches, t.loop.group_size, t.loop.same_latent) == ("tempflow", 4, 4, False)
    assert (t.train.weighting, t.train.beta_kl, t.train.kl_mode, t.train.timestep_fraction) == ("noise", 0.004, "exact", 0.99)
    g = settings(compose_config("train", ["experiment=league/g2rpo"]))
    assert (g.advantage.scheme, g.advantage.granularities, g.advantage.eps, g.advantage.unbiased_std) == (
        "g2rpo", [1, 2], 1e-8, True)
    assert g.train.update_per_step and g.train.train_steps == [0, 1, 2, 3, 4] and g.loop.time_grid == "fastvideo"
    p = settings(compose_config("train", ["experiment=league/tpgrpo"]))
    assert (p.advantage.scheme, p.advantage.reward_source, p.sampler.name, p.sampler.eta) == (
        "turning_point", "completion", "cps", 0.7)
    assert (p.window.name, p.window.start, p.window.size, p.train.clip_eps) == ("fixed", 0, 9, 1e-5)
