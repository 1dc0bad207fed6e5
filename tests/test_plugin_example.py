"""examples/plugin: a researcher's own reward, credit, sampler and objective in a package outside stepflow.

The training runs copy examples/plugin out of the checkout (pytest's tmp_path) and run each option the way a user
does, and the way the acceptance check does: ``PYTHONPATH=T/plugin:T/plugin/src:T``, ``cwd`` = T, ``python -m
stepflow.train experiment=smoke loop.iterations=2 hydra.searchpath=[file://T/plugin/conf] <group>=<name>``. The fast
tests check each part's math against an independent reference (hand computation, scipy, torch.distributions,
autograd).
"""

from __future__ import annotations

import csv
import math
import shutil
import sys

import pytest
import torch

from stepflow.testing.harness import ROOT, run_cli

PLUGIN = ROOT / "examples" / "plugin"
OPTIONS = [("reward", "brightness"), ("advantage", "rank"), ("sampler", "em_sde"), ("objective", "weighted_fm")]


@pytest.fixture(scope="module")
def plugin_modules():
    """The plugin's modules, imported from the checkout's examples/plugin/src (removed from sys.path afterwards)."""
    import importlib

    src = str(PLUGIN / "src")
    sys.path.insert(0, src)
    try:
        mods = {n: importlib.import_module(f"stepflow_plugin.{n}")
                for n in ("brightness", "rank_credit", "em_sampler", "weighted_fm")}
        yield mods
    finally:
        sys.path.remove(src)
        for name in [m for m in sys.modules if m == "stepflow_plugin" or m.startswith("stepflow_plugin.")]:
            del sys.modules[name]


# ------------------------------------------------------------------------------------------------ layout and YAMLs
def test_layout_one_conf_dir_and_one_yaml_per_part():
    assert [p.relative_to(PLUGIN).as_posix() for p in PLUGIN.rglob("conf") if p.is_dir()] == ["conf"]
    for group, name in OPTIONS:
        assert (PLUGIN / "conf" / group / f"{name}.yaml").is_file()
    assert (PLUGIN / "README.md").is_file()


@pytest.mark.parametrize(("group", "name"), OPTIONS)
def test_each_yaml_builds_its_part_with_the_class_defaults(plugin_modules, group, name):
    """The YAML's ``_target_`` imports and its fields are the class's own defaults; a misspelt field is one error."""
    import inspect

    from omegaconf import OmegaConf

    from stepflow.core.parts import from_option

    conf = PLUGIN / "conf"
    node = OmegaConf.to_container(OmegaConf.load(conf / group / f"{name}.yaml"))
    assert node["_target_"].startswith("stepflow_plugin.")
    part = from_option(group, name, [conf]) if group != "reward" else None
    mod, _, cls_name = node["_target_"].rpartition(".")
    cls = getattr(sys.modules[mod], cls_name)
    defaults = {}  # the keyword defaults of the class and of the bases its **fields reach
    for klass in reversed(cls.__mro__[:-1]):
        if "__init__" in klass.__dict__:
            defaults.update({n: p.default for n, p in inspect.signature(klass.__init__).parameters.items()
                             if p.default is not inspect.Parameter.empty})
    for key, value in node.items():
        if key != "_target_":
            assert key in defaults and defaults[key] == value, (key, value)
    if part is not None:
        assert type(part) is cls
        with pytest.raises(ValueError, match=f"^no_such_field: {group}={name} takes no field 'no_such_field'"):
            from_option(group, name, [conf], no_such_field=1)


