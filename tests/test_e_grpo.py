"""E-GRPO (advantage=e_grpo, experiment=league/e_grpo; docs/method.md §15.2) against transcriptions of its
release, shengjun-zhang/VisualGRPO@ae619bff847b2559f7db998da8f635ca1cb7ce4e (``algorithm=grpo_merge``):

- the merged SDE step and its log-prob: ``FluxSampler._flow_grpo_step`` (fastvideo/workers/sampler/flux_sampler.py
  L162-191) with ``merge_step`` m: one Flow-SDE transition from σ_k to σ_{k+m};
- the branch of the anchor and its ODE completions at granularities: ``FluxSampler.sample`` L537-575 and
  ``_run_ode_sample`` L370-410 (the x̂0 of the last evaluated time is the image);
- the multi-step group normalised advantage: ``RolloutBuffer.compute_advantages`` (fastvideo/workers/rollout_buffer.py
  L87-130) and the clip of ``GRPOTrainer._compute_grpo_loss`` (fastvideo/trainer/grpo_trainer.py L241-243);
- the loss and its optimizer steps: ``GRPOTrainer._compute_grpo_loss`` L220-258 (``compute_log_prob`` flux_sampler.py
  L636-652 with the step's merge) and ``train_step`` L295-337 (one optimizer step per trained step).

The transcriptions are plain torch written from the released lines, never stepflow's functions. Left out of them: the
FLUX-specific latent packing, bf16 autocast and storage, and the transformer's quantised timestep ``int(σ·1000)/1000``
(L272, L342, L391; stepflow's policies take continuous t).
"""

from __future__ import annotations

import math

import pytest
import torch

from stepflow.core.data import seeded_normal
from stepflow.errors import StepflowError
from stepflow.testing.harness import compose_config, last_train_metrics

REF = "shengjun-zhang/VisualGRPO@ae619bf"
BASE = ["experiment=smoke", "reward=pickscore_tiny", "sampler=flow_sde", "loop.time_grid=fastvideo"]
E_GRPO = ["advantage=e_grpo", "loop.same_latent=true", "train.update_per_step=true", "train.drop_zero_adv=false",
          "train.train_steps=[0,1]", "advantage.merge=[2,1]"]


# ------------------------------------------------------------------------------------------ the release, transcribed
def sd3_time_shift(shift, t):
    """flux_sampler.py L25-27."""
    return (shift * t) / (1 + (shift - 1) * t)


def released_flow_grpo_step(model_output, latents, eta, sigmas, index, prev_sample=None, merge_step=1,
                            variance_noise=None):
    """flux_sampler.py L162-191 (``_flow_grpo_step``); ``variance_noise``: the randn_tensor of L178-183."""
    sigma = sigmas[index]
    sigma_prev = sigmas[index + merge_step]
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    pred_original_sample = latents - sigma * model_output
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    prev_sample_mean = (latents * (1 + std_dev_t ** 2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt)
    if prev_sample is None:
        if variance_noise is None:  # η = 0 (the anchor, the ODE): the released draw is multiplied by std 0
            variance_noise = torch.randn_like(model_output)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt))
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, pred_original_sample, log_prob


def released_run_ode_sample(velocity, z, start_step, sigma_schedule):
    """flux_sampler.py L370-410 (``_run_ode_sample``): Euler (η = 0) from index start_step + 1 to len − 2; the image
    is the x̂0 of the last step."""
    sample_steps = len(sigma_schedule)
    pred_original = None
    for i in range(start_step + 1, sample_steps - 1):
        pred = velocity(z, sigma_schedule[i])
        z, pred_original, _ = released_flow_grpo_step(pred, z.to(torch.float32), 0, sigma_schedule, i)
    return pred_original


def released_anchor(velocity, z, sigma_schedule, sampling_steps):
    """flux_sampler.py L270-318 (``_run_anchor_sample``): the η = 0 step at every index; all latents (B, N+1, ...)."""
    all_latents = [z]
    for i in range(sampling_steps):
        pred = velocity(z, sigma_schedule[i])
        z, _, _ = released_flow_grpo_step(pred, z.to(torch.float32), 0, sigma_schedule, i)
        all_latents.append(z)
    return torch.stack(all_latents, dim=1)


