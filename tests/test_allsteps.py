"""Credit for every step: SDE windows, per-step loss weighting and automatic step weighting, each against its
closed form or an independent computation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from stepflow.math.coherence import StepSignal, pair_sums, signal_fraction
from stepflow.math.loss import gain_variance_weights, guard_log_ratio, noise_weights, rms_weights
from stepflow.math.window import WindowConfig, window_steps
from stepflow.testing.harness import compose_config


# ------------------------------------------------------------------------------------------------ windows
def test_window_kinds():
    assert window_steps(WindowConfig("none"), 5, 10) is None
    assert window_steps(WindowConfig("fixed", start=2, size=3), 7, 10) == [2, 3, 4]
    sl = WindowConfig("sliding", start=0, size=3, stride=2, every=5)
    assert [window_steps(sl, it, 10)[0] for it in (0, 4, 5, 14, 15, 100)] == [0, 0, 2, 4, 6, 7]  # held at T - size
    rnd = WindowConfig("random", start=1, size=4)
    draws = [window_steps(rnd, it, 10, seed=3) for it in range(20)]
    assert all(len(d) == 4 and len(set(d)) == 4 and min(d) >= 1 and max(d) <= 9 and d == sorted(d) for d in draws)
    assert draws == [window_steps(rnd, it, 10, seed=3) for it in range(20)]  # a pure function: a resume redraws them
    assert len({tuple(d) for d in draws}) > 10 and draws != [window_steps(rnd, it, 10, seed=4) for it in range(20)]
    with pytest.raises(ValueError, match="do not fit"):
        window_steps(WindowConfig("fixed", start=8, size=3), 0, 10)
    with pytest.raises(ValueError, match="kind"):
        WindowConfig("bogus")


#: each built-in window: its class, its YAML's fields (= the class's defaults), union(10), keeps_states, and the
#: smallest grid it fits (check(T) passes at T, raises the fit message below)
WINDOW_BUILT_INS = {
    "none": ("NoWindow", {}, None, True, 1),
    "fixed": ("Fixed", dict(start=0, size=3), [0, 1, 2], True, 3),
    "sliding": ("Sliding", dict(start=0, size=3, stride=1, every=10), list(range(10)), True, 3),
    "random": ("Random", dict(start=0, size=3), list(range(10)), True, 3),
    "random_start": ("RandomStart", dict(start=0, end=5, size=3), [0, 1, 2, 3, 4], True, 5),
    "mixgrpo": ("MixGrpo", dict(start=0, size=4, stride=1, every=25, roll_back=True, post_solver="euler",
                                post_compress_ratio=0.4), list(range(8)), True, 3),
}


@pytest.mark.parametrize("kind", sorted(WINDOW_BUILT_INS))
def test_each_built_in_window_is_its_yaml_target(kind):
    """WindowConfig(kind) builds conf/window/<kind>.yaml's _target_ with the YAML's fields (the class's defaults);
    union, keeps_states and check of each built-in; a field it does not take is a one-line error."""
    import dataclasses

    from omegaconf import OmegaConf

    import stepflow.windows as windows
    from stepflow.math.sde import CONF_DIR
    from stepflow.math.window import WINDOWS

    cls_name, fields, union, keeps, smallest = WINDOW_BUILT_INS[kind]
    cls = getattr(windows, cls_name)
    yaml = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "window" / f"{kind}.yaml"))
    assert "kind" not in yaml and yaml.pop("_target_") == f"{cls.__module__}.{cls.__qualname__}" and yaml == fields
    w = WindowConfig(kind)
    assert type(w) is cls and isinstance(w, windows.Window) and w == cls() and dataclasses.asdict(w) == fields
    assert (w.name, w.describe(), w.union(10), w.keeps_states) == (kind, kind, union, keeps)
    assert kind in WINDOWS and set(WINDOWS) == set(WINDOW_BUILT_INS)
    w.check(smallest)
    assert w.tail(torch.linspace(1, 0, 11), w.steps(0, 10, 0), 1.0) is None  # only a dpmpp2m post_solver has a tail
    if smallest > 1:
        with pytest.raises(ValueError) as err:
            w.check(smallest - 1)
        msg = str(err.value)
        assert msg.startswith("window.") and "\n" not in msg and msg == _first_error(w, smallest - 1)
    with pytest.raises(ValueError, match=f"^bogus: window={kind} takes no field 'bogus'"):
        WindowConfig(kind, bogus=1)


def _first_error(w, num_steps: int) -> str:
    try:
        window_steps(w, 0, num_steps, 0)
    except ValueError as e:
        return str(e)
    raise AssertionError("no error")


def test_window_union_holds_every_step_drawn():
    """union(T) is every step the window can hold over a run: each iteration's steps lie in it (and for the
    deterministic windows the run reaches all of it)."""
    cases = [WindowConfig("fixed", start=2, size=3), WindowConfig("sliding", start=1, size=3, stride=2, every=5),
             WindowConfig("random", start=1, size=4), WindowConfig("random_start", start=0, end=5, size=3),
             WindowConfig("random_start", start=4, size=2, end=None),
             WindowConfig("mixgrpo", size=4, every=3, stride=1, roll_back=True),
             WindowConfig("mixgrpo", start=2, size=3, every=2, stride=2, roll_back=False)]
    for w in cases:
        union = w.union(10)
        seen = set()
        for it in range(400):
            steps = window_steps(w, it, 10, seed=5)
            assert set(steps) <= set(union), (w, it, steps, union)
            seen |= set(steps)
        assert seen == set(union), (w, sorted(seen), union)
    assert WindowConfig("random_start", start=2, end=30).union(10) == list(range(2, 10))  # cut at the grid's end
    assert WindowConfig("none").union(10) is None and window_steps(WindowConfig("none"), 3, 10) is None


def test_window_keeps_states_and_tail_follow_the_post_solver():
    """Only MixGRPO-Flash's dpmpp2m post_solver leaves the grid after the window (keeps_states False, a tail); a
    post_solver is MixGRPO's field only."""
    from stepflow.math.solvers import flash_grid

    grid = torch.linspace(1, 0, 11)
    flash = WindowConfig("mixgrpo", post_solver="dpmpp2m", post_compress_ratio=0.5)
    assert not flash.keeps_states and WindowConfig("mixgrpo").keeps_states
    torch.testing.assert_close(flash.tail(grid, [2, 3], 1.0), flash_grid(grid, 3, 0.5, 1.0)[4:], rtol=0, atol=0)
    assert flash.tail(grid, [], 1.0) is None and flash.tail(grid, None, 1.0) is None
    for kind in ("none", "fixed", "sliding", "random", "random_start"):
        with pytest.raises(ValueError, match=f"^post_solver: window={kind} takes no field"):
            WindowConfig(kind, post_solver="dpmpp2m")
    with pytest.raises(ValueError, match="^post_solver: must be one of euler, dpmpp2m"):
        WindowConfig("mixgrpo", post_solver="dpm")


