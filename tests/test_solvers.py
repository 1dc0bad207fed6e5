"""stepflow.math.solvers (DiffusionNFT's ``dpm2`` rollout sampler) against independent references: diffusers'
``DPMSolverMultistepScheduler`` on a closed-form velocity field, a hand-written transcription of the released code
(NVlabs/DiffusionNFT@24af555 ``flow_grpo/diffusers_patch/solver.py``), the exact ODE solution of Gaussian data, and
``rollout(sampler=dpm2)`` on a tiny policy against the pure solver run by hand."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from stepflow.math.sde import SAMPLERS, SamplerConfig, ode_step, sde_step, step_std, time_grid
from stepflow.math.solvers import (
    ddim0_update,
    dpm2_orders,
    dpm2_second_order_update,
    dpm2_step,
    dpm2_update,
    dpm_order,
    log_snr,
    x0_from_v,
)


# ----------------------------------------------------------------------------------------------------------------
# a hand-written copy of the released code (solver.py of NVlabs/DiffusionNFT@24af555, lines 14-75 and 188-356),
# only without tqdm / torch.distributed, with `trace` recording which update each step took (and lint-clean
# spellings: list[...] for List[...], raise AssertionError for assert False)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class _DPMState:
    order: int
    model_outputs: list[torch.Tensor] = None
    lower_order_nums = 0

    def __post_init__(self):
        self.model_outputs = [None] * self.order

    def update(self, model_output):
        for i in range(self.order - 1):
            self.model_outputs[i] = self.model_outputs[i + 1]
        self.model_outputs[-1] = model_output

    def update_lower_order(self):
        if self.lower_order_nums < self.order:
            self.lower_order_nums += 1


def _ref_sigma_to_alpha_sigma_t(sigma):
    return 1 - sigma, sigma


def _ref_convert_model_output(model_output, sample, sigmas, step_index):
    sigma_t = sigmas[step_index]
    return sample - sigma_t * model_output


def _ref_ddim_update(model_output, sigmas, step_index, sample=None, noise=None, eta=1.0):
    t, s = sigmas[step_index + 1], sigmas[step_index]
    std_dev_t = eta * t
    dt_sqrt = torch.sqrt(1.0 - t**2 * (1 - s) ** 2 / (s**2 * (1 - t) ** 2))
    rho_t = std_dev_t * dt_sqrt
    noise_pred = (sample - (1 - s) * model_output) / s
    if noise is None:
        noise = torch.randn_like(model_output)
    prev_mean = (1 - t) * model_output + torch.sqrt(t**2 - rho_t**2) * noise_pred
    x_t = prev_mean + rho_t * noise
    return x_t, prev_mean, std_dev_t, dt_sqrt


def _ref_dpm_solver_first_order_update(model_output, sigmas, step_index, sample=None):
    sigma_t, sigma_s = sigmas[step_index + 1], sigmas[step_index]
    alpha_t, sigma_t = _ref_sigma_to_alpha_sigma_t(sigma_t)
    alpha_s, sigma_s = _ref_sigma_to_alpha_sigma_t(sigma_s)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s = torch.log(alpha_s) - torch.log(sigma_s)
    h = lambda_t - lambda_s
    return (sigma_t / sigma_s) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * model_output


def _ref_multistep_second_order(model_output_list, sigmas, step_index, sample=None):
    sigma_t, sigma_s0, sigma_s1 = sigmas[step_index + 1], sigmas[step_index], sigmas[step_index - 1]
    alpha_t, sigma_t = _ref_sigma_to_alpha_sigma_t(sigma_t)
    alpha_s0, sigma_s0 = _ref_sigma_to_alpha_sigma_t(sigma_s0)
    alpha_s1, sigma_s1 = _ref_sigma_to_alpha_sigma_t(sigma_s1)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    m0, m1 = model_output_list[-1], model_output_list[-2]
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    D0, D1 = m0, (1.0 / r0) * (m0 - m1)
    return ((sigma_t / sigma_s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * D0
            - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * D1)


def _ref_dpm_step(order, model_output, sample, step_index, timesteps, sigmas, dpm_state, trace):
    lower_order_final = step_index == len(timesteps) - 1
    lower_order_second = (step_index == len(timesteps) - 2) and len(timesteps) < 15
    model_output = _ref_convert_model_output(model_output, sample, sigmas, step_index=step_index)
    dpm_state.update(model_output)
    sample = sample.to(torch.float32)
    if order == 1 or dpm_state.lower_order_nums < 1 or lower_order_final:
        if step_index == 0 or lower_order_final:
            trace.append("ddim")
            prev_sample, _, _, _ = _ref_ddim_update(model_output, sigmas.to(torch.float64), step_index, sample, eta=0.0)
        else:
            trace.append("dpm1")
            prev_sample = _ref_dpm_solver_first_order_update(model_output, sigmas.to(torch.float64), step_index, sample)
    elif order == 2 or dpm_state.lower_order_nums < 2 or lower_order_second:
        trace.append("dpm2")
        prev_sample = _ref_multistep_second_order(dpm_state.model_outputs, sigmas.to(torch.float64), step_index, sample)
    else:
        raise AssertionError  # released: assert False
    dpm_state.update_lower_order()
    return prev_sample.to(model_output.dtype), model_output, None


def _ref_run_sampling_dpm2(v_pred_fn, z, sigma_schedule, trace):
    """run_sampling(v_pred_fn, z, sigma_schedule, solver="dpm2", determistic=True)"""
    dtype = z.dtype
    all_latents = [z]
    dpm_state = _DPMState(order=2)
    for i in range(len(sigma_schedule) - 1):
        sigma = sigma_schedule[i]
        pred = v_pred_fn(z.to(dtype), sigma)
        z, _, _ = _ref_dpm_step(2, pred.float(), z.float(), i, sigma_schedule[:-1], sigma_schedule, dpm_state, trace)
        z = z.to(dtype)
        all_latents.append(z)
    return z, all_latents


# ----------------------------------------------------------------------------------------------------------------
# our solver, run over a grid by hand (what rollout does)
# ----------------------------------------------------------------------------------------------------------------
def _ours(v_fn, x, grid):
    n = grid.shape[0] - 1
    xs, x0_prev = [x], None
    for k in range(n):
        v = v_fn(x, grid[k])
        x0 = x0_from_v(x, v, grid[k])
        x = dpm2_update(x, x0, x0_prev, grid[k - 1] if k else None, grid[k], grid[k + 1], dpm_order(k, n))
        x0_prev = x0
        xs.append(x)
    return xs


def _euler(v_fn, x, grid):
    for k in range(grid.shape[0] - 1):
        x = ode_step(x, v_fn(x, grid[k]), grid[k], grid[k + 1]).next
    return x


# ----------------------------------------------------------------------------------------------------------------
# a closed-form field: Gaussian data x0 ~ N(μ, diag(sd²)), x_t = (1 − t) x0 + t ε
# ----------------------------------------------------------------------------------------------------------------
class _Gaussian:
    """v(x, t) = E[ε − x0 | x_t = x] = (t − a·sd²)(x − a·μ)/var − μ, a = 1 − t, var = a²sd² + t² (fp64 math);
    the probability-flow ODE keeps z = (x − a·μ)/sqrt(var) fixed, so x1 = ε maps to x0 = μ + sd·ε exactly."""

    def __init__(self, sd_lo: float = 0.5, sd_hi: float = 1.5, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.mu = torch.randn(1, 2, 3, 3, generator=g, dtype=torch.float64)
        self.sd = torch.linspace(sd_lo, sd_hi, 18, dtype=torch.float64).view(1, 2, 3, 3)

    def __call__(self, x, t):
        t = float(t)
        a = 1.0 - t
        var = a * a * self.sd**2 + t * t
        return ((t - a * self.sd**2) * (x.double() - a * self.mu) / var - self.mu).float()

    def exact(self, x1):
        return self.mu + self.sd * x1.double()


def _diffusers_dpm2(v_fn, x, num_steps, grid=None):
    """diffusers' multistep DPM-Solver++(2M) for flow matching; ``grid`` (N+1,) replaces its sigmas when given
    (set_timesteps has no ``sigmas=`` here: step() reads only self.sigmas, len(self.timesteps) and the begin index).
    Returns the states and the grid it ran on."""
    sched = DPMSolverMultistepScheduler(num_train_timesteps=1000, solver_order=2, prediction_type="flow_prediction",
                                        algorithm_type="dpmsolver++", solver_type="midpoint", lower_order_final=True,
                                        use_flow_sigmas=True, flow_shift=3.0, final_sigmas_type="zero")
    sched.set_timesteps(num_steps)
    if grid is not None:
        sched.sigmas = grid.clone()
        sched.timesteps = (grid[:-1] * 1000).long()
    sched.set_begin_index(0)
    xs = [x]
    for k in range(num_steps):
        x = sched.step(v_fn(x, sched.sigmas[k]), sched.timesteps[k], x).prev_sample
        xs.append(x)
    return xs, sched.sigmas


# ----------------------------------------------------------------------------------------------------------------
# (a) diffusers
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 10, 14, 15, 20])
def test_matches_diffusers_dpmsolver_on_the_time_grid(num_steps):
    """Same trajectory as diffusers' DPMSolverMultistepScheduler on our SD3 grid (from exactly 1 to 0). With
    solver_order=2 and final_sigmas_type="zero" diffusers' rule is the released one at every N: first order at the
    first step (lower_order_nums < 1) and the last (lower_order_final), second order elsewhere (its
    lower_order_second, for N < 15, only demotes a third-order step)."""
    field = _Gaussian()
    x1 = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(1))
    grid = time_grid(num_steps, shift=3.0)
    ref, _ = _diffusers_dpm2(field, x1, num_steps, grid)
    ours = _ours(field, x1, grid)
    for k, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"state {k}: {m}")


@pytest.mark.parametrize("num_steps", [3, 10, 20])
def test_matches_diffusers_dpmsolver_on_its_own_grid(num_steps):
    """diffusers' own flow-sigma grid starts below 1 (σ_0 = shift(0.999)), so step 1 is a genuine second-order step
    there (with σ_0 = 1, λ(σ_0) = −inf makes D1 = 0); the same trajectory too."""
    field = _Gaussian(0.3, 2.0, seed=3)
    x1 = torch.randn(3, 2, 3, 3, generator=torch.Generator().manual_seed(2))
    ref, grid = _diffusers_dpm2(field, x1, num_steps)
    assert grid[0] < 1.0 and grid[-1] == 0.0
    ours = _ours(field, x1, grid)
    for k, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"state {k}: {m}")
    # and step 1 did use the previous x̂0 (it is not the first-order step)
    x0_0 = x0_from_v(x1, field(x1, grid[0]), grid[0])
    x0_1 = x0_from_v(ours[1], field(ours[1], grid[1]), grid[1])
    first = ddim0_update(ours[1], x0_1, grid[1], grid[2])
    assert not torch.allclose(first, dpm2_update(ours[1], x0_1, x0_0, grid[0], grid[1], grid[2], 2), atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# (b) the released code, transcribed above
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_steps", list(range(1, 21)) + [25, 40])
def test_order_rule_is_the_released_one(num_steps):
    trace = []
    z = torch.randn(2, 3)
    _ref_run_sampling_dpm2(lambda z, s: torch.randn_like(z), z, time_grid(num_steps), trace)
    assert [1 if b == "ddim" else 2 for b in trace] == dpm2_orders(num_steps)
    assert "dpm1" not in trace  # dpm2's first-order steps are all DDIM η = 0
    want = [1] + [2] * (num_steps - 2) + [1] if num_steps > 1 else [1]
    assert dpm2_orders(num_steps) == want
    # lower_order_second (k == N − 2, N < 15) does not demote the second-order solver
    if num_steps >= 3:
        assert dpm_order(num_steps - 2, num_steps) == 2
    assert all(dpm_order(k, num_steps, solver_order=1) == 1 for k in range(num_steps))


def test_order_rule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="solver_order"):
        dpm_order(0, 4, solver_order=3)
    with pytest.raises(ValueError, match="k: "):
        dpm_order(4, 4)
    with pytest.raises(ValueError, match="num_steps"):
        dpm_order(0, 0)
    with pytest.raises(ValueError, match="needs the previous"):
        dpm2_update(torch.zeros(1, 2), torch.zeros(1, 2), None, None, 0.5, 0.4, 2)
    with pytest.raises(ValueError, match="order"):
        dpm2_update(torch.zeros(1, 2), torch.zeros(1, 2), None, None, 0.5, 0.4, 3)


def _random_grid(n, seed):
    g = torch.Generator().manual_seed(seed)
    inner = torch.sort(torch.rand(n - 1, generator=g) * 0.98 + 0.01, descending=True).values
    return torch.cat([torch.ones(1), inner, torch.zeros(1)])


@pytest.mark.parametrize("num_steps,grid_kind", [(1, "sd3"), (2, "sd3"), (3, "sd3"), (10, "sd3"), (16, "sd3"),
                                                 (6, "random"), (12, "random"), (10, "below_one")])
def test_matches_the_released_code_on_random_tensors(num_steps, grid_kind):
    """A random 'model' (a fresh random velocity at every step, any shape) through the transcription of
    run_sampling(solver="dpm2", determistic=True) and through ours: the same states."""
    if grid_kind == "sd3":
        grid = time_grid(num_steps, shift=3.0)
    elif grid_kind == "random":
        grid = _random_grid(num_steps, seed=num_steps)
    else:  # a grid that starts below 1: step 1 is a genuine second-order step
        grid = torch.linspace(0.97, 0.0, num_steps + 1)
    g = torch.Generator().manual_seed(7)
    vs = [torch.randn(3, 4, 5, 5, generator=g) * 2 for _ in range(num_steps)]
    z = torch.randn(3, 4, 5, 5, generator=g)
    calls = iter(range(num_steps))
    _, ref = _ref_run_sampling_dpm2(lambda z, s: vs[next(calls)], z, grid, [])
    calls = iter(range(num_steps))
    ours = _ours(lambda x, t: vs[next(calls)], z, grid)
    for k, (a, b) in enumerate(zip(ours, ref)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"state {k}: {m}")


def test_one_second_order_step_written_out():
    """The midpoint formula with λ = log((1 − σ)/σ), at python-float times, against plain math."""
    t_prev, t, s = 0.8, 0.6, 0.35
    x, m0, m1 = torch.randn(2, 7), torch.randn(2, 7), torch.randn(2, 7)
    lam = lambda u: math.log((1 - u) / u)  # noqa: E731
    h, h0 = lam(s) - lam(t), lam(t) - lam(t_prev)
    r0 = h0 / h
    c = (1 - s) * (math.exp(-h) - 1)
    want = (s / t) * x - c * m0 - 0.5 * c * (m0 - m1) / r0
    torch.testing.assert_close(dpm2_second_order_update(x, m0, m1, t_prev, t, s), want, rtol=1e-6, atol=1e-6)
    assert log_snr(1.0) == -math.inf and log_snr(0.0) == math.inf and abs(float(log_snr(0.25)) - math.log(3)) < 1e-12


def test_edges_sigma_one_and_zero():
    """σ = 1 (λ = −inf) at the previous point: r0 = inf, D1 = 0 — the second-order update is the first-order one.
    σ = 0 (λ = +inf) at the next point: the second-order update is not finite (r0 = 0), which is why the released
    code (and dpm_order) takes the first-order DDIM step there, which lands exactly on x̂0."""
    x, m0, m1 = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(dpm2_second_order_update(x, m0, m1, 1.0, 0.7, 0.4), ddim0_update(x, m0, 0.7, 0.4),
                               rtol=1e-6, atol=1e-6)
    assert not torch.isfinite(dpm2_second_order_update(x, m0, m1, 0.5, 0.2, 0.0)).all()
    assert torch.equal(ddim0_update(x, m0, 0.2, 0.0), m0)
    v = torch.randn(3, 5)
    # the first step from t = 1: DDIM η=0 = Euler
    torch.testing.assert_close(ddim0_update(x, x0_from_v(x, v, 1.0), 1.0, 0.9), x - 0.1 * v, rtol=1e-6, atol=1e-6)


def test_per_sample_times_batch_steps_of_different_indices():
    """Times as (B,) tensors: each row as its own scalar-time call."""
    grid = time_grid(10, shift=3.0)
    ks = torch.tensor([1, 4, 8])
    x, m0, m1 = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    out = dpm2_second_order_update(x, m0, m1, grid[ks - 1], grid[ks], grid[ks + 1])
    out1 = ddim0_update(x, m0, grid[ks], grid[ks + 1])
    for i, k in enumerate(ks.tolist()):
        torch.testing.assert_close(out[i:i + 1], dpm2_second_order_update(x[i:i + 1], m0[i:i + 1], m1[i:i + 1],
                                                                          grid[k - 1], grid[k], grid[k + 1]))
        torch.testing.assert_close(out1[i:i + 1], ddim0_update(x[i:i + 1], m0[i:i + 1], grid[k], grid[k + 1]))


# ----------------------------------------------------------------------------------------------------------------
# (c) second order beats Euler against the exact ODE solution
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sd", [(0.5, 1.5), (0.2, 2.0), (1.0, 1.0)])
@pytest.mark.parametrize("num_steps", [5, 10, 20])
def test_second_order_is_more_accurate_than_euler(sd, num_steps):
    """On a uniform grid, dpm2's final state is closer to the exact x0 = μ + sd·x1 than Euler's at equal steps.
    (On SD3's shifted grid with its tiny σ_{N−1} ≈ σ_min the released rule's second-order step N−2 extrapolates
    x̂0 far in λ and, on this field, can do worse than Euler for N ≲ 20: not asserted here.)"""
    field = _Gaussian(*sd)
    x1 = torch.randn(8, 2, 3, 3, generator=torch.Generator().manual_seed(5))
    grid = torch.linspace(1.0, 0.0, num_steps + 1)
    exact = field.exact(x1)
    err2 = (_ours(field, x1, grid)[-1].double() - exact).abs().max()
    err1 = (_euler(field, x1, grid).double() - exact).abs().max()
    assert err2 < 0.75 * err1, (float(err2), float(err1))


def test_dpm2_converges_faster_than_euler():
    field = _Gaussian()
    x1 = torch.randn(8, 2, 3, 3, generator=torch.Generator().manual_seed(6))
    exact = field.exact(x1)
    err = {n: ((_ours(field, x1, torch.linspace(1.0, 0.0, n + 1))[-1].double() - exact).abs().max(),
               (_euler(field, x1, torch.linspace(1.0, 0.0, n + 1)).double() - exact).abs().max()) for n in (10, 40)}
    assert err[10][1] / err[40][1] < 4.5  # Euler: first order (≈ 4×)
    assert err[10][0] / err[40][0] > 6.0  # dpm2: well beyond first order


# ----------------------------------------------------------------------------------------------------------------
# sde.py: the registered name
# ----------------------------------------------------------------------------------------------------------------
def test_sampler_name_is_registered_and_deterministic():
    assert "dpm2" in SAMPLERS
    cfgs = [SamplerConfig("dpm2")]
    assert cfgs[0].logprob == "gaussian"
    assert cfgs[0].multistep and not cfgs[0].has_density and cfgs[0].noise_field is None
    for field, value in dict(a=0.1, eta=0.3, schedule="eta_s", first_step_guard=True).items():  # none is dpm2's
        with pytest.raises(ValueError, match=f"^{field}: sampler=dpm2 takes no field"):
            SamplerConfig("dpm2", **{field: value})
    grid = time_grid(6, shift=3.0)
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    for cfg in cfgs:
        assert torch.equal(step_std(cfg, grid[:-1], grid[1:]), torch.zeros(6))
        for k in range(6):
            out, ode = sde_step(cfg, x, v, grid[k], grid[k + 1], t_guard=grid[1]), ode_step(x, v, grid[k], grid[k + 1])
            assert torch.equal(out.next, ode.next) and not out.trainable.any()
            assert torch.equal(out.log_prob, ode.log_prob)
    out = dpm2_step(x, v, grid[2], grid[3], order=2, x0_prev=torch.randn_like(x), t_prev=grid[1])
    assert out.std.shape == out.log_prob.shape == out.trainable.shape == (2,)
    assert not out.trainable.any() and torch.equal(out.log_prob, torch.zeros(2)) and torch.equal(out.next, out.mean)


# ----------------------------------------------------------------------------------------------------------------
# (d) rollout on a tiny policy
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_policy():
    from stepflow.policies.shapes import ShapesPolicy

    torch.manual_seed(0)
    return ShapesPolicy.build(num_layers=1, num_attention_heads=2, attention_head_dim=8, text_dim=16, text_layers=1,
                              text_heads=2, pooled_dim=16, init="default", image_size=16, shift=3.0)


def _plan():
    from stepflow.core.data import IterationPlan

    seeds = torch.arange(3)
    return IterationPlan(["a photo of a red circle", "a blue square on the green", "a red circle"], [{}] * 3,
                         torch.tensor([0, 1, 2]), seeds + 11, seeds)


@pytest.mark.parametrize("num_steps", [1, 2, 6])
def test_rollout_dpm2_equals_the_solver_by_hand(tiny_policy, num_steps):
    from stepflow.core.data import seeded_normal
    from stepflow.core.rollout import rollout

    pol, plan = tiny_policy, _plan()
    traj = rollout(pol, plan, SamplerConfig("dpm2"), num_steps, 1.0)
    assert traj.latents.shape == (3, num_steps + 1, *pol.latent_shape)
    assert torch.isfinite(traj.latents).all()
    assert torch.equal(traj.log_probs, torch.zeros(3, num_steps)) and not traj.trainable.any()
    cond = pol.encode(plan.prompts)
    grid = pol.time_grid(num_steps)
    x = seeded_normal(plan.init_noise_seeds, tuple(pol.latent_shape))
    with torch.no_grad():
        xs = _ours(lambda x, t: pol.velocity(x, t, cond, 1.0), x, grid)
    torch.testing.assert_close(traj.latents, torch.stack(xs, 1), rtol=0, atol=0)
    with torch.no_grad():
        v = torch.stack([pol.velocity(xs[k], grid[k], cond, 1.0) for k in range(num_steps)], 1)
    torch.testing.assert_close(traj.velocities, v, rtol=0, atol=0)
    if num_steps >= 3:  # a second-order rollout, not the Euler one
        euler = rollout(pol, plan, SamplerConfig("ode"), num_steps, 1.0)
        assert not torch.allclose(euler.latents[:, -1], traj.latents[:, -1], atol=1e-5)


def test_rollout_dpm2_window_and_depth(tiny_policy):
    """With sde_steps, steps outside take the Euler step; a dpm2 step inside uses the x̂0 of the state before it and
    the order of its grid index. depth stops early with the same states."""
    from stepflow.core.rollout import rollout

    pol, plan, n = tiny_policy, _plan(), 6
    window = [2, 3]
    traj = rollout(pol, plan, SamplerConfig("dpm2"), n, 1.0, sde_steps=window)
    cond = pol.encode(plan.prompts)
    grid = pol.time_grid(n)
    lat = traj.latents
    with torch.no_grad():
        for k in range(n):
            v = pol.velocity(lat[:, k], grid[k], cond, 1.0)
            if k in window:
                x0_prev = x0_from_v(lat[:, k - 1], traj.velocities[:, k - 1], grid[k - 1])
                want = dpm2_update(lat[:, k], x0_from_v(lat[:, k], v, grid[k]), x0_prev, grid[k - 1], grid[k],
                                   grid[k + 1], 2)
            else:
                want = ode_step(lat[:, k], v, grid[k], grid[k + 1]).next
            torch.testing.assert_close(lat[:, k + 1], want, rtol=0, atol=0, msg=lambda m, k=k: f"step {k}: {m}")
    assert not traj.trainable.any() and torch.equal(traj.log_probs, torch.zeros(3, n))
    short = rollout(pol, plan, SamplerConfig("dpm2"), n, 1.0, depth=3)
    full = rollout(pol, plan, SamplerConfig("dpm2"), n, 1.0)
    assert short.depth == 3 and torch.equal(short.latents, full.latents[:, :4])


def test_rollout_other_samplers_unchanged(tiny_policy):
    """The Euler rollout is still ode_step at every state (the dpm2 branch does not touch other samplers)."""
    from stepflow.core.rollout import rollout

    pol, plan, n = tiny_policy, _plan(), 4
    traj = rollout(pol, plan, SamplerConfig("ode"), n, 1.0)
    cond = pol.encode(plan.prompts)
    grid = pol.time_grid(n)
    with torch.no_grad():
        for k in range(n):
            v = pol.velocity(traj.latents[:, k], grid[k], cond, 1.0)
            want = ode_step(traj.latents[:, k], v, grid[k], grid[k + 1]).next
            torch.testing.assert_close(traj.latents[:, k + 1], want, rtol=0, atol=0)
