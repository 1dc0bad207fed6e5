"""GRPO-Guard and MixGRPO / MixGRPO-Flash as released, each against a transcription of the released lines.

- GRPO-Guard: yifan123/flow_grpo PR #175 (read at zhtmike/flow_grpo 9745241): scripts/train_sd3_GRPO_Guard.py
  L915-939, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py L42-68, L91-92 (``train.weighting=guard_released``).
- MixGRPO: Tencent-Hunyuan/MixGRPO e5cdd6a: fastvideo/utils/grpo_states.py L85-99, L136-148 (``window=mixgrpo``);
  MixGRPO-Flash: fastvideo/utils/sampling_utils.py L29-55, L112-144, L157-210, L273-447, L449-561
  (:func:`stepflow.math.solvers.flash_grid`, :func:`stepflow.math.solvers.flash_tail`), and wired into the rollout
  (``window.post_solver=dpmpp2m``, ``rollout(tail=)``, ``experiment=league/mixgrpo_flash``).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from stepflow.config import TrainConfig
from stepflow.math.loss import WEIGHTINGS, guard_log_ratio, guard_released_scale, policy_loss
from stepflow.math.sde import SamplerConfig, flow_sde_step, ode_step
from stepflow.math.solvers import flash_grid, flash_num_post, flash_orders, flash_tail
from stepflow.math.weighting import build_weighting
from stepflow.math.window import WindowConfig, mixgrpo_position, window_steps
from stepflow.objectives import Grpo
from stepflow.testing.harness import compose_config


# ================================================================================================================
# MixGRPO's window
# ================================================================================================================
class _ReleasedStates:
    """Transcription of ``GRPOTrainingStates`` with ``sample_strategy="progressive"`` (grpo_states.py L29-53, L85-99,
    L136-148), as train_grpo_flux.py L915-930 builds it (``max_timesteps = sampling_steps - 2``, cur 0) and L945-947
    reads it (``get_current_timesteps()`` then ``update_iteration()``)."""

    def __init__(self, iters_per_group, group_size, max_timesteps, cur_timestep=0, prog_overlap=True,
                 prog_overlap_step=1, roll_back=False):
        self.iters_per_group, self.group_size, self.max_timesteps = iters_per_group, group_size, max_timesteps
        self.cur_timestep, self.cur_iter_in_group = cur_timestep, 0
        self.prog_overlap, self.prog_overlap_step, self.roll_back = prog_overlap, prog_overlap_step, roll_back
        self.init_timestep = self.cur_timestep

    def update_iteration(self):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters_per_group:
            self.cur_iter_in_group = 0
            if self.prog_overlap:
                self.cur_timestep += self.prog_overlap_step
            else:
                self.cur_timestep += self.group_size
        if self.cur_timestep > self.max_timesteps:
            if self.roll_back:
                self.cur_timestep = self.init_timestep
                self.cur_iter_in_group = 0
            else:
                self.cur_timestep = self.max_timesteps

    def get_current_timesteps(self):
        return list(range(self.cur_timestep, min(self.cur_timestep + self.group_size, self.max_timesteps)))


def _mix(**kw) -> WindowConfig:
    return WindowConfig("mixgrpo", **{"size": 4, "every": 25, "stride": 1, "roll_back": True, **kw})


def test_mixgrpo_window_at_the_released_iterations():
    """Hand-listed windows of the released schedules, the empty ones included."""
    rel = _mix()  # finetune_flux_grpo_MixGRPO.sh: 25 steps, group 4, every 25, stride 1, --roll_back
    want25 = {0: [0, 1, 2, 3], 24: [0, 1, 2, 3], 25: [1, 2, 3, 4], 299: [11, 12, 13, 14],  # 300 released iterations
              475: [19, 20, 21, 22], 499: [19, 20, 21, 22], 500: [20, 21, 22], 525: [21, 22], 550: [22],
              575: [], 599: [], 600: [0, 1, 2, 3], 1175: [], 1200: [0, 1, 2, 3]}  # cycle: 24 positions x 25
    assert {i: window_steps(rel, i, 25) for i in want25} == want25
    want10 = {0: [0, 1, 2, 3], 24: [0, 1, 2, 3], 25: [1, 2, 3, 4], 59: [2, 3, 4, 5], 100: [4, 5, 6, 7],
              125: [5, 6, 7], 150: [6, 7], 175: [7], 200: [], 224: [], 225: [0, 1, 2, 3]}  # the miniature, T = 10
    assert {i: window_steps(rel, i, 10) for i in want10} == want10
    flash = _mix(every=20)  # ..._MixGRPO_Flash.sh
    assert [window_steps(flash, i, 25) for i in (0, 19, 20, 299, 459, 460, 479, 480)] == [
        [0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 4], [14, 15, 16, 17], [22], [], [], [0, 1, 2, 3]]
    frozen = _mix(every=20, stride=0)  # ..._MixGRPO_Flash*.sh: prog_overlap_step 0
    assert all(window_steps(frozen, i, 25) == [0, 1, 2, 3] for i in (0, 20, 299, 10_000))
    clip = _mix(roll_back=False)  # without --roll_back the window stays at T - 2: empty for good
    assert [window_steps(clip, i, 10) for i in (175, 200, 225, 10_000)] == [[7], [], [], []]


@pytest.mark.parametrize("num_steps", [3, 4, 10, 25])
@pytest.mark.parametrize("size,stride,every,start,roll_back", [
    (4, 1, 25, 0, True), (4, 1, 3, 0, False), (2, 2, 1, 1, True), (1, 3, 2, 0, True), (3, 0, 5, 1, True),
    (5, 1, 1, 0, True), (2, 2, 4, 0, False)])
def test_mixgrpo_window_is_the_released_state_machine(num_steps, size, stride, every, start, roll_back):
    m = num_steps - 2
    if start >= m:
        pytest.skip("start outside the window's range")
    rel = _ReleasedStates(every, size, m, start, prog_overlap_step=stride, roll_back=roll_back)
    cfg = WindowConfig("mixgrpo", start=start, size=size, stride=stride, every=every, roll_back=roll_back)
    for it in range(700):
        assert window_steps(cfg, it, num_steps) == rel.get_current_timesteps(), it
        assert mixgrpo_position(cfg, it, num_steps) == rel.cur_timestep
        rel.update_iteration()


def test_mixgrpo_window_checks_and_sliding_is_unchanged():
    with pytest.raises(ValueError, match="window.start"):
        window_steps(_mix(start=8), 0, 10)  # range(8, 8): always empty
    with pytest.raises(ValueError, match="window.start"):
        window_steps(_mix(), 0, 2)
    with pytest.raises(ValueError, match="stride: must be an integer >= 1"):
        WindowConfig("sliding", stride=0)
    assert WindowConfig("mixgrpo", stride=0).stride == 0
    with pytest.raises(ValueError, match="roll_back"):
        WindowConfig("mixgrpo", roll_back="yes")
    sl = WindowConfig("sliding", start=1, size=3, stride=2, every=5)  # stepflow's simplified window, as measured
    for it in range(200):
        lo = min(1 + (it // 5) * 2, 10 - 3)
        assert window_steps(sl, it, 10) == list(range(lo, lo + 3))


def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    module = build_module(compose_config("train", ["experiment=smoke", *overrides]), tmp_path)
    module.learner.optimizer = module._own_optimizer()
    return module


def test_an_empty_mixgrpo_window_rolls_out_the_ode_and_trains_nothing(tmp_path):
    """smoke: T = 4, so the window is range(cur, min(cur + 4, 2)): [0, 1], [1], [] (cur = 2), then [0, 1] again."""
    from stepflow.core.algorithm import iteration

    module = _module(tmp_path, "sampler=flow_sde", "advantage=uniform", "window=mixgrpo", "window.every=1",
                     "train.drop_zero_adv=false")  # the smoke policy's rewards are all 0: keep its rows trained
    learner = module.learner
    assert [learner.window_steps(i) for i in range(4)] == [[0, 1], [1], [], [0, 1]]
    before = [p.detach().clone() for p in learner.policy.trainable_parameters()]
    res = iteration(learner, 2)
    assert res.update["train/steps_trained"] == 0.0 and "train/policy_loss" not in res.update
    assert learner.opt_steps == 0 and not learner.optimizer.state and module.ema.num_updates == 0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.policy.trainable_parameters()))
    assert math.isfinite(res.rewards[:, -1].sum().item())
    full = iteration(learner, 0).update
    assert full["train/steps_trained"] == 2.0 and "train/policy_loss" in full
    assert iteration(learner, 1).update["train/steps_trained"] == 1.0


# ================================================================================================================
# MixGRPO-Flash: the compressed DPM-Solver++(2M) tail
# ================================================================================================================
def _sd3_time_shift(shift, t):  # sampling_utils.py L9-10
    return (shift * t) / (1 + (shift - 1) * t)


def _fastvideo_grid(n, shift):  # train_grpo_flux.py L187-189
    return _sd3_time_shift(shift, torch.linspace(1, 0, n + 1))


def _released_flash_schedule(sigma_schedule, last_false_index, ratio, shift):
    """sampling_utils.py L44-54."""
    num_post_steps = int(max((sigma_schedule.size(0) - 1 - last_false_index) * ratio, 1))
    post_time_step = torch.linspace(1, 0, sigma_schedule.size(0))[last_false_index + 1].item()
    post_sigma_schedule = torch.linspace(post_time_step, 0, num_post_steps)
    post_sigma_schedule = _sd3_time_shift(shift, post_sigma_schedule)
    return torch.cat([sigma_schedule[:last_false_index + 1], post_sigma_schedule], dim=0)


def test_flash_grid_is_the_released_compressed_schedule():
    g = _fastvideo_grid(25, 3.0)
    # hand: int(max((25 - last)·0.4, 1)); Flash* ratio 0.2
    assert [flash_num_post(25, last, 0.4) for last in (3, 10, 17, 20, 21, 22)] == [8, 6, 3, 2, 1, 1]
    assert flash_num_post(25, 3, 0.2) == 4
    for ratio in (0.4, 0.2):
        for last in (0, 3, 10, 17, 20, 21, 22):
            want = _released_flash_schedule(g, last, ratio, 3.0)
            got = flash_grid(g, last, ratio, 3.0)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            assert got[last + 1] == g[last + 1] and torch.equal(got[: last + 1], g[: last + 1])
    assert flash_grid(g, 21, 0.4, 3.0)[-1] > 0  # num_post = 1: the grid does not reach 0 (released corner)
    assert flash_orders(7) == [2, 2, 2, 2, 2, 2, 1] and flash_orders(1) == [1] and flash_orders(0) == []
    with pytest.raises(ValueError, match="compress_ratio"):
        flash_num_post(25, 3, 0.0)


def _toy_velocity(x, t):
    """A smooth nonlinear stand-in for the transformer, v(x, t) (time as the σ itself)."""
    t = torch.as_tensor(t, dtype=torch.float32)
    return torch.tanh(x) * (1.0 + t) - 0.3 * x * t + 0.2 * (1.0 - t)


def _released_flash_rollout(z, sigma_schedule, determistic, eta, ratio, shift, noises, velocity=_toy_velocity):
    """Transcription of run_sample_step's ``dpmsolver++`` / ``post`` / ``--flow_grpo_sampling`` path (sampling_utils.py
    L29-55, L112-144): flow_grpo_step (L157-210; its noise given, ``determistic`` → ``latents + dt·v``, L197-199) up
    to the window's last step, each pushing its x̂0 (L116-117, L127); then dpm_step's deterministic updates (L307-370:
    first order L436, second-order midpoint L515-520), order 2. ``velocity(z, σ)`` stands in for the transformer.
    Returns (final latent, the compressed schedule)."""
    model_outputs, lower_order_nums = [None, None], 0
    last = len(determistic) - 1 - next(i for i, v in enumerate(reversed(determistic)) if not v)
    sigma_schedule = _released_flash_schedule(sigma_schedule, last, ratio, shift)
    n_steps = sigma_schedule.size(0) - 1
    lam = lambda s: torch.log(1 - s) - torch.log(s)  # noqa: E731
    for i in range(n_steps):
        sigma = sigma_schedule[i]
        pred = velocity(z, sigma)
        model_outputs = [model_outputs[1], z - sigma * pred]  # dpm_state.update(x_0)
        if i <= last:
            sigma_prev, sigma_max = sigma_schedule[i + 1], sigma_schedule[1].item()
            dt = sigma_prev - sigma
            std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
            mean = (z * (1 + std_dev_t**2 / (2 * sigma) * dt)
                    + pred * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
            z = z + dt * pred if determistic[i] else mean + std_dev_t * torch.sqrt(-1 * dt) * noises[i]
        else:
            s_t, s_s0 = sigma_schedule[i + 1], sigma_schedule[i]
            h = lam(s_t) - lam(s_s0)
            if lower_order_nums < 1 or i == n_steps - 1:  # dpm_solver_first_order_update, deterministic (L436)
                z = (s_t / s_s0) * z - ((1 - s_t) * (torch.exp(-h) - 1.0)) * model_outputs[-1]
            else:  # multistep_dpm_solver_second_order_update, midpoint, deterministic (L515-520)
                h_0 = lam(s_s0) - lam(sigma_schedule[i - 1])
                d0, d1 = model_outputs[-1], (1.0 / (h_0 / h)) * (model_outputs[-1] - model_outputs[-2])
                c = (1 - s_t) * (torch.exp(-h) - 1.0)
                z = (s_t / s_s0) * z - c * d0 - 0.5 * c * d1
        lower_order_nums = min(lower_order_nums + 1, 2)  # dpm_state.update_lower_order()
    return z, sigma_schedule


@pytest.mark.parametrize("window", [[0, 1, 2, 3], [5, 6, 7, 8], [12, 13, 14, 15], [19, 20, 21, 22], [20, 21, 22],
                                    [0]])
@pytest.mark.parametrize("ratio", [0.4, 0.2])
def test_flash_rollout_matches_the_released_sampler(window, ratio):
    """Euler before the window, the Flow-SDE (η 0.7) in it, the compressed DPM-Solver++(2M) tail after it."""
    n, shift, eta = 25, 3.0, 0.7
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 4, generator=g)
    noises = torch.randn(n, 2, 3, 4, 4, generator=g)
    det = [i not in window for i in range(n)]
    want, sched = _released_flash_rollout(x.clone(), _fastvideo_grid(n, shift), det, eta, ratio, shift, noises)
    grid = _fastvideo_grid(n, shift)
    last = window[-1]
    z = x.clone()
    for k in range(last + 1):  # stepflow's own steps on the original grid
        v = _toy_velocity(z, grid[k])
        if k in window:
            out = flow_sde_step(z, v, grid[k], grid[k + 1], a=eta, t_guard=grid[1], noise=noises[k])
        else:
            out = ode_step(z, v, grid[k], grid[k + 1])
        x0_prev, t_prev, z = z - grid[k] * v, grid[k], out.next
    tail = flash_grid(grid, last, ratio, shift)[last + 1:]
    got, states, vels = flash_tail(z, tail, _toy_velocity, x0_prev, t_prev)
    assert len(states) == len(vels) == len(tail) - 1 == sched.shape[0] - 1 - (last + 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    if len(tail) > 1:
        assert float(tail[-1]) == 0.0


# ================================================================================================================
# GRPO-Guard as released
# ================================================================================================================
def _released_sde_step_with_logprob(sigmas, j, model_output, sample, prev_sample, noise_level=0.7):
    """sd3_sde_with_logprob.py L42-68, L89-92 (``sde_type='sde'``, ``return_sqrt_dt=True``); every row at step j."""
    b = sample.shape[0]
    sigma = sigmas[[j] * b].view(-1, 1, 1, 1)
    sigma_prev = sigmas[[j + 1] * b].view(-1, 1, 1, 1)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (
        1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t, torch.sqrt(-1 * dt)


def _released_guard_loss(sigmas, j, v_new, v_old, x, x_next, adv, clip_range, beta=0.0, v_ref=None):
    """train_sd3_GRPO_Guard.py L915-939 (``config.rationorm = True``); the old log-prob and mean as the rollout
    stores them."""
    _, old_lp, old_mean, _, _ = _released_sde_step_with_logprob(sigmas, j, v_old, x, x_next)
    _, log_prob, prev_sample_mean, std_dev_t, sqrt_dt = _released_sde_step_with_logprob(sigmas, j, v_new, x, x_next)
    advantages = torch.clamp(adv, -5.0, 5.0)
    sigma_t = std_dev_t.mean()
    ratio_mean_bias = (prev_sample_mean - old_mean).pow(2).mean(dim=tuple(range(1, log_prob.ndim)))
    ratio_mean_bias = ratio_mean_bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
    ratio = torch.exp((log_prob - old_lp + ratio_mean_bias) * (sqrt_dt.mean() * sigma_t))
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss_ = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    policy_loss_ = policy_loss_ / (sqrt_dt.mean() ** 2)
    if beta > 0:
        _, _, ref_mean, _, _ = _released_sde_step_with_logprob(sigmas, j, v_ref, x, x_next)
        kl_loss = ((prev_sample_mean - ref_mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
        return policy_loss_ + beta * torch.mean(kl_loss), ratio
    return policy_loss_, ratio


class _Cond:
    def index(self, rows):
        return self

    def to(self, dev):
        return self


class _Policy:
    """v_θ(x, t) = base(x, t) + δ (δ a trained (C, H, W) offset); the reference disables δ."""

    def __init__(self, delta):
        self.delta, self.device, self.off = delta, torch.device("cpu"), False

    def velocity(self, x, t, cond, guidance):
        return _toy_velocity(x, t) + (0.0 if self.off else self.delta)

    def reference(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.off = True
            try:
                yield
            finally:
                self.off = False
        return ctx()


def _two_step_setup(seed=0, b=2, shape=(1, 1, 2), old_shift=0.0):
    """A 2-step grid [1, 0.6, 0] (Δt 0.4 and 0.6; step 0 at t = 1 takes σ_max = τ_1), B rows of D = 2 values, a
    Flow-SDE (a = 0.7) rollout under the old velocity base + old_shift."""
    g = torch.Generator().manual_seed(seed)
    times = torch.tensor([1.0, 0.6, 0.0])
    x0 = torch.randn(b, *shape, generator=g)
    lat, vel = [x0], []
    for k in range(2):
        v = _toy_velocity(lat[-1], times[k]) + old_shift
        out = flow_sde_step(lat[-1], v, times[k], times[k + 1], a=0.7, t_guard=times[1],
                            noise=torch.randn(b, *shape, generator=g))
        lat.append(out.next)
        vel.append(v)
    lps = [flow_sde_step(lat[k], vel[k], times[k], times[k + 1], a=0.7, t_guard=times[1],
                         prev_sample=lat[k + 1]).log_prob for k in range(2)]
    traj = SimpleNamespace(latents=torch.stack(lat, 1), velocities=torch.stack(vel, 1), log_probs=torch.stack(lps, 1),
                           cond=_Cond())
    return times, traj


def _learner(weighting, delta, clip_eps=2e-6, beta=0.0):
    train = TrainConfig(clip_eps=clip_eps, beta_kl=beta, kl_mode="flow_grpo_parity")
    learner = SimpleNamespace(policy=_Policy(delta), sampler=SamplerConfig(name="flow_sde", a=0.7), guidance=1.0,
                              weighting=build_weighting(weighting))
    return Grpo().bind(train), learner


def test_guard_released_is_a_weighting_and_guard_is_kept():
    assert "guard" in WEIGHTINGS and "guard_released" in WEIGHTINGS
    old, new = build_weighting("guard"), build_weighting("guard_released")
    assert old.guard and new.guard and old.policy_scale(1.0, 0.6) is None
    assert float(new.policy_scale(torch.tensor(1.0), torch.tensor(0.6))) == pytest.approx(2.5)
    torch.testing.assert_close(guard_released_scale(0.2780, 0.0089), torch.tensor(1 / (0.2780 - 0.0089)))
    assert build_weighting("none").policy_scale(1.0, 0.6) is None


def test_guard_released_hand_computed_two_step_example():
    """On-policy (δ = 0: ρ̃ = 1 at every row), the released loss of step k is −mean_i A_i / Δt_k:
    A = (1, −0.5), Δt = (0.4, 0.6) → −0.625 and −0.41667; `guard` gives −0.25 at both."""
    times, traj = _two_step_setup()
    adv = torch.tensor([[1.0, 1.0], [-0.5, -0.5]])
    rows = torch.arange(2)
    for name, want in (("guard_released", [-0.25 / 0.4, -0.25 / 0.6]), ("guard", [-0.25, -0.25])):
        obj, learner = _learner(name, torch.zeros(1, 1, 2))
        for k in range(2):
            out = obj.loss(learner, traj, adv, k, rows, times, None)
            assert float(out["loss"].detach()) == pytest.approx(want[k], rel=1e-6), (name, k)
            assert float(out["ratio_mean"]) == 1.0


@pytest.mark.parametrize("b,old_shift,clip", [(1, 0.05, 2e-6), (3, 0.0, 2e-6), (4, 0.0, 1.0), (1, 0.03, 4e-6)])
def test_guard_released_matches_the_released_lines(b, old_shift, clip):
    """Loss and gradient of Grpo.loss (guard_released) against the transcription of train_sd3_GRPO_Guard.py
    L915-932 on the 2-step example. Off-policy (δ ≠ 0) with one row, or on-policy with several rows, the released
    batch-mean bias (``mean(dim=())``) equals the per-row one, so both agree exactly (clip 1: nothing clipped)."""
    times, traj = _two_step_setup(seed=3, b=b, old_shift=old_shift)
    adv = torch.linspace(-1.0, 1.5, b).unsqueeze(1).repeat(1, 2)
    rows = torch.arange(b)
    for k in range(2):
        delta = torch.zeros(1, 1, 2, requires_grad=True)
        obj, learner = _learner("guard_released", delta, clip_eps=clip)
        got = obj.loss(learner, traj, adv, k, rows, times, None)["loss"]
        (g_got,) = torch.autograd.grad(got, delta)
        delta2 = torch.zeros(1, 1, 2, requires_grad=True)
        x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
        want, ratio = _released_guard_loss(times, k, _toy_velocity(x, times[k]) + delta2, traj.velocities[:, k], x,
                                           x_next, adv[:, k], clip)
        (g_want,) = torch.autograd.grad(want, delta2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)
        if old_shift:
            assert float((ratio.detach() - 1).abs().max()) > clip  # off-policy: the clip range is exercised


def test_guard_released_batch_mean_bias_is_the_one_deviation():
    """Several rows off-policy: the released ``(μ_θ − μ_old)².mean(dim=())`` is the batch's mean b̄ (log_prob is
    already (B,)), so log ρ̃_i(released) − log ρ̃_i(stepflow) = (b̄ − b_i)·s, in closed form."""
    times, traj = _two_step_setup(seed=5, b=3)
    k = 1
    x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
    v_new = 1.2 * _toy_velocity(x, times[k])  # a row-dependent change (an offset would move every row alike)
    _, ratio = _released_guard_loss(times, k, v_new, traj.velocities[:, k], x, x_next, torch.ones(3), 1.0)
    new = flow_sde_step(x, v_new, times[k], times[k + 1], a=0.7, t_guard=times[1], prev_sample=x_next)
    old = flow_sde_step(x, traj.velocities[:, k], times[k], times[k + 1], a=0.7, t_guard=times[1], prev_sample=x_next)
    ours = guard_log_ratio(x_next, new.mean, old.mean, new.std)
    s = new.std[0]
    d2 = ((new.mean - old.mean) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(torch.log(ratio) - ours, (d2.mean() - d2) / (2 * s), rtol=1e-3, atol=1e-9)
    assert float((d2 - d2.mean()).abs().max()) > 0


def test_the_dt_factor_changes_the_per_step_gradient_ratio_by_the_dt_ratio():
    """Closed form, on-policy (ρ̃ = 1, nothing clipped): ∂μ/∂v = −Δt_k·c_k with c_k = 1 + σ_d²(1 − t)/(2t), so
    ∂ρ̃_i/∂δ = −Δt_k·c_k·ε_i/D (ε_i = (x_{k+1} − μ_old)/s, D values per row) and ∂L_k/∂δ = (1/B)·Σ_i A_i·c_k·ε_i/D
    under `guard_released` (the Δt cancels), that times Δt_k under `guard`: the ratio of the two steps' gradient
    norms changes by exactly Δt_1/Δt_0 = 1.5."""
    times, traj = _two_step_setup(seed=7, b=4)
    adv = torch.tensor([1.0, -0.3, 0.7, -1.2]).unsqueeze(1).repeat(1, 2)
    rows = torch.arange(4)
    grads = {}
    for name in ("guard", "guard_released"):
        for k in range(2):
            delta = torch.zeros(1, 1, 2, requires_grad=True)
            obj, learner = _learner(name, delta, clip_eps=1.0)
            (grads[name, k],) = torch.autograd.grad(obj.loss(learner, traj, adv, k, rows, times, None)["loss"], delta)
    for k in range(2):
        t, s_next = times[k], times[k + 1]
        t_til = times[1] if k == 0 else t
        dt = float(t - s_next)
        c = 1.0 + 0.49 / (2 * (1 - float(t_til))) * (1 - float(t))  # σ_d²(1 − t)/(2t) = a²(1 − t)/(2(1 − t̃))
        x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
        old = flow_sde_step(x, traj.velocities[:, k], t, s_next, a=0.7, t_guard=times[1], prev_sample=x_next)
        eps = (x_next - old.mean) / old.std.view(-1, 1, 1, 1)
        closed = (adv[:, k].view(-1, 1, 1, 1) * c * eps).mean(0) / 2  # D = 2 values per row
        torch.testing.assert_close(grads["guard_released", k], closed, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(grads["guard", k], closed * dt, rtol=1e-4, atol=1e-7)
    ratio = lambda name: float(grads[name, 0].norm() / grads[name, 1].norm())  # noqa: E731
    assert ratio("guard_released") / ratio("guard") == pytest.approx(0.6 / 0.4, rel=1e-5)


def test_guard_released_divides_the_policy_loss_only():
    """loss = L_policy/Δt + β·KL (L934-937): the KL is not divided."""
    times, traj = _two_step_setup(seed=9, b=2)
    adv = torch.tensor([[1.0, 1.0], [-0.5, -0.5]])
    delta = torch.full((1, 1, 2), 0.02)
    obj, learner = _learner("guard_released", delta, beta=0.5)
    out = obj.loss(learner, traj, adv, 0, torch.arange(2), times, None)
    assert float(out["kl"]) > 0
    torch.testing.assert_close(out["loss"], out["policy_loss"] + 0.5 * out["kl"])
    plain = policy_loss(torch.zeros(2), torch.zeros(2), adv[:, 0], clip_eps=2e-6)
    assert float(plain.loss) == pytest.approx(-0.25)  # policy_scale=None: unchanged


# ================================================================================================================
# the experiment files and the training loop
# ================================================================================================================
def test_league_guard_and_mixgrpo_compose_with_the_released_settings():
    from stepflow.train import settings

    s = settings(compose_config("train", ["experiment=league/grpo_guard"]))
    assert (s.train.weighting, s.train.clip_eps, s.train.beta_kl, s.sampler.name, s.sampler.a) == (
        "guard_released", 2e-6, 0.0, "flow_sde", 0.7)
    assert s.train.timestep_fraction == 0.99 and s.train.train_steps is None and s.advantage.std_scope == "group"
    m = settings(compose_config("train", ["experiment=league/mixgrpo"]))
    w = m.window
    assert (w.name, w.size, w.every, w.stride, w.roll_back, m.sampler.name, m.sampler.a) == (
        "mixgrpo", 4, 25, 1, True, "flow_sde", 0.7)
    assert m.train.train_steps is None and m.train.clip_eps == 1e-4 and m.loop.same_latent
    assert m.loop.time_grid == "fastvideo" and m.advantage.unbiased_std and m.train.updates_per_iter == 4


def test_guard_released_trains_in_the_loop(tmp_path):
    from stepflow.core.algorithm import iteration

    module = _module(tmp_path, "sampler=flow_sde", "advantage=uniform", "train.weighting=guard_released",
                     "train.clip_eps=2e-6", "train.drop_zero_adv=false")  # the smoke policy's rewards are all 0
    res = iteration(module.learner, 0)
    assert res.update["train/steps_trained"] == 4.0 and res.update["train/samples_trained"] == 8.0
    assert math.isfinite(res.update["train/policy_loss"]) and res.update["train/ratio_mean"] == 1.0


# ================================================================================================================
# MixGRPO-Flash in the rollout and the training loop (window.post_solver=dpmpp2m)
# ================================================================================================================
_FLASH = ("sampler=flow_sde", "advantage=uniform", "window=mixgrpo", "window.post_solver=dpmpp2m",
          "train.drop_zero_adv=false")  # the smoke policy's rewards are all 0: keep its rows trained


@pytest.fixture(scope="module")
def _tiny(tmp_path_factory):
    """The tiny shapes policy and an iteration plan of 8 rows (experiment=smoke)."""
    from stepflow.train import build_module

    module = build_module(compose_config("train", ["experiment=smoke"]), tmp_path_factory.mktemp("flash"))
    return module.learner.policy, module.learner.plan.plan(0)


@pytest.mark.parametrize("n,shift,window", [
    (25, 3.0, [0, 1, 2, 3]), (25, 3.0, [5, 6, 7, 8]), (25, 3.0, [19, 20, 21, 22]), (25, 3.0, [21, 22]), (25, 3.0, [0]),
    (10, 1.0, [0, 1, 2, 3]), (10, 1.0, [2, 3, 4, 5]), (10, 1.0, [4, 5, 6, 7])])
@pytest.mark.parametrize("ratio", [0.4, 0.2, 0.8])
def test_a_flash_rollout_is_the_released_sampler_on_the_shapes_policy(_tiny, n, shift, window, ratio):
    """stepflow.core.rollout.rollout(tail=post_tail(...)) against the transcription of run_sample_step above, with the tiny
    shapes transformer as the model and the rollout's own row-seeded noise: the final latent, the states up to the
    window's end, the absent states (NaN, log-prob 0, untrainable), and the NFEs (the policy's counter)."""
    from stepflow.core.data import seeded_normal
    from stepflow.core.rollout import rollout
    from stepflow.math.sde import fastvideo_time_grid
    from stepflow.math.window import post_tail

    policy, plan = _tiny
    shape = tuple(policy.latent_shape)
    grid = fastvideo_time_grid(n, shift)
    torch.testing.assert_close(grid, _fastvideo_grid(n, shift), rtol=0, atol=0)
    cfg = WindowConfig("mixgrpo", post_solver="dpmpp2m", post_compress_ratio=ratio)
    tail = post_tail(cfg, grid, window, shift)
    last = window[-1]
    n0 = policy.nfe
    traj = rollout(policy, plan, SamplerConfig(name="flow_sde", a=0.7), n, 1.0, sde_steps=window, grid=grid, tail=tail)
    b = len(plan)
    assert policy.nfe - n0 == b * (last + 1 + len(tail) - 1)  # the Euler prefix + the window + the tail
    cond = policy.encode(plan.prompts)
    z = seeded_normal(plan.init_noise_seeds, shape, policy.device)
    noises = seeded_normal(plan.step_noise_seeds, (n, *shape), policy.device).transpose(0, 1)  # (T, B, ...)
    det = [i not in window for i in range(n)]
    want, sched = _released_flash_rollout(z.clone(), grid.clone(), det, 0.7, ratio, shift, noises,
                                          velocity=lambda x, s: policy.velocity(x, s, cond, 1.0))
    assert len(tail) == sched.shape[0] - (last + 1)
    torch.testing.assert_close(traj.latents[:, -1], want, rtol=1e-4, atol=2e-5)
    assert traj.depth == n and traj.tail_start == last + 1 and torch.equal(traj.tail_times, tail)
    assert traj.absent_states == list(range(last + 2, n))
    assert torch.isfinite(traj.latents[:, : last + 2]).all() and torch.isfinite(traj.latents[:, -1]).all()
    assert torch.isnan(traj.latents[:, last + 2: n]).all() and torch.isnan(traj.velocities[:, last + 2:]).all()
    assert traj.trainable[:, window].all() and traj.trainable.sum() == b * len(window)
    assert float(traj.log_probs[:, last + 1:].abs().max()) == 0.0
    if len(tail) == 1:  # num_post = 1: no tail step, the final latent is the state after the window (as released)
        assert torch.equal(traj.latents[:, -1], traj.latents[:, last + 1])
        assert torch.isnan(traj.velocities[:, last + 1]).all() and traj.absent_velocities == list(range(last + 1, n))
    else:  # the tail's first evaluation is the velocity at X_{last+1}, which an Euler rollout evaluates too
        torch.testing.assert_close(traj.velocities[:, last + 1],
                                   policy.velocity(traj.latents[:, last + 1], grid[last + 1], cond, 1.0))
        assert float(tail[-1]) == 0.0 and traj.absent_velocities == list(range(last + 2, n))


def test_a_flash_rollout_refuses_what_it_does_not_have(_tiny):
    from stepflow.core.rollout import Trajectory, estimate_states, rollout, score
    from stepflow.math.sde import fastvideo_time_grid
    from stepflow.math.window import post_tail

    policy, plan = _tiny
    grid = fastvideo_time_grid(10, 1.0)
    sampler = SamplerConfig(name="flow_sde", a=0.7)
    tail = post_tail(WindowConfig("mixgrpo", post_solver="dpmpp2m", post_compress_ratio=0.8), grid, [0, 1, 2], 1.0)
    assert post_tail(WindowConfig("mixgrpo", post_solver="dpmpp2m"), grid, [], 1.0) is None  # empty window: Euler
    assert post_tail(WindowConfig("mixgrpo"), grid, [0, 1, 2], 1.0) is None
    with pytest.raises(ValueError, match="tail: MixGRPO-Flash's tail follows the SDE window"):
        rollout(policy, plan, sampler, 10, 1.0, sde_steps=[], grid=grid, tail=tail)
    with pytest.raises(ValueError, match="tail: must be a .* grid starting at grid\\[4\\]"):
        rollout(policy, plan, sampler, 10, 1.0, sde_steps=[0, 1, 2, 3], grid=grid, tail=tail)
    with pytest.raises(ValueError, match="depth must be the whole grid"):
        rollout(policy, plan, sampler, 10, 1.0, depth=5, sde_steps=[0, 1, 2], grid=grid, tail=tail)
    traj = rollout(policy, plan, sampler, 10, 1.0, sde_steps=[0, 1, 2], grid=grid, tail=tail)
    assert traj.absent_states == list(range(4, 10))
    with pytest.raises(ValueError, match=r"states \[4, 9\] .* do not exist; use advantage=uniform"):
        estimate_states(policy, traj, 2, 1.0, states=[1, 4, 9])
    x0 = estimate_states(policy, traj, 2, 1.0, states=[1, 3])  # the states up to the window's end exist
    assert torch.isfinite(x0[:, [1, 3, 10]]).all()
    with pytest.raises(ValueError, match=r"has no states \[4, 5, 6, 7, 8, 9\] to score"):
        score(policy, None, traj, x0)
    with pytest.raises(ValueError, match="different MixGRPO-Flash tails"):
        Trajectory.cat([traj, rollout(policy, plan, sampler, 10, 1.0, sde_steps=[0, 1, 2], grid=grid)])


def test_a_flash_iteration_costs_the_prefix_the_window_and_the_tail(tmp_path):
    """NFEs of the rollout phase = B·(last + 1 + tail steps), against B·T for MixGRPO's Euler tail; the window's steps
    are trained; an empty window rolls out all-Euler and trains nothing; the overlapped phases run the same tail."""
    from stepflow.core.algorithm import iteration
    from stepflow.core.rollout import rollout
    from stepflow.math.solvers import flash_num_post
    from stepflow.rollouts.base import Context
    from stepflow.rollouts.trajectory import post_tail, rollout_and_score_overlapped

    flash = _module(tmp_path / "flash", *_FLASH, "loop.num_steps=10", "window.every=1", "window.post_compress_ratio=0.8")
    euler = _module(tmp_path / "euler", *_FLASH, "loop.num_steps=10", "window.every=1", "window.post_solver=euler")
    lf, le = flash.learner, euler.learner
    assert [lf.window_steps(i) for i in (0, 3, 4, 7, 8)] == [[0, 1, 2, 3], [3, 4, 5, 6], [4, 5, 6, 7], [7], []]
    b = len(lf.plan.plan(0))
    for it in (0, 3, 7, 8):
        window = lf.window_steps(it)
        rf, re_ = iteration(lf, it), iteration(le, it)
        assert re_.phases.nfe["rollout"] == b * 10
        tail_steps = flash_num_post(10, window[-1], 0.8) - 1 if window else None
        want = b * (window[-1] + 1 + tail_steps) if window else b * 10
        # hand: int((10 - last)·0.8) points: it 0 -> 4 + (5 - 1), 3 -> 7 + (3 - 1), 7 -> 8 + (2 - 1), 8 -> all 10 Euler
        assert {0: 8, 3: 9, 7: 9, 8: 10}[it] * b == want
        assert rf.phases.nfe["rollout"] == want and rf.phases.nfe["estimate"] == 0
        assert rf.update["train/steps_trained"] == float(len(window))
        assert math.isfinite(rf.rewards[:, -1].sum().item())
    class _NoPhases:  # the phase timer is not under test here
        def __call__(self, name):
            return contextlib.nullcontext()

    ph = _NoPhases()
    over = _module(tmp_path / "over", *_FLASH, "loop.num_steps=10", "loop.overlap_reward=true", "loop.overlap_chunks=3",
                   "window.post_compress_ratio=0.8")
    lo = over.learner
    grid, sde, plan = lo.grid(), lo.window_steps(0), lo.plan.plan(0)
    tail = post_tail(lo, grid, sde)
    assert len(tail) == 5
    traj, _, _ = rollout_and_score_overlapped(lo, plan, Context(0, grid, sde, sde, need=[10], tail=tail), ph)
    ref = rollout(lo.policy, plan, lo.sampler, 10, lo.guidance, sde_steps=sde, grid=grid, tail=tail)
    torch.testing.assert_close(traj.latents, ref.latents, equal_nan=True, rtol=1e-5, atol=1e-5)  # batch-size rounding
    assert traj.tail_start == 4 and torch.equal(traj.tail_times, tail)


def test_league_mixgrpo_flash_composes_and_flash_settings_are_checked(caplog):
    from stepflow.errors import StepflowError
    from stepflow.train import settings

    s = settings(compose_config("train", ["experiment=league/mixgrpo_flash"]))
    w = s.window
    assert (w.name, w.size, w.every, w.stride, w.roll_back, w.post_solver, w.post_compress_ratio) == (
        "mixgrpo", 4, 20, 1, True, "dpmpp2m", 0.4)
    assert (s.sampler.name, s.sampler.a, s.advantage.scheme, s.objective.name, s.loop.time_grid) == (
        "flow_sde", 0.7, "uniform", "grpo", "fastvideo")
    assert settings(compose_config("train", ["experiment=league/mixgrpo"])).window.post_solver == "euler"
    for overrides, needle in [
        (["advantage=gain"], r"^window\.post_solver=dpmpp2m: .* advantage=gain reads; use advantage=uniform"),
        (["advantage=gain_trained"], r"advantage=uniform or window\.post_solver=euler"),
        (["objective=nft"], r"^window\.post_solver=dpmpp2m: .* not objective=nft; use objective=grpo"),
        (["window.post_solver=dpm"], r"^window\.post_solver: must be one of euler, dpmpp2m"),
        (["window.post_compress_ratio=0"], r"^window\.post_compress_ratio: must be a float > 0"),
    ]:
        with pytest.raises(StepflowError, match=needle) as e:
            settings(compose_config("train", ["experiment=league/mixgrpo_flash", *overrides]))
        assert "\n" not in str(e.value)
    # another window: the experiment's Flash tail belongs to window=mixgrpo; the sliding window does not take it, and
    # says so (a field set by a config file that another option of the group takes is logged, never dropped silently)
    import logging

    from stepflow.core import parts

    parts._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="stepflow.train"):
        w = settings(compose_config("train", ["experiment=league/mixgrpo_flash", "window=sliding"])).window
    assert w.name == "sliding" and w.keeps_states and not hasattr(w, "post_solver")
    assert any("post_solver='dpmpp2m'" in r.getMessage() and "window=sliding" in r.getMessage() for r in caplog.records)


def test_league_mixgrpo_flash_trains(tmp_path):
    """``python -m stepflow.train experiment=league/mixgrpo_flash loop.iterations=2 eval.max_prompts=12``, in-process:
    per iteration 64 rollouts of 4 + 1 NFEs (window [0..3], a one-step tail) and 4 trained steps of 64 rows."""
    import csv

    from stepflow.train import run

    module = run(compose_config("train", ["experiment=league/mixgrpo_flash", "loop.iterations=2",
                                          "eval.max_prompts=12"]), tmp_path)
    assert module.iteration == 2 and module.nfe_total == 2 * (64 * 5 + 4 * 64)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    trained = [float(r["train/steps_trained"]) for r in rows if r.get("train/steps_trained")]
    assert trained == [4.0, 4.0]


def test_the_flash_tail_has_the_rollout_grids_shift(tmp_path):
    """loop.time_grid=fastvideo loop.grid_shift=3 (the released grid): the tail is flash_grid(grid, last, r, 3) past the
    window (the released u = linspace(1, 0, T + 1)[last + 1], shifted by 3), not the shapes model's shift 1."""
    from stepflow.math.solvers import flash_grid
    from stepflow.rollouts.trajectory import post_tail as _post_tail

    lr = _module(tmp_path, *_FLASH, "loop.num_steps=25", "loop.time_grid=fastvideo", "loop.grid_shift=3",
                 "window.post_compress_ratio=0.4").learner
    grid = lr.grid()
    torch.testing.assert_close(grid, _fastvideo_grid(25, 3.0), rtol=0, atol=0)
    tail = _post_tail(lr, grid, [0, 1, 2, 3])
    torch.testing.assert_close(tail, _released_flash_schedule(grid, 3, 0.4, 3.0)[4:], rtol=0, atol=1e-6)
    assert len(tail) == 8 and not torch.allclose(tail, flash_grid(grid, 3, 0.4, 1.0)[4:])
    assert _post_tail(lr, grid, []) is None  # an empty window: all Euler (the release crashes)