def released_branch(velocity, anchor_latents, sigma_schedule, eta, eta_step, merge_step, granular_list, noise):
    """flux_sampler.py L537-575 for one eta_step: the SDE step of ``_run_sde_sample_step`` (L320-368) with its
    merge_step from the anchor's state, then ``_run_ode_sample`` on prefix ++ suffix per granularity. ``start`` of
    the ODE: the released ``eta_step`` (L556-561)."""
    input_sde_sample = anchor_latents[:, eta_step]
    pred = velocity(input_sde_sample, sigma_schedule[eta_step])
    z, _, log_prob = released_flow_grpo_step(pred, input_sde_sample.to(torch.float32), eta, sigma_schedule, eta_step,
                                             prev_sample=None, merge_step=merge_step, variance_noise=noise)
    finals = {}
    for g in granular_list:
        prefix = sigma_schedule[:eta_step + merge_step + 1]
        suffix = sigma_schedule[eta_step + merge_step + 1::g]
        sigma_schedule_j = torch.cat((prefix, suffix))
        finals[g] = sigma_schedule_j
    return z, log_prob, finals


def released_compute_advantages(rewards_list, num_generations, normalize=True):
    """rollout_buffer.py L102-130 (``compute_advantages``): per granularity, consecutive groups of num_generations
    rows, (r − mean) / (std + 1e-8) (torch's unbiased std), summed over granularities; then the clip of
    grpo_trainer.py L241-243 (adv_clip_max 5)."""
    base_reward = rewards_list[0]
    n_prompts = base_reward.shape[0] // num_generations
    advantages = torch.zeros_like(base_reward)
    for reward in rewards_list:
        group_advantages = torch.zeros_like(reward)
        for i in range(n_prompts):
            start_idx = i * num_generations
            end_idx = (i + 1) * num_generations
            group_rewards = reward[start_idx:end_idx]
            group_mean = group_rewards.mean(dim=0)
            if normalize:
                group_std = group_rewards.std(dim=0) + 1e-8
                group_advantages[start_idx:end_idx] = (group_rewards - group_mean) / group_std
            else:
                group_advantages[start_idx:end_idx] = group_rewards - group_mean
        advantages += group_advantages
    return torch.clamp(advantages, -5.0, 5.0)


def released_grpo_loss(new_log_probs, old_log_probs, advantages, clip_range=1e-4):
    """grpo_trainer.py L245-256: the PPO-style clipped surrogate, a mean over the step's rows."""
    ratio = torch.exp(new_log_probs - old_log_probs)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


# ------------------------------------------------------------------------------------------ a toy policy
class _Cond:
    def repeat(self, n):
        return self


class _Toy:
    """velocity(x, t) = tanh(x)·(1 + t) − 0.3·x: nonlinear in x and t, no parameters."""

    def velocity(self, x, t, cond, guidance=1.0):
        return torch.tanh(x) * (1 + torch.as_tensor(t, dtype=x.dtype)) - 0.3 * x


# ------------------------------------------------------------------------------------------ the merged branch
@pytest.mark.parametrize("k, m", [(0, 1), (1, 1), (1, 2), (2, 3), (3, 2)])
def test_merged_branch_and_completions_are_the_released_ones(k, m):
    """branch_at(span=m, jump_last=True) from the released anchor: X_{k+m} is the released merged Flow-SDE step (same
    noise), its log-prob the released one, and each granularity's image the released ``_run_ode_sample``'s.
    m = 1: the released call as written (start index eta_step). m > 1: the released call starts its ODE at
    index eta_step + 1 of prefix ++ suffix, σ_{k+1}, although the merged sample is at σ_{k+m} (a slip the released
    merge lists [1] / [1,1,1] never reach); stepflow starts at σ_{k+m}, the transcription with start k + m − 1."""
    from stepflow.core.branch import branch_at
    from stepflow.samplers.flow_sde import FlowSde

    pol, n, shape = _Toy(), 7, (2, 3, 3)
    sigmas = sd3_time_shift(3.0, torch.linspace(1, 0, n + 1))  # FastVideo's grid (L127-131), shift 3
    z = torch.randn(2, *shape, generator=torch.Generator().manual_seed(4))
    anchor = released_anchor(lambda x, t: pol.velocity(x, t, None), z, sigmas, n)
    vel = torch.stack([pol.velocity(anchor[:, i], sigmas[i], None) for i in range(n)], 1)
    seeds = torch.tensor([11, 12])
    out = branch_at(pol, anchor, vel, sigmas, _Cond(), k, FlowSde(a=0.7), 1, seeds, granularities=(1, 2), span=m,
                    jump_last=True)
    noise = seeded_normal(seeds.long() * 1009 + 31 * k, shape)
    want_next, want_lp, grids = released_branch(lambda x, t: pol.velocity(x, t, None), anchor, sigmas, 0.7, k, m,
                                                [1, 2], noise)
    assert out.span == m
    torch.testing.assert_close(out.next[:, 0], want_next, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.log_probs[:, 0], want_lp, atol=1e-5, rtol=1e-5)
    for j, g in enumerate((1, 2)):
        want = released_run_ode_sample(lambda x, t: pol.velocity(x, t, None), want_next, k + m - 1, grids[g])
        torch.testing.assert_close(out.final[:, 0, j], want, atol=1e-5, rtol=1e-5)
        literal = released_run_ode_sample(lambda x, t: pol.velocity(x, t, None), want_next, k, grids[g])
        if m == 1:  # the released call as written
            assert torch.equal(literal, want)
        else:  # the released index slip moves the image
            assert not torch.allclose(literal, want, atol=1e-3)