def test_a_window_of_ones_own_is_a_subclass():
    """A researcher's window: a Window subclass (its name defaults to the class name); check() defaults to what its
    first iteration's steps raise, tail to None, keeps_states to True."""
    from stepflow.windows import Window

    class EveryOther(Window):
        def steps(self, iteration, num_steps, seed=0):
            if num_steps < 2:
                raise ValueError(f"window.num_steps: needs 2 steps, got {num_steps}")
            return list(range(iteration % 2, num_steps, 2))

        def union(self, num_steps):
            return list(range(num_steps))

    w = EveryOther()
    assert (w.name, w.describe(), w.keeps_states, w.tail(torch.zeros(3), [0], 1.0)) == (
        "everyother", "everyother", True, None)
    assert window_steps(w, 1, 6) == [1, 3, 5]
    w.check(2)
    with pytest.raises(ValueError, match="^window.num_steps"):
        w.check(1)


def test_random_start_window_is_flow_grpo_fasts():
    """Flow-GRPO-Fast's window: ``start = random.randint(lo, hi - size)`` (both ends included), ``size`` consecutive
    steps, so with window_range (0, 5) and size 3 exactly the windows 0-2, 1-3, 2-4 occur, each about a third of the
    time; a pure function of (seed, iteration)."""
    fast = WindowConfig("random_start", start=0, end=5, size=3)
    draws = [window_steps(fast, it, 10, seed=1) for it in range(300)]
    assert {tuple(d) for d in draws} == {(0, 1, 2), (1, 2, 3), (2, 3, 4)}
    counts = [sum(d[0] == s for d in draws) for s in range(3)]
    assert all(70 <= c <= 130 for c in counts), counts  # binomial(300, 1/3): sd 8.2
    assert draws == [window_steps(fast, it, 10, seed=1) for it in range(300)]
    assert draws != [window_steps(fast, it, 10, seed=2) for it in range(300)]
    assert {tuple(window_steps(WindowConfig("random_start", start=4, size=2, end=None), it, 10))
            for it in range(200)} == {(k, k + 1) for k in range(4, 9)}  # end null = T
    with pytest.raises(ValueError, match="end: must be null or an integer >= start \\+ size"):
        WindowConfig("random_start", start=3, end=5, size=3)
    with pytest.raises(ValueError, match="past the 10-step grid"):
        window_steps(WindowConfig("random_start", start=0, end=12, size=3), 0, 10)


