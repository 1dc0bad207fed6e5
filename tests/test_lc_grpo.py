"""LC-GRPO (sampler=lc_langevin, experiment=league/lc_grpo): the Euler predictor + Langevin corrector kernel checked
against a transcription of the paper's equations (arXiv 2608.05600; no code released; the equations as restated in
../shared/spec/followups.md §3.6 L135-140 and a detailed write-up of the paper: x' = x_t − Δt·v(x_t, t);
x_{t−Δt} = x' + ε_t·s(x', t−Δt) + sqrt(2ε_t)·ξ; s(x, t) = −(x + (1−t)·v(x, t))/t; sqrt(2ε_t) = η·(t−Δt);
p(x_{t−Δt} | x_t) = N(x' + ε_t·s, 2ε_t·I); the last step pure ODE; gradients through the corrector; the corrector
without CFG), written here in plain torch independently of stepflow's code; the sampler's capability (2 NFE a step,
counted by the policy's counter like every method's); the recipe; refusals."""

from __future__ import annotations

import math

import pytest
import torch

from stepflow.math.sde import SamplerConfig, sde_step
from stepflow.samplers.lc_langevin import LcLangevin
from stepflow.testing.harness import compose_config, smoke_config


# ---------------------------------------------------------------- the paper's equations, transcribed
def paper_step(x, t, dt, eta, model, xi=None, x_next=None):
    """One LC-GRPO transition from t to t − Δt with the model ``model(x, t)`` (the predictor's and the corrector's
    velocity). Returns (x_next, mean, std, per-dim-mean Gaussian log-prob of x_next)."""
    x_prime = x - dt * model(x, t)  # predictor: the ODE Euler step
    s_next = t - dt
    if s_next == 0:  # the last step: pure ODE
        return x_prime, x_prime, 0.0, None
    score = -(x_prime + (1 - s_next) * model(x_prime, s_next)) / s_next
    eps_t = (eta * s_next) ** 2 / 2  # sqrt(2 ε_t) = η (t − Δt)
    mean = x_prime + eps_t * score
    var = 2 * eps_t
    if x_next is None:
        x_next = mean + math.sqrt(var) * xi
    log_prob = (-(x_next.detach() - mean) ** 2 / (2 * var) - 0.5 * math.log(var) - 0.5 * math.log(2 * math.pi))
    return x_next, mean, math.sqrt(var), log_prob.flatten(1).mean(1)


class Linear(torch.nn.Module):
    """A hand-made velocity model v(x, t) = W x + t·b (per channel), differentiable in W and b."""

    def __init__(self, c=3):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = torch.nn.Parameter(0.3 * torch.randn(c, c, generator=g))
        self.b = torch.nn.Parameter(torch.randn(c, generator=g))
        self.calls, self.guided = 0, []

    def forward(self, x, t):
        t = torch.as_tensor(t, dtype=x.dtype).reshape(-1, 1, 1, 1) if torch.as_tensor(t).ndim else t
        return torch.einsum("ij,bjhw->bihw", self.w, x) + t * self.b.view(1, -1, 1, 1)

    def velocity_fn(self):
        def velocity(z, t, guided=True):
            self.calls += len(z)
            self.guided.append(guided)
            return self(z, t)
        return velocity


@pytest.mark.parametrize("t,dt", [(1.0, 0.1), (0.6, 0.25), (0.3, 0.3)])
def test_the_step_matches_the_papers_equations(t, dt):
    """Mean, std, the sampled state and its log-prob; at s = t − Δt = 0 the pure ODE step (no noise, one NFE)."""
    model = Linear()
    g = torch.Generator().manual_seed(0)
    x, xi = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    with torch.no_grad():
        ref_next, ref_mean, ref_std, ref_lp = paper_step(x, t, dt, 0.7, model, xi=xi)
        out = SamplerConfig("lc_langevin", eta=0.7).step(x, model(x, t), t, t - dt, noise=xi,
                                                         velocity=model.velocity_fn())
    torch.testing.assert_close(out.mean, ref_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.next, ref_next, atol=1e-5, rtol=1e-5)
    assert out.std.tolist() == pytest.approx([ref_std] * 2, abs=1e-6)
    if ref_lp is None:
        assert model.calls == 0 and not bool(out.trainable.any()) and out.log_prob.abs().max() == 0
    else:
        assert model.calls == 2 and model.guided == [False]  # one corrector call (2 rows), without CFG
        torch.testing.assert_close(out.log_prob, ref_lp, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out.kl_scale, out.std)


def test_gradients_flow_through_the_predictor_and_the_corrector():
    """The update's log-prob of the rollout's state differentiates both velocities (the paper's default): its gradient
    in the model's weights equals the transcription's; corrector_grad=false (the stop-grad ablation) differs."""
    model = Linear()
    g = torch.Generator().manual_seed(2)
    x, x_next = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    t, dt = 0.7, 0.2
    _, _, _, ref_lp = paper_step(x, t, dt, 0.7, model, x_next=x_next)
    ref = torch.autograd.grad(ref_lp.sum(), [model.w, model.b])
    sampler = SamplerConfig("lc_langevin", eta=0.7)
    out = sde_step(sampler, x, model(x, t), t, t - dt, prev_sample=x_next, velocity=model.velocity_fn())
    got = torch.autograd.grad(out.log_prob.sum(), [model.w, model.b])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stop = SamplerConfig("lc_langevin", eta=0.7, corrector_grad=False)
    out2 = sde_step(stop, x, model(x, t), t, t - dt, prev_sample=x_next, velocity=model.velocity_fn())
    torch.testing.assert_close(out2.log_prob, out.log_prob)  # the same value ...
    assert not torch.allclose(torch.autograd.grad(out2.log_prob.sum(), [model.w])[0], got[0])  # ... another gradient