def test_completion_ends_as_released_where_the_stride_misses_zero():
    """σ[k+m+1::2] that misses τ_T = 0: the released loop evaluates up to the suffix's second-last time and jumps to
    0 from there (jump_last, Granular-GRPO's release too); the rule that visits the last time first takes one NFE
    more."""
    from stepflow.core.branch import completion_grid, completion_nfe

    times = torch.linspace(1, 0, 11)
    # k = 1, m = 1: lands at τ_2; suffix σ[3::2] = (0.7, 0.5, 0.3, 0.1)
    torch.testing.assert_close(completion_grid(times, 1, 2, jump_last=True), torch.tensor([0.7, 0.5, 0.3, 0.0]))
    torch.testing.assert_close(completion_grid(times, 1, 2), torch.tensor([0.7, 0.5, 0.3, 0.1, 0.0]))
    assert completion_nfe(10, 1, 2, span=1, jump_last=True) == 4 and completion_nfe(10, 1, 2) == 5
    # k = 4, m = 3 (lands τ_7): σ[8::2] = (0.2, 0.0) ends at 0: both rules agree
    assert completion_nfe(10, 4, 2, span=3, jump_last=True) == completion_nfe(10, 4, 2, span=3) == 2
    assert completion_nfe(10, 4, 1, span=3) == 3  # τ_8, τ_9, τ_10