def test_a_window_rolls_out_with_the_ode_outside_and_trains_only_inside(tmp_path):
    from stepflow.core.algorithm import iteration
    from stepflow.core.rollout import rollout
    from stepflow.train import build_module

    module = build_module(compose_config("train", ["experiment=smoke", "sampler=flow_sde", "train.train_steps=null",
                                                   "window=fixed", "window.start=1", "window.size=2"]), tmp_path)
    learner = module.learner
    learner.optimizer = module._own_optimizer()
    plan = learner.plan.plan(0)
    traj = rollout(learner.policy, plan, learner.sampler, 4, 1.0, sde_steps=[1, 2])
    assert traj.trainable[:, [1, 2]].all() and not traj.trainable[:, [0, 3]].any()
    assert float(traj.log_probs[:, [0, 3]].abs().max()) == 0.0
    # step 0 is the ODE's: X_1 = X_0 - dt v(X_0)
    v0 = traj.velocities[:, 0]
    torch.testing.assert_close(traj.latents[:, 1], traj.latents[:, 0] - (traj.times[0] - traj.times[1]) * v0)
    res = iteration(learner, 0)
    assert res.update["train/steps_trained"] == 2.0


def test_window_config_errors_are_one_line():
    from stepflow.errors import StepflowError
    from stepflow.train import build_module

    with pytest.raises(StepflowError, match="window.*do not fit"):
        build_module(compose_config("train", ["experiment=smoke", "window=fixed", "window.start=3", "window.size=3"]),
                     "/tmp/stepflow_window")


# ------------------------------------------------------------------------------------------------ weights
def test_noise_weights_are_the_normalised_step_std():
    std = torch.tensor([0.8, 0.4, 0.2, 0.1])
    torch.testing.assert_close(noise_weights(std), std / 0.375)
    assert float(noise_weights(std).mean()) == pytest.approx(1.0)


def test_gain_variance_weights():
    g = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 0.0, 0.0], [3.0, 0.0, -2.0]])
    var = torch.tensor([8 / 3, 0.0, 8 / 3])  # population variances of the columns
    torch.testing.assert_close(gain_variance_weights(g), var / var.mean())
    torch.testing.assert_close(gain_variance_weights(torch.zeros(4, 2)), torch.ones(2))