# ------------------------------------------------------------------------------------------------ reward
def test_brightness_is_the_rec601_mean_luminance(plugin_modules):
    Brightness = plugin_modules["brightness"].Brightness
    img = torch.zeros(3, 3, 2, 2)
    img[0, 0] = 1.0  # pure red: 0.299
    img[1] = 1.0  # white: 1
    img[2, :, 0, 0] = torch.tensor([0.2, 0.4, 0.6])  # one grey-blue pixel of four, the rest black
    lum_pixel = 0.299 * 0.2 + 0.587 * 0.4 + 0.114 * 0.6  # 0.3730
    want = torch.tensor([0.299, 1.0, lum_pixel / 4])
    out = Brightness()(img, ["a", "b", "c"])
    torch.testing.assert_close(out.scores, want)
    torch.testing.assert_close(out.components["luminance"], want)
    out = Brightness(target=0.3)(img, ["a", "b", "c"])
    torch.testing.assert_close(out.scores, 1 - (want - 0.3).abs())
    torch.testing.assert_close(out.components["luminance"], want)
    for bad in (1.5, -0.1, "x", True, float("nan")):
        with pytest.raises(ValueError, match=r"^reward\.target: must be null or a float in \[0, 1\]"):
            Brightness(target=bad)


# ------------------------------------------------------------------------------------------------ credit
def test_rank_credit_is_the_centred_group_rank_of_scipy(plugin_modules):
    from scipy.stats import rankdata

    RankCredit = plugin_modules["rank_credit"].RankCredit
    gen = torch.Generator().manual_seed(0)
    groups = torch.tensor([3] * 5 + [7] * 4 + [1] * 1 + [9] * 3)
    final = torch.randint(0, 3, (len(groups),), generator=gen).double()  # many ties
    final[-3:] = 0.5  # a group whose rewards are all equal
    t = 4
    rewards = torch.full((len(groups), t + 1), float("nan"), dtype=torch.float64)  # only R_T is read
    rewards[:, -1] = final
    want = torch.zeros(len(groups), dtype=torch.float64)
    for g in groups.unique():
        idx = (groups == g).nonzero().flatten()
        n = len(idx)
        if n > 1:
            r = torch.as_tensor(rankdata(final[idx].numpy(), method="average"))
            want[idx] = (r - (n + 1) / 2) / ((n - 1) / 2)
    credit = RankCredit()
    assert credit.needs_stepwise_rewards is False and credit.states_needed([0], t) == [t]
    out = credit(rewards, groups, t, [0, 1])
    assert out.advantages.dtype == torch.float32 and out.advantages.shape == (len(groups), t) and out.gains is None
    for k in range(t):
        torch.testing.assert_close(out.advantages[:, k].double(), want, atol=1e-6, rtol=0)
    assert out.advantages.abs().max() <= 1 and out.advantages[9].abs().max() == 0 and (out.advantages[-3:] == 0).all()
    assert out.stats["rank_adv_min"] >= -1 and out.stats["rank_adv_max"] <= 1
    scaled = RankCredit(scale=2.5, adv_clip=2.0)(rewards, groups, t, [0])
    torch.testing.assert_close(scaled.advantages[:, 0].double(), (2.5 * want).clamp(-2, 2), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="^scale: must be"):
        RankCredit(scale=0)
    with pytest.raises(ValueError, match="^std_scope: must be"):
        RankCredit(std_scope="nope")  # the common fields reach Credit