def test_a_step_without_the_model_is_a_one_line_error():
    x = torch.zeros(1, 3, 2, 2)
    with pytest.raises(ValueError, match="^velocity: sampler=lc_langevin evaluates the model 2 times a step"):
        sde_step(SamplerConfig("lc_langevin"), x, x, 0.5, 0.4)
    with pytest.raises(ValueError, match="^velocity: sampler=lc_langevin evaluates the model again"):
        SamplerConfig("lc_langevin").step(x, x, 0.5, 0.4)


def test_std_and_capabilities():
    s = SamplerConfig("lc_langevin")
    assert isinstance(s, LcLangevin) and s.nfe_per_step == 2 and s.has_density and s.noise_field == "sampler.eta"
    assert s.eta == 0.7 and not s.corrector_cfg and s.corrector_grad and s.logprob == "gaussian"
    grid = torch.tensor([1.0, 0.75, 0.5, 0.0])
    torch.testing.assert_close(s.std(grid[:-1], grid[1:]), 0.7 * grid[1:])  # η·s; 0 at the last step


@pytest.mark.parametrize("field,value,needle", [
    ("eta", -0.1, "eta: must be a finite float >= 0 for lc_langevin, got -0.1"),
    ("eta", float("inf"), "eta: must be a finite float >= 0 for lc_langevin, got inf"),
    ("corrector_cfg", "no", "corrector_cfg: must be a bool, got 'no'"),
    ("corrector_grad", 1, "corrector_grad: must be a bool, got 1"),
])
def test_field_refusals_name_the_field(field, value, needle):
    with pytest.raises(ValueError) as err:
        SamplerConfig("lc_langevin", **{field: value})
    assert str(err.value) == needle


def test_grpo_guard_is_refused_in_one_line():
    from stepflow.core import requirements
    from stepflow.errors import StepflowError
    from stepflow.train import settings

    with pytest.raises(StepflowError) as err:  # settings() checks the requirements before anything loads
        requirements.check(settings(compose_config("train", ["experiment=league/lc_grpo", "train.weighting=guard"])))
    assert str(err.value) == ("train.weighting=guard: GRPO-Guard's ratio needs the old policy's corrector velocity, "
                              "which sampler=lc_langevin does not keep; use train.weighting=none (or noise)")


# ---------------------------------------------------------------- the loop: NFEs, on-policy ratio, recipe
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_nfes_two_a_step_and_an_on_policy_first_update(tmp_path, finetune, tiny_clip_dir):
    """Rollout B·(2T − 1) NFEs (the last step is the ODE's); the update 2 forwards with gradients per trained (sample,
    step) (+ 2 backwards each, 2 forward-equivalents apiece) and 2 reference forwards for the KL; the first update
    is on-policy (ratio 1: the update's recomputed kernel is the rollout's); LoRA and full fine-tuning both move."""
    from stepflow.train import build_module

    model = (["model=sd3_tiny", "model.finetune=full", "reward=pickscore", f"reward.model_path={tiny_clip_dir}",
              f"reward.processor_path={tiny_clip_dir}", "eval.guidance=1"] if finetune == "full" else [])
    cfg = smoke_config(*model, "sampler=lc_langevin", "advantage=uniform", "loop.num_steps=4", "train.train_steps=null",
                       "train.timestep_fraction=0.99", "train.drop_zero_adv=false", "train.updates_per_iter=1",
                       "train.beta_kl=0.04", "train.lr=1e-2")
    module = build_module(cfg, tmp_path)
    params = dict(module.policy.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
    m = module.iterate()
    b, t, trained = 8, 4, 3
    assert m["train/steps_trained"] == trained
    assert m["cost/nfe_rollout"] == b * (2 * t - 1)
    assert m["cost/nfe_backward"] == b * trained * 2
    assert m["cost/nfe"] == b * (2 * t - 1) + 2 * b * trained * 2  # policy and reference
    assert m["cost/nfe_fwd_equiv"] == m["cost/nfe"] + 2 * m["cost/nfe_backward"]
    assert abs(m["train/ratio_min"] - 1) < 1e-4 and abs(m["train/ratio_max"] - 1) < 1e-4
    assert math.isfinite(m["train/policy_loss"]) and math.isfinite(m["train/grad_norm"])
    if finetune == "full" or m["train/adv_abs_mean_step0"] > 0:
        assert max(float((params[n].detach() - v).abs().max()) for n, v in before.items()) > 0


def test_the_recipe_composes():
    from stepflow.train import settings

    cfg = compose_config("train", ["experiment=league/lc_grpo"])
    s = settings(cfg)
    assert isinstance(s.sampler, LcLangevin) and s.sampler.eta == 0.7 and s.sampler.corrector_grad
    assert s.advantage.name == "uniform" and s.advantage.std_scope == "global"
    assert cfg.loop.num_steps == 10 and cfg.train.timestep_fraction == 0.99 and cfg.train.beta_kl == 0.04
    assert cfg.train.kl_mode == "exact" and cfg.train.clip_eps == 1e-4 and cfg.train.train_steps is None