def test_rms_weights_give_every_step_the_rms_norm():
    norms = torch.tensor([2e-4, 5e-3, 5.6e-2])
    w = rms_weights(norms)
    rms = math.sqrt(float((norms.double() ** 2).mean()))
    torch.testing.assert_close((w * norms).double(), torch.full((3,), rms, dtype=torch.float64), rtol=1e-6, atol=0)
    assert float(rms_weights(torch.tensor([0.0, 1.0]))[0]) == 0.0


def test_guard_log_ratio_closed_form_and_no_one_over_sigma():
    """GRPO-Guard: s·(log π_new − log π_old) + mean((μ_new − μ_old)²)/(2s) with the Gaussian per-dim-mean log-prob of
    torch.distributions equals mean(ε·(μ_new − μ_old)); its gradient w.r.t. μ_new does not grow like 1/s."""
    from torch.distributions import Normal

    g = torch.Generator().manual_seed(0)
    mu_old = torch.randn(3, 2, 4, 4, generator=g)
    d = 0.01 * torch.randn(3, 2, 4, 4, generator=g)
    s = torch.tensor([0.5, 0.05, 0.005])
    x = mu_old + s.view(-1, 1, 1, 1) * torch.randn(3, 2, 4, 4, generator=g)
    mu_new = (mu_old + d).requires_grad_(True)
    sb = s.view(-1, 1, 1, 1)
    lp_new = Normal(mu_new.double(), sb.double()).log_prob(x.double()).mean(dim=(1, 2, 3))
    lp_old = Normal(mu_old.double(), sb.double()).log_prob(x.double()).mean(dim=(1, 2, 3))
    ref = s.double() * (lp_new - lp_old) + (d.double() ** 2).mean(dim=(1, 2, 3)) / (2 * s.double())
    got = guard_log_ratio(x, mu_new, mu_old, s)
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-4, atol=1e-7)
    (grad,) = torch.autograd.grad(got.sum(), mu_new)
    norms = grad.flatten(1).norm(dim=1)
    assert float(norms.max() / norms.min()) < 3  # ε has unit scale at every noise level; the plain ratio's is 1/s
    assert float(guard_log_ratio(x, mu_new, mu_old, torch.zeros(3)).detach().abs().max()) == 0.0


# ------------------------------------------------------------------------------------------------ auto steps
def _measure(mu: Tensor, groups: int, noise: float, g: torch.Generator) -> float:
    """One measurement of a step with expected gradient ``mu`` from ``groups`` parts of noise std ``noise``."""
    m = torch.stack([mu + torch.randn(len(mu), generator=g) * noise for _ in range(groups)]).double()
    r = StepSignal.ratio(*pair_sums(m).tolist())
    assert r == pytest.approx(signal_fraction(m), rel=1e-9, abs=1e-12)  # the same estimate, written once before
    return r


def test_step_signal_estimates_the_signal_fraction_and_weights_coherent_steps():
    """Parts of a batch: m_i = μ + noise; the estimate converges to ρ = |μ|²/(|μ|² + σ²D) per step, and the weights
    are the closed form sqrt(ρ)/(1 − ρ), normalised (the shrinkage does nothing when the steps clearly differ)."""
    g = torch.Generator().manual_seed(0)
    d = 400
    mu = {0: torch.randn(d, generator=g) * 0.3, 1: torch.randn(d, generator=g) * 0.05, 2: torch.zeros(d)}
    sig = StepSignal([0, 1, 2], warmup=2)
    torch.testing.assert_close(sig.weights(), torch.full((3,), 1 / 3, dtype=torch.float64))  # before the warm-up
    for _ in range(200):
        sig.add([0, 1, 2], [_measure(mu[k], 4, 0.1, g) for k in (0, 1, 2)])
    want = torch.tensor([float(mu[k] @ mu[k]) / (float(mu[k] @ mu[k]) + 0.01 * d) for k in (0, 1, 2)])
    torch.testing.assert_close(sig.rho().float(), want, atol=0.02, rtol=0)
    w = sig.weights()
    r = want.clamp(min=0).double()
    closed = r.sqrt() / (1 - r)
    torch.testing.assert_close(w, closed / closed.sum(), atol=0.03, rtol=0)
    assert float(w.sum()) == pytest.approx(1.0) and float(w[0]) > 0.6 and float(w[2]) < 0.05
    state = sig.state_dict()
    again = StepSignal([0, 1, 2])
    again.load_state_dict(state)
    torch.testing.assert_close(again.weights(), sig.weights())
    with pytest.raises(ValueError, match="older stepflow"):
        again.load_state_dict({"steps": [0], "dot": torch.zeros(1), "sq": torch.zeros(1), "measurements": 1})


