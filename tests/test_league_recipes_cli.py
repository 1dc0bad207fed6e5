"""Each newer league recipe trains two iterations from the command line (``python -m stepflow.train
experiment=league/<name> loop.iterations=2 ...``): finite metrics, and the NFEs its iteration spends counted by the
rules every method follows (a backward counts 2 forward-equivalents, CFG doubles, branch / tree rollouts included).

One parametrized test over the recipes; each row names the metrics that must be finite beyond the common three and
the per-iteration costs its method's docs derive (docs/method.md §15)."""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Callable

import pytest

from stepflow.testing.harness import run_cli

COMMON = ("train/grad_norm", "train/reward_mean", "train/policy_loss")


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    finite: tuple[str, ...] = ()  #: metrics beyond COMMON that must be finite on every iteration
    every: dict = dataclasses.field(default_factory=dict)  #: metric -> its value on every iteration
    first: dict = dataclasses.field(default_factory=dict)  #: metric -> its value on iteration 1
    check: Callable | None = None  #: rows -> None, asserting what the table cannot say
    timeout: int = 900

    @property
    def id(self) -> str:
        return self.name


def _gate_opened(rows):
    assert max(float(x["train/gate_frac"]) for x in rows) > 0


RECIPES = [
    # 64 x 10 rollout NFEs + 64 rows x 4 times x (policy, reference, old copy without grad + the policy with grad),
    # the backward counted as 2 forwards: 640 + 1024 = 1,664 NFEs, 2,176 forward-equivalents; zero-advantage rows
    # train too (their KL), as released
    Recipe("dgpo", ("train/kl", "train/dsm_loss"),
           every={"cost/nfe": 640 + 64 * 4 * 4, "cost/nfe_backward": 64 * 4,
                  "cost/nfe_fwd_equiv": 640 + 64 * 4 * 4 + 2 * 64 * 4, "train/samples_trained": 64}),
    # 64 x 10 rollout NFEs + 4 pairs = 8 rows x 9 times x (policy and reference without grad + the policy with grad):
    # 640 + 216 = 856 NFEs, 1,000 forward-equivalents; at iteration 1 theta is the reference, so the loss is log 2
    Recipe("online_dpo", ("train/dsm_loss",),
           every={"cost/nfe": 640 + 8 * 9 * 3, "cost/nfe_fwd_equiv": 640 + 8 * 9 * 3 + 2 * 8 * 9,
                  "train/samples_trained": 8},
           first={"train/policy_loss": math.log(2)}),
    Recipe("lc_grpo", every={"cost/nfe_rollout": 64 * 19}, timeout=1800),  # 10 Euler + 9 Langevin corrections
    Recipe("pref_grpo", every={"cost/nfe_rollout": 64 * 10}),
    Recipe("branchgrpo", every={"cost/nfe_rollout": 4 * 99}),  # 4 trees of 99 node evaluations
    # 4 prompts x 10 warm-up NFEs + 64 x 50 rollout NFEs + 64 x 5 trained steps
    Recipe("e_grpo", every={"train/steps_trained": 5.0}, first={"cost/nfe": 4 * 10 + 64 * 50 + 64 * 5}),
    Recipe("flow_dppo", ("train/dppo_kl", "train/clip_frac"), timeout=600),
    Recipe("gardo", ("train/kl", "train/gate_frac"), check=_gate_opened),
]


@pytest.mark.slow
@pytest.mark.extended  # make test-extended (outside CI's 30 minutes)
@pytest.mark.parametrize("recipe", [pytest.param(r, id=r.id) for r in RECIPES])
def test_the_recipe_trains_two_iterations_from_the_command_line(recipe, tmp_path):
    r = run_cli("stepflow.train", f"experiment=league/{recipe.name}", "loop.iterations=2", "eval.every=0",
                "eval.at_start=false", "eval.max_prompts=8", f"hydra.run.dir={tmp_path}", timeout=recipe.timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    with (tmp_path / "metrics.csv").open() as fh:
        rows = [x for x in csv.DictReader(fh) if x.get("train/reward_mean")]
    assert len(rows) == 2
    for x in rows:
        for key in COMMON + recipe.finite:
            assert math.isfinite(float(x[key])), key
        for key, want in recipe.every.items():
            assert float(x[key]) == pytest.approx(want, rel=1e-9), key
    for key, want in recipe.first.items():
        assert float(rows[0][key]) == pytest.approx(want, rel=1e-6), key
    if recipe.check:
        recipe.check(rows)