# ------------------------------------------------------------------------------------------ the credit
def test_multi_step_group_normalised_advantage_is_the_released_one():
    """EGrpo.branch_advantages on hand-made rewards of 2 prompts x 12 generations, 3 merged steps, granularities
    (1, 2) equals the released compute_advantages + clip; one row is an outlier at both granularities, so its
    summed advantage (2 x 11/√12 = 6.35) is clipped to 5."""
    from stepflow.credits.e_grpo import EGrpo

    gen = torch.Generator().manual_seed(3)
    r = torch.rand(24, 3, 2, generator=gen)  # (B, S, G)
    r[5, 1, :] = 50.0
    credit = EGrpo(branches=1, granularities=[1, 2], unbiased_std=True, eps=1e-8)
    got, stats = credit.branch_advantages(r.view(24, 1, 3, 2), torch.arange(24) // 12)
    want = released_compute_advantages([r[:, :, 0], r[:, :, 1]], 12)
    torch.testing.assert_close(got[:, 0], want, atol=1e-5, rtol=1e-5)
    assert float(got[5, 0, 1]) == 5.0 and stats["adv_clip_frac"] > 0


def test_merge_field_and_refusals():
    from stepflow.credits.e_grpo import EGrpo

    for bad in ([], [0], [1, 2.5], "2", [True]):
        with pytest.raises(ValueError, match="merge: must be null or a non-empty list"):
            EGrpo(merge=bad)
    with pytest.raises(ValueError, match="jump_last: must be a bool"):
        EGrpo(jump_last="yes")


@pytest.mark.parametrize("overrides, needle", [
    (["advantage.merge=[2,1]", "train.train_steps=null"], "advantage.merge: gives one span per step of train.train_steps"),
    (["advantage.merge=[2]", "train.train_steps=[0,1]"], "advantage.merge: 1 spans for the 2 steps"),
    (["advantage.merge=[1,3]", "train.train_steps=[0,1]"], "advantage.merge: step 1 spanning 3 intervals lands at state 4"),
    (["advantage.merge=[2,1]", "train.train_steps=[0,1]", "train.weighting=noise"], "train.weighting=noise"),
    (["advantage.merge=[0]", "train.train_steps=[0]"], "advantage.merge: must be null"),
    (["window=fixed"], "window=fixed"),
    (["objective=nft", "sampler=dpm2"], "objective=nft"),
])
def test_settings_refuse(overrides, needle):
    """One line each, naming the field and the fix (the core's branch rows and the credit's own)."""
    from stepflow.train import settings

    with pytest.raises((StepflowError, ValueError), match=needle.replace("[", r"\[").replace("(", r"\(")) as e:
        settings(compose_config("train", [*BASE, "advantage=e_grpo", *overrides]))
    assert "\n" not in str(e.value)


def test_league_recipe_composes_as_released():
    from stepflow.train import settings

    s = settings(compose_config("train", ["experiment=league/e_grpo"]))
    a = s.advantage
    assert (a.name, a.branches, a.granularities, a.merge, a.jump_last, a.eps, a.unbiased_std, a.adv_clip) == (
        "e_grpo", 1, [1, 2], [1, 1, 1, 2, 3], True, 1e-8, True, 5.0)
    assert (s.sampler.name, s.sampler.a, s.window.name, s.objective.name) == ("flow_sde", 0.7, "none", "grpo")
    assert s.train.train_steps == [0, 1, 2, 3, 4] and s.train.update_per_step and not s.train.drop_zero_adv
    assert (s.train.clip_eps, s.train.beta_kl, s.train.max_grad_norm, s.train.weight_decay) == (1e-4, 0.0, 1.0, 1e-4)
    assert (s.loop.same_latent, s.loop.time_grid, s.loop.num_steps, s.loop.group_size, s.loop.guidance) == (
        True, "fastvideo", 10, 16, 1.0)
    # every merged step lands before the image, and the spans are those of the steps listed
    roll = a.rollout_strategy()

    class _L:
        train = s.train

    assert [roll.span(k, _L) for k in range(6)] == [1, 1, 1, 2, 3, 1]


# ------------------------------------------------------------------------------------------ one iteration
def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    m = build_module(compose_config("train", [*BASE, *E_GRPO, *overrides]), tmp_path)
    m.learner.optimizer = m._own_optimizer()
    return m


def _hand(m, plan, steps, merges, grans=(1, 2)):
    """The released rollout of each prompt's rows, written out: the anchor (η = 0 steps from the row's initial
    noise), at each (eta_step, merge_step) the merged SDE step of every row from the anchor's state (its noise: the
    row's branch seed) and its completions; the completions' rewards (B,) per granularity."""
    lr = m.learner
    pol, sigmas = lr.policy, lr.grid()
    out = {}
    with torch.no_grad():
        cond = pol.encode(plan.prompts)

        def vel(x, t):
            return pol.velocity(x, t, cond, 1.0)

        anchor = released_anchor(vel, seeded_normal(plan.init_noise_seeds, tuple(pol.latent_shape)), sigmas,
                                 len(sigmas) - 1)
        for k, mm in zip(steps, merges):
            noise = seeded_normal(plan.step_noise_seeds.long() * 1009 + 31 * k, tuple(pol.latent_shape))
            nxt, lp, grids = released_branch(vel, anchor, sigmas, 0.7, k, mm, list(grans), noise)
            rewards = {}
            for g in grans:
                img = released_run_ode_sample(vel, nxt, k + mm - 1, grids[g])
                rewards[g] = lr.reward(pol.decode(img), plan.prompts, plan.meta).scores.float()
            out[k] = (anchor[:, k], nxt, lp, rewards)
    return out


def test_iteration_trains_the_merged_steps_as_released(tmp_path, monkeypatch):
    """One E-GRPO iteration on the smoke world (steps 0 and 1 merged over 2 and 1 intervals): the branch rows hold
    the released merged SDE samples at X_{k+m} with their released log-probs (spans say where each lands), the
    advantages are the released ones from the rewards of the released completions, and each trained step takes its
    own optimizer step whose gradient is that of the released clipped loss (mean over all the step's rows, their
    log-probs over the merged interval) at the weights the previous step left."""
    import stepflow.core.algorithm as alg
    import stepflow.core.update as upd

    m = _module(tmp_path, "train.lr=0.05")
    lr = m.learner
    seen = {}
    real_update = alg.update

    def spy(learner, traj, adv, *a, **kw):
        seen.update(traj=traj, adv=adv.clone(), mask=kw.get("mask"))
        return real_update(learner, traj, adv, *a, **kw)

    monkeypatch.setattr(alg, "update", spy)
    params = list(lr.policy.trainable_parameters())
    record = []
    real_step = upd.clip_and_step

    def capture(learner, ps, max_norm):
        record.append(([p.detach().clone() for p in ps], torch.cat([p.grad.flatten().clone() for p in ps])))
        return real_step(learner, ps, max_norm)

    monkeypatch.setattr(upd, "clip_and_step", capture)
    start = [p.detach().clone() for p in params]
    res = alg.iteration(lr, 0)
    monkeypatch.setattr(upd, "clip_and_step", real_step)
    assert len(record) == 2  # one optimizer step per trained step
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    plan = lr.plan.plan(0)
    steps, merges = [0, 1], [2, 1]
    hand = _hand(m, plan, steps, merges)
    traj, adv = seen["traj"], seen["adv"]
    b = len(plan)
    assert traj.spans is not None and traj.spans.tolist() == [2, 1, 1, 1]
    for s, (k, mm) in enumerate(zip(steps, merges)):
        rows = torch.arange(b) * 2 + s  # row (i·K + j)·S + s, K = 1
        x_k, nxt, lp, rewards = hand[k]
        assert traj.step_end(k) == k + mm
        torch.testing.assert_close(traj.latents[rows, k], x_k, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(traj.latents[rows, k + mm], nxt, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(traj.log_probs[rows, k], lp, atol=2e-4, rtol=1e-4)
        want = released_compute_advantages([rewards[1].view(b, 1).double(), rewards[2].view(b, 1).double()],
                                           lr.loop.group_size)[:, 0]
        # the completions here are batched apart from the loop's: fp32 rewards differ by ~1e-6, over group stds
        # as small as a few 1e-3 (see tests/test_branch_loop.py)
        tol = 1e-4 + sum(2e-6 / min(float(rewards[g][plan.group_ids == q].double().std()) for q in set(
            plan.group_ids.tolist())) for g in (1, 2))
        torch.testing.assert_close(adv[rows, k].double(), want, atol=tol, rtol=1e-4)
    # the gradients: the released loss of each step over all its rows at the weights the previous step left
    sigmas = lr.grid()
    lr.policy.train()
    for s, (k, mm) in enumerate(zip(steps, merges)):
        before, g_rec = record[s]
        with torch.no_grad():
            for p, w in zip(params, before):
                p.copy_(w)
        rows = torch.nonzero(seen["mask"][:, s]).flatten()
        x_k = traj.latents[rows, k]
        pred = lr.policy.velocity(x_k, sigmas[k], traj.cond.index(rows), 1.0)
        _, _, new_lp = released_flow_grpo_step(pred, x_k.float(), 0.7, sigmas, k,
                                               prev_sample=traj.latents[rows, k + mm].float(), merge_step=mm)
        loss = released_grpo_loss(new_lp, traj.log_probs[rows, k], adv[rows, k])
        for p in params:
            p.grad = None
        loss.backward()
        want = torch.cat([p.grad.flatten() for p in params])
        torch.testing.assert_close(g_rec, want, atol=1e-7, rtol=2e-4)
        assert float(want.abs().max()) > 0
    lr.policy.eval()
    for p in params:
        p.grad = None
    assert res.update["train/steps_trained"] == 2.0 and res.update["train/samples_trained"] == 2 * b


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_nfes_counted_by_the_common_rules(tmp_path, guidance):
    """cost/nfe of an iteration, counted by hand: the anchors (2 prompts x T = 4), every row's merged branch
    completions (the SDE step reuses the anchor's velocity; (0, m=2) and (1, m=1) both land at τ_2: g = 1 τ_3, τ_4;
    g = 2 σ[3::2] = (τ_3) misses 0, released jump: τ_3 -> 0 is one evaluation at τ_2), the update's forwards
    (8 rows x 2 steps); CFG doubles every evaluation; a backward counts 2 forward-equivalents."""
    import stepflow.core.algorithm as alg

    m = _module(tmp_path, f"loop.guidance={guidance}")
    res = alg.iteration(m.learner, 0)
    cfg = 2 if guidance != 1.0 else 1
    anchors, rows = 2 * 4, 8
    branch = rows * ((2 + 1) + (2 + 1))  # per row: step 0 (g1: 2, g2: 1), step 1 (g1: 2, g2: 1)
    update = rows * 2
    assert res.phases.nfe["rollout"] == cfg * anchors and res.phases.nfe["estimate"] == cfg * branch
    assert res.phases.nfe["update"] == cfg * update
    mt = alg.iteration_metrics(res, 1)
    assert mt["cost/nfe"] == cfg * (anchors + branch + update)
    assert mt["cost/nfe_fwd_equiv"] == cfg * (anchors + branch + update) + 2 * cfg * update
    assert mt["cost/reward_images"] == rows * 2 * 2 + 2  # each row's 2 steps x 2 granularities, and the 2 anchors


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_trains_with_lora_and_full_finetuning(tmp_path, finetune):
    """One iteration with the LoRA (the shapes model) and with every transformer weight trained (model.finetune=full
    on the tiny SD3 pipeline; the shapes policy trains LoRA only): both optimizer steps taken, finite metrics."""
    from stepflow.train import run

    extra = ["model=sd3_tiny", "model.finetune=full"] if finetune == "full" else []
    module = run(compose_config("train", [*BASE, *E_GRPO, "loop.iterations=1", "eval.max_prompts=2", *extra]),
                 tmp_path / "run")
    pol = module.policy
    assert getattr(pol, "finetune", "lora") == finetune and module.learner.opt_steps == 2
    if finetune == "full":
        assert sum(p.numel() for p in pol.trainable_parameters()) == sum(p.numel() for p in pol.transformer.parameters())
    h = next(h for h in reversed(module.history) if "train/grad_norm" in h)
    for key in ("train/grad_norm", "train/reward_mean", "train/policy_loss"):  # the GRPO loss (no train/loss key)
        assert math.isfinite(h[key]), key
    assert h["train/grad_norm"] > 0


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    """E-GRPO keeps no state of its own: 2 iterations + a resume to 3 equal 3 in one go."""
    from stepflow.train import run

    args = [*BASE, *E_GRPO, "eval.every=0", "eval.max_prompts=2"]
    a = run(compose_config("train", [*args, "loop.iterations=3"]), tmp_path / "a")
    run(compose_config("train", [*args, "loop.iterations=2"]), tmp_path / "b")
    b = run(compose_config("train", [*args, "loop.iterations=3",
                                     f"ckpt_path={tmp_path / 'b' / 'checkpoints' / 'last.ckpt'}"]), tmp_path / "b")
    for p, q in zip(a.policy.trainable_parameters(), b.policy.trainable_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    last = [last_train_metrics(a), last_train_metrics(b)]
    assert last[0].keys() == last[1].keys()
    assert all(math.isclose(last[0][k], last[1][k], rel_tol=1e-5, abs_tol=1e-7) for k in last[0])


@pytest.mark.parametrize("objective", [
    [],  # grpo
    ["objective=flow_dppo"],
    ["objective=gardo", "train.beta_kl=0.07"],  # gardo's loss term on e_grpo's credit
])
def test_every_step_objective_reads_the_merged_transition(tmp_path, objective):
    """An objective's loss at step k reads the rollout's transition to τ_{k+m} (``objectives.base.transition``), so at
    a negligible lr the recomputed log-prob of every merged row is the rollout's own (ratio 1 to rounding); reading X_{k+1} and
    τ_{k+1} instead puts the ratio far from 1."""
    import stepflow.core.algorithm as alg

    m = _module(tmp_path, "train.lr=1e-20", *objective)
    res = alg.iteration(m.learner, 0).update
    assert res["train/steps_trained"] == 2
    assert abs(res["train/ratio_max"] - 1) < 1e-4 and abs(res["train/ratio_min"] - 1) < 1e-4, res