def test_step_signal_shrinkage_is_the_empirical_bayes_posterior_mean():
    """Cochran's Q, its χ² 95 % point (against the tabulated 5.991 and 11.070 for 2 and 5 degrees of freedom) and ρ̃_k = ρ̄ + τ²/(τ² + s_k²)(ρ̂_k − ρ̄) with DerSimonian–Laird's τ², on hand-set measurements."""
    sig = StepSignal([0, 1, 2], warmup=2)
    meas = {0: [0.30, 0.28, 0.32, 0.29], 1: [0.05, 0.00, 0.10, 0.06], 2: [-0.02, 0.02, 0.00, 0.01]}
    for i in range(4):
        sig.add([0, 1, 2], [meas[k][i] for k in (0, 1, 2)])
    x = torch.tensor([meas[k] for k in (0, 1, 2)], dtype=torch.float64)
    rho, se2 = x.mean(1), x.var(1) / 4
    p = 1 / se2
    q = float((p * (rho - (p * rho).sum() / p.sum()).pow(2)).sum())
    tau2 = (q - 2) / float(p.sum() - p.pow(2).sum() / p.sum())
    torch.testing.assert_close(sig.rho(), rho)
    torch.testing.assert_close(sig.stderr().pow(2), se2)
    got_q, q95, got_tau2 = sig.heterogeneity()
    assert got_q == pytest.approx(q) and q > q95 == pytest.approx(5.9915, abs=1e-3)  # χ²(2) 95 %: 5.991
    assert got_tau2 == pytest.approx(tau2)
    torch.testing.assert_close(sig.shrunk(), rho.mean() + tau2 / (tau2 + se2) * (rho - rho.mean()))
    six = StepSignal(list(range(6)), warmup=2)
    for _ in range(2):
        six.add(list(range(6)), [0.0] * 6)
    assert six.heterogeneity()[1] == pytest.approx(11.0705, abs=1e-3)
    same = StepSignal([0, 1, 2], warmup=2)  # estimates within their noise: τ² = 0, every ρ̃ is the mean
    for r in ([0.1, 0.0, 0.05], [0.0, 0.1, 0.05]):
        same.add([0, 1, 2], r)
    assert same.heterogeneity()[2] == 0.0
    torch.testing.assert_close(same.shrunk(), same.rho().mean().expand(3))


def test_step_signal_keeps_noise_steps_uniform():
    """Every step pure noise (ρ = 0), 20 runs of 30 measurements: the estimates scatter, and the weights stay uniform
    in all but the few runs whose scatter passes the 5 % test (the threshold rule this replaced put all weight on one
    or two steps in every run)."""
    g = torch.Generator().manual_seed(3)
    uniform = 0
    for _ in range(20):
        sig = StepSignal(list(range(9)), warmup=3)
        for _ in range(30):
            sig.add(list(range(9)), [_measure(torch.zeros(200), 4, 1.0, g) for _ in range(9)])
        assert float(sig.rho().abs().max()) > 0.002  # the raw estimates do differ
        w = sig.weights()
        uniform += float(w.max() / w.min()) < 1.0001
    assert uniform >= 16