# ------------------------------------------------------------------------------------------------ sampler
def test_euler_maruyama_step_and_log_prob_against_torch_distributions(plugin_modules):
    from torch.distributions import Normal

    from stepflow.math.sde import time_grid

    sampler = plugin_modules["em_sampler"].EulerMaruyama(sigma=0.7)
    assert sampler.has_density and not sampler.multistep and sampler.noise_field == "sampler.sigma"
    gen = torch.Generator().manual_seed(1)
    x, v, noise = (torch.randn(3, 2, 4, 4, generator=gen) for _ in range(3))
    t = torch.tensor([1.0, 0.6, 0.3])
    s = torch.tensor([0.8, 0.5, 0.1])
    dt = (t - s).view(-1, 1, 1, 1)
    out = sampler.step(x, v, t, s, noise=noise)
    std = 0.7 * (t - s).sqrt()
    torch.testing.assert_close(out.mean, x - dt * v)
    torch.testing.assert_close(out.std, std)
    torch.testing.assert_close(out.kl_scale, std)
    torch.testing.assert_close(out.next, x - dt * v + std.view(-1, 1, 1, 1) * noise)
    want = Normal(x - dt * v, std.view(-1, 1, 1, 1)).log_prob(out.next).flatten(1).mean(1)
    torch.testing.assert_close(out.log_prob, want)
    assert out.trainable.all()
    torch.testing.assert_close(sampler.std(t, s), std)

    # the log-prob of a given sample, with gradients through v (what the update recomputes)
    vg = v.clone().requires_grad_(True)
    again = sampler.step(x, vg, t, s, prev_sample=out.next)
    torch.testing.assert_close(again.log_prob, want)
    again.log_prob.sum().backward()
    assert vg.grad is not None and vg.grad.abs().sum() > 0

    # the step into t = 0 is deterministic; a whole grid has noise on every other step
    last = sampler.step(x, v, 0.2, 0.0, noise=noise)
    assert float(last.std[0]) == 0 and (last.log_prob == 0).all() and not last.trainable.any()
    torch.testing.assert_close(last.next, x - 0.2 * v)
    g = time_grid(4, shift=1.0)
    stds = sampler.std(g[:-1], g[1:], t_guard=g[1])
    assert (stds[:-1] > 0).all() and stds[-1] == 0
    with pytest.raises(ValueError, match="^sigma: must be"):
        plugin_modules["em_sampler"].EulerMaruyama(sigma=-1.0)


# ------------------------------------------------------------------------------------------------ objective
class _Cond:
    def index(self, rows):
        return self

    def to(self, device):
        return self


class _Policy(torch.nn.Module):
    """v(x, t) = w·x + b·t: enough to check the loss and its gradient."""

    device = torch.device("cpu")

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.3))
        self.b = torch.nn.Parameter(torch.tensor(-0.2))

    def velocity(self, x, t, cond, guidance):
        return self.w * x + self.b * t.view(-1, *([1] * (x.ndim - 1)))


def test_weighted_fm_loss_and_gradient_against_a_hand_computation(plugin_modules):
    from types import SimpleNamespace

    from stepflow.config import TrainConfig

    WeightedFM = plugin_modules["weighted_fm"].WeightedFM
    obj = WeightedFM(num_times=2, temperature=0.5).bind(TrainConfig())
    assert obj.forward_process and not obj.needs_density
    b, t_steps = 4, 4
    gen = torch.Generator().manual_seed(2)
    traj = SimpleNamespace(latents=torch.randn(b, t_steps + 1, 2, 3, 3, generator=gen), cond=_Cond())
    learner = SimpleNamespace(policy=_Policy(), guidance=1.0, loop=SimpleNamespace(seed=0))
    times = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    steps = obj.trained_steps(TrainConfig(), None, times, None)
    assert steps == [0, 1, 2, 3] and obj.terms(steps) == [0, 1]
    obj.begin_update(learner, traj, 1, torch.arange(b), steps)
    assert obj.index.shape == (b, 2) and all(len(set(r.tolist())) == 2 for r in obj.index)
    adv = torch.tensor([[2.0] * t_steps, [-1.0] * t_steps, [0.0] * t_steps, [0.5] * t_steps])
    rows = torch.arange(b)
    for term in (0, 1):
        learner.policy.zero_grad()
        out = obj.loss(learner, traj, adv, term, rows, times, None)
        out["loss"].backward()
        # by hand: x_t = (1 − t)·x0 + t·ε, target ε − x0, weights sigmoid(A/0.5), squared error averaged per row
        k = obj.index[:, term]
        tt = times[k].view(-1, 1, 1, 1)
        x0, eps = traj.latents[:, -1], obj.noise[:, term]
        x_t = (1 - tt) * x0 + tt * eps
        w = 1 / (1 + torch.exp(-adv[:, 0] / 0.5))
        with torch.no_grad():
            r = 0.3 * x_t - 0.2 * tt - (eps - x0)
        per_row = (r**2).flatten(1).mean(1)
        torch.testing.assert_close(out["loss"].detach(), (w * per_row).mean())
        torch.testing.assert_close(out["wfm_weight_mean"], w.mean())
        n = r[0].numel()
        grad_w = (w * (2 * r * x_t).flatten(1).sum(1) / n).mean()  # d/dw of mean_i w_i·mean(r_i²)
        grad_b = (w * (2 * r * tt).flatten(1).sum(1) / n).mean()
        torch.testing.assert_close(learner.policy.w.grad, grad_w)
        torch.testing.assert_close(learner.policy.b.grad, grad_b)
        assert "kl" not in out and not out["wfm_loss"].requires_grad
    with pytest.raises(ValueError, match="^temperature: must be"):
        WeightedFM(temperature=0)
    with pytest.raises(ValueError, match="^num_times: must be"):
        WeightedFM(num_times=0)