def test_grad_rms_update_combines_each_steps_gradient_at_the_rms_norm(tmp_path, monkeypatch):
    """train.weighting=grad_rms: the optimizer sees Σ_k (rms/|g_k|)·g_k / S, with g_k each step's own loss gradient
    (computed here independently with step_loss and autograd)."""
    from stepflow.core.algorithm import step_loss, update
    from stepflow.core.rollout import rollout
    from stepflow.train import build_module

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    module = build_module(compose_config("train", ["experiment=smoke", "sampler=flow_sde", "train.train_steps=null",
                                                   "train.weighting=grad_rms", "train.max_grad_norm=0",
                                                   "reward=pickscore_tiny"]), tmp_path)
    learner = module.learner
    traj = rollout(learner.policy, learner.plan.plan(0), learner.sampler, 4, 1.0)
    adv = torch.randn(traj.batch_size, 4, generator=torch.Generator().manual_seed(1))
    params = list(learner.policy.trainable_parameters())
    steps = [0, 1, 2]
    rows = torch.arange(traj.batch_size)
    learner.policy.train()
    ref_g = []
    for k in steps:
        gs = torch.autograd.grad(step_loss(learner, traj, adv, k, rows, traj.times)["loss"], params, allow_unused=True)
        ref_g.append(torch.cat([(x if x is not None else torch.zeros_like(p)).flatten() for x, p in zip(gs, params)]))
    norms = torch.stack([g.norm() for g in ref_g]).double()
    rms = norms.pow(2).mean().sqrt()
    want = sum((rms / n) * g.double() for n, g in zip(norms, ref_g)) / len(steps)

    class Capture:  # the optimizer: records the gradient it is given
        def zero_grad(self, set_to_none=True):
            for p in params:
                p.grad = None

        def step(self):
            self.g = torch.cat([p.grad.flatten() for p in params]).double()

    learner.optimizer = Capture()
    update(learner, traj, adv, None, 0, steps)
    torch.testing.assert_close(learner.optimizer.g, want, rtol=1e-4, atol=1e-9)


def test_auto_train_steps_log_and_checkpoint_the_signal(tmp_path, monkeypatch):
    """train.weighting=auto end to end: per-step signal and weights are logged, and the estimate is restored on
    resume exactly."""
    import csv

    from stepflow.train import run

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    args = ["experiment=smoke", "sampler=flow_sde", "train.weighting=auto", "train.auto_every=1",
            "train.auto_warmup=1", "reward=pickscore_tiny"]
    module = run(compose_config("train", [*args, "loop.iterations=2"]), tmp_path)
    sig = module.learner.signal
    assert sig is not None and sig.measurements == 2 and sig.steps == [0, 1, 2, 3]  # flow_sde: every step is noisy
    with (tmp_path / "metrics.csv").open() as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("train/steps_trained")]
    assert all(r.get(f"train/signal_step{k}") not in (None, "") for r in rows for k in (0, 1, 2, 3))
    assert sum(float(rows[-1][f"train/weight_step{k}"]) for k in (0, 1, 2, 3)) == pytest.approx(1.0)
    assert float(rows[-1]["train/signal_heterogeneity"]) >= 0  # Cochran's Q / its 95 % point, once measured twice
    module2 = run(compose_config("train", [*args, "loop.iterations=3",
                                           f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}"]), tmp_path)
    assert module2.learner.signal.measurements == 3  # restored 2, measured once more


def test_mini_allsteps_is_the_default_recipe_trained_at_every_step():
    """experiment=mini_allsteps = mini_step0 (the no-argument default recipe) with every noisy step trained, gains
    normalised over every step and the guard weighting; nothing else differs."""
    from omegaconf import OmegaConf

    def flat(cfg, prefix=""):
        out = {}
        for k, v in cfg.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a = flat(OmegaConf.to_container(compose_config("train", ["experiment=mini_allsteps"]), resolve=True))
    b = flat(OmegaConf.to_container(compose_config("train", ["experiment=mini_step0"]), resolve=True))
    diff = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert diff == {"experiment_name", "train.train_steps", "train.weighting", "advantage.over"}, diff
    assert a["train.train_steps"] is None and a["train.weighting"] == "guard" and a["advantage.over"] == "all"
    assert b["train.train_steps"] == [0] and b["advantage.over"] == "trained"