# ------------------------------------------------------------------------------------------------ the training runs
def _rows(run_dir) -> list[dict]:
    with (run_dir / "metrics.csv").open() as fh:
        return [row for row in csv.DictReader(fh) if row.get("time/iteration_s")]


def _floats(rows, key) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def _check_brightness(rows, header, run_dir):
    assert "eval/brightness" in header
    lum, final = _floats(rows, "train/luminance"), _floats(rows, "train/reward_final")
    assert len(lum) == 2 and all(0 <= x <= 1 for x in lum)
    assert lum == pytest.approx(final, abs=1e-5)  # target null: the reward is the luminance


def _check_rank(rows, header, run_dir):
    lo, hi = _floats(rows, "train/rank_adv_min"), _floats(rows, "train/rank_adv_max")
    assert len(lo) == 2 and len(hi) == 2 and min(lo) >= -1 and max(hi) <= 1
    assert all(0 <= x <= 1 for x in _floats(rows, "train/rank_tied_frac"))
    steps = [k for k in header if k.startswith("train/adv_abs_mean_step")]
    assert steps and all(0 <= x <= 1 for k in steps for x in _floats(rows, k))
    assert not any(k.startswith("train/reward_step") for k in header)  # reads R_T only: no state was scored


def _check_em_sde(rows, header, run_dir):
    assert "stepflow_plugin.em_sampler.EulerMaruyama" in (run_dir / "config.yaml").read_text()
    # smoke's 4-step grid: noise on every step but the last (ddim_sde, the default, trains 2; flow_sde 4)
    assert _floats(rows, "train/steps_trained") == [3.0, 3.0]


def _check_weighted_fm(rows, header, run_dir):
    loss, w = _floats(rows, "train/wfm_loss"), _floats(rows, "train/wfm_weight_mean")
    assert len(loss) == 2 and all(x > 0 and math.isfinite(x) for x in loss)
    assert len(w) == 2 and all(0 < x < 1 for x in w)


CHECKS = {"brightness": _check_brightness, "rank": _check_rank, "em_sde": _check_em_sde,
          "weighted_fm": _check_weighted_fm}


@pytest.mark.parametrize(("group", "name"), OPTIONS)
def test_each_option_trains_from_a_copy_outside_the_checkout(tmp_path, group, name):
    shutil.copytree(PLUGIN, tmp_path / "plugin", ignore=shutil.ignore_patterns("__pycache__"))
    pythonpath = ":".join(str(p) for p in (tmp_path / "plugin", tmp_path / "plugin" / "src", tmp_path))
    run_dir = tmp_path / f"run_{group}_{name}"
    r = run_cli("stepflow.train", "experiment=smoke", "loop.iterations=2",
                f"hydra.searchpath=[file://{tmp_path}/plugin/conf]", f"{group}={name}", f"hydra.run.dir={run_dir}",
                cwd=tmp_path, env={"PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(run_dir)
    assert len(rows) == 2
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    CHECKS[name](rows, header, run_dir)
