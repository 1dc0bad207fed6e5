#!/usr/bin/env python
"""The league: every method stepflow has, on the embedded world, at equal compute, with paired seeds.

    python experiments/league.py --jobs 2                 # the whole league (make league): grid, table, claims, report
    python experiments/league.py --quick --jobs 2         # make league-quick: 4 methods, 2 seeds, one budget
    python experiments/league.py --phase grid --dry-run   # print the plan of one phase, run nothing
    python experiments/league.py --report                 # only (re)write docs/league/ from the runs on disk
    python experiments/league.py --methods default,nft --seeds 0,1 --budget 2e4 -- model.path=/my/base

Protocol (docs/league/report.md says it in full):

- **Budgets** in forward-equivalent NFEs (``loop.budget``: a backward counts 2, CFG doubles, over all ranks; reward
  images are counted beside it): every run of the table goes to ``--budget`` (default 120,000) and is evaluated on
  every held-out prompt after the first iteration past each of :data:`POINTS` (7.5k, 15k, 30k, 60k, 90k, 120k: six
  budget points from one run; ``eval.at_fractions``); the NFEs, training seconds and reward-model images actually
  spent at each evaluation are recorded beside it (``nfe``, ``seconds``, ``reward_images``). The base model is
  evaluated once (``eval.at_start=false`` in every run). League runs log no final-image rewards they do not train on
  (``loop.final_reward_every=0``: those rollouts would spend the method's budget) and draw no evaluation grids
  (:data:`LEAGUE_OVERRIDES`).
- **Where methods end**: a method's *peak* is the budget point of the largest mean held-out GenEval over seeds;
  :func:`still_rising` (its peak is its last point and the last interval gained at least ``rise_tol``) doubles that
  method's budget, with evaluations at 1.5× and 2× the old one, at most ``max_extend`` times; the decision is kept
  in ``<ledger>/budgets.json`` (``--budget-for name=NFEs`` sets one by hand) and its runs are continued from their
  ``checkpoints/last.ckpt`` to the new budget (:func:`ablations.extension`: the same run as one made to the new budget
  in one go; a run whose checkpoint is gone, e.g. restored from the ledger, is run again from the start).
- **Learning rate**: each method's lr is chosen on the grid {lr/3, lr, 3 lr} around its config's lr, to the full
  budget, with ``--grid-seeds`` (default 100, 101) that the table does not use; the chosen lr maximises the *peak* of
  the mean held-out GenEval over those seeds (the criterion the table reports); while the best lr is at an edge the
  grid adds the next lr beyond it (×3 or ÷3), up to ``grid_extend`` times (the report names a choice left at an edge).
- **Seeds** 0..4 (``--seeds``), the same for every method: seed s gives every method the same prompt order and the
  same first initial noises, and every evaluation uses the same held-out prompts and noises (``eval.seed``); where a
  recipe breaks this (a category-balanced prompt list, ``loop.same_latent=false``), the report names it
  (:func:`pairing_exceptions`).
- **The central claim's power**: the arms of each comparison of ``league_report.CENTRAL`` (gains vs uniform credit,
  gains vs Flow-GRPO) get more seeds until the minimum detectable difference at their measured paired sd is at most
  0.04 (:func:`decide_power`, at most ``max_seeds``; kept in ``<ledger>/seeds.json``).
- **Claims arms**: the paper's claims tested as one-change variants of the default (step-0) and the every-step
  recipes, and the paper's recipe decomposed (:data:`DECOMPOSITION`), each with its parent method's chosen lr.

Runs land in ``<out>/<phase>/<method>/<run>`` (``<run>`` = ``lr=<lr>,seed=<s>`` in the grid, ``seed=<s>`` elsewhere).
Rerunning skips finished runs (the adapter is saved at the end), resumes interrupted ones from
``checkpoints/last.ckpt`` and moves a run whose stored config differs from the plan (a changed lr choice, config or
budget) to ``.stale/`` before rerunning it, as experiments/ablations.py does. ``--jobs N`` runs N single-threaded runs
at once, longest first. Interrupt with Ctrl-C: the running runs checkpoint and stop; the next invocation resumes them.

The ledger: each finished run's ``config.yaml`` and ``metrics.csv`` (and the table's seed-0 adapter, for the image
grids) are copied to ``docs/league/runs/<phase>/<method>/<run>`` with ``runs.jsonl`` beside them; a fresh clone
restores them into ``outputs/league`` and skips those runs. Runs measured before the ledger existed count as finished
from their rows in ``docs/league/results.csv`` / ``lr_grid.csv`` (same method, seed, lr and budget points).
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ablations  # noqa: E402  (experiments/ablations.py: the skip / resume / stale logic)
import report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "outputs" / "league"
DOCS = ROOT / "docs" / "league"
CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


# ---------------------------------------------------------------------------------------------------- definitions
@dataclass(frozen=True)
class Method:
    """One contestant: an experiment file (None = the default ``python -m stepflow.train``) and its overrides.
    ``parent``: a claims arm takes its parent method's chosen lr (it is not tuned itself)."""

    name: str
    experiment: str | None
    overrides: tuple[str, ...] = ()
    title: str = ""
    parent: str | None = None

    def base_overrides(self) -> list[str]:
        return ([f"experiment={self.experiment}"] if self.experiment else []) + list(self.overrides)


def recipe_methods(known: set[str], folder: Path = ROOT / "stepflow" / "conf" / "experiment" / "league") -> tuple[Method, ...]:
    """The league recipes of ``folder`` that ``known`` does not name, as methods: a new method joins the league by its
    recipe file alone (``experiment=league/<name>``). Its title is the recipe's first comment line up to `` (`` (the
    recipes open with ``# <Title> (<what it is>) ...``)."""
    out = []
    for f in sorted(folder.glob("*.yaml")):
        if f.stem in known:
            continue
        lines = [ln[1:].strip() for ln in f.read_text().splitlines() if ln.startswith("#") and "@package" not in ln]
        title = lines[0].split(" (")[0].rstrip(":;,.") if lines and lines[0] else f.stem
        out.append(Method(f.stem, f"league/{f.stem}", (), title))
    return tuple(out)


#: every method of the league (issue #25's list), the field's as released and stepflow's own recipes; then every
#: other recipe of conf/experiment/league/ (:func:`recipe_methods`)
METHODS: tuple[Method, ...] = (
    Method("default", None, (), "stepflow's default: gains at step 0, DDIM SDE (python -m stepflow.train)"),
    Method("paper", "league/paper", (), "the paper's recipe: gains at every step, DDIM SDE, T' = 5"),
    Method("allsteps", "mini_allsteps", (), "every step with gains and the guard weighting (mini_allsteps)"),
    Method("allsteps_auto", "mini_allsteps", ("train.weighting=auto",),
           "every step, weighted by the measured gradient signal (train.weighting=auto)"),
    Method("uniform_guard", "mini_allsteps", ("advantage=uniform",),
           "uniform credit at every step with the guard weighting (the control for gains)"),
    Method("flow_grpo", "league/flow_grpo", (), "Flow-GRPO"),
    Method("flow_grpo_fast", "league/flow_grpo_fast", (), "Flow-GRPO-Fast (CPS, random window of 3 in steps 0-4)"),
    Method("grpo_guard", "league/grpo_guard", (), "GRPO-Guard"),
    Method("dancegrpo", "league/dancegrpo", (), "DanceGRPO"),
    Method("mixgrpo", "league/mixgrpo", (), "MixGRPO"),
    Method("mixgrpo_flash", "league/mixgrpo_flash", (), "MixGRPO-Flash"),
    Method("tempflow", "league/tempflow", (), "TempFlow-GRPO"),
    Method("tpgrpo", "league/tpgrpo", (), "TurningPoint-GRPO"),
    Method("g2rpo", "league/g2rpo", (), "Granular-GRPO"),
    Method("nft", "league/nft", (), "DiffusionNFT"),
    Method("awm", "league/awm", (), "Advantage Weighted Matching"),
    Method("advantageflow", "league/advantageflow", (), "AdvantageFlow"),
)
METHODS += recipe_methods({m.name for m in METHODS} | {m.experiment.partition("/")[2] for m in METHODS if m.experiment})

#: one-change variants for the paper's claims (run with the table's seeds and budget, parent's lr)
CLAIM_ARMS: tuple[Method, ...] = (
    Method("default_uniform", None, ("advantage=uniform",), "default with uniform credit", "default"),
    Method("default_flow_sde", None, ("sampler=flow_sde",), "default with Flow-GRPO's SDE (a = 0.7)", "default"),
    Method("default_uniform_flow_sde", None, ("advantage=uniform", "sampler=flow_sde"),
           "default with uniform credit and Flow-GRPO's SDE", "default"),
    Method("default_cfg45", None, ("loop.guidance=4.5", "eval.guidance=4.5"), "default at CFG 4.5", "default"),
    Method("default_uniform_cfg45", None, ("advantage=uniform", "loop.guidance=4.5", "eval.guidance=4.5"),
           "default with uniform credit at CFG 4.5", "default"),
    Method("allsteps_flow_sde", "mini_allsteps", ("sampler=flow_sde",), "every-step recipe with Flow-GRPO's SDE",
           "allsteps"),
    Method("allsteps_tweedie", "mini_allsteps", ("loop.substeps=1",), "every-step recipe with T' = 1 (Tweedie)",
           "allsteps"),
    Method("allsteps_t5", "mini_allsteps", ("loop.substeps=5",), "every-step recipe with T' = 5", "allsteps"),
    Method("allsteps_per_step", "mini_allsteps", ("advantage=gain_per_step",),
           "every-step recipe, gains normalised per step", "allsteps"),
    Method("allsteps_gain_ema", "mini_allsteps", ("advantage=gain_ema",), "every-step recipe, gains minus an EMA "
           "baseline", "allsteps"),
    Method("allsteps_gae", "mini_allsteps", ("advantage=gae",), "every-step recipe, GAE over the gains", "allsteps"),
    Method("allsteps_distill", "mini_allsteps", ("objective=distill",), "every-step recipe, gain-weighted ODE "
           "distillation", "allsteps"),
)

#: the paper's recipe decomposed (experiment=league/paper against the default ``python -m stepflow.train``; the
#: report lists every setting in which the two differ, :func:`config_differences`): each arm changes ONE of them,
#: either the default towards the paper (parent ``default``) or the paper back to the default (parent ``paper``)
CLAIM_ARMS += (
    Method("default_kl04", None, ("train.beta_kl=0.04", "train.kl_mode=flow_grpo_parity"),
           "default with the paper's KL (beta 0.04, Flow-GRPO's form)", "default"),
    Method("default_balanced", None, ("data.balance_by=category",), "default with category-balanced prompts",
           "default"),
    Method("default_t5", None, ("loop.substeps=5",), "default with T' = 5", "default"),
    Method("default_every_step", None, ("train.train_steps=null", "train.timestep_fraction=0.99", "advantage.over=all"),
           "default trained at every noisy step (9 of 10), gains over all steps, unweighted", "default"),
    Method("paper_no_kl", "league/paper", ("train.beta_kl=0.0", "train.kl_mode=exact"), "the paper's recipe without KL",
           "paper"),
    Method("paper_unbalanced", "league/paper", ("data.balance_by=null",),
           "the paper's recipe on the train file's own prompt mix", "paper"),
    Method("paper_t2", "league/paper", ("loop.substeps=2",), "the paper's recipe with T' = 2", "paper"),
    Method("paper_noisy_step0", "league/paper", ("sampler.schedule=eta_s",),
           "the paper's recipe with the default's noise schedule (step 0 stochastic)", "paper"),
)


@dataclass(frozen=True)
class Change:
    """One arm of the decomposition: ``arm`` differs from ``parent`` in ``what`` alone."""

    arm: str
    parent: str
    what: str


DECOMPOSITION: tuple[Change, ...] = (
    Change("default_kl04", "default", "KL to the reference, beta 0.04 (Flow-GRPO's form)"),
    Change("default_balanced", "default", "category-balanced prompts"),
    Change("default_t5", "default", "T' = 5 substeps for the x̂0 estimates"),
    Change("default_every_step", "default", "every noisy step trained (9 of 10), gains normalised over all steps"),
    Change("paper_no_kl", "paper", "no KL"),
    Change("paper_unbalanced", "paper", "the train file's prompt mix (not balanced)"),
    Change("paper_t2", "paper", "T' = 2"),
    Change("paper_noisy_step0", "paper", "the default's noise schedule (sigma = eta s: step 0 stochastic)"),
)

QUICK_METHODS = ("default", "allsteps", "flow_grpo", "nft")

#: the base model's held-out evaluation (iteration 0 of a one-iteration run): at CFG 1, and at CFG 4.5 for the CFG arms
BASES: tuple[Method, ...] = (
    Method("base", None, (), "the base model"),
    Method("base_cfg45", None, ("loop.guidance=4.5", "eval.guidance=4.5"), "the base model at CFG 4.5"),
)


@dataclass(frozen=True)
class Claim:
    """One of the paper's claims as a paired comparison of ``better`` and ``worse``. ``kind``: ``better`` (it beats
    ``worse``), ``alike`` (the two are within the detectable difference) or ``no_better`` (``worse`` does not beat
    it: the paper's "X does not improve on plain gains", refuted only by X winning)."""

    source: str
    statement: str
    better: str
    worse: str
    kind: str = "better"


CLAIMS: tuple[Claim, ...] = (
    Claim("Fig. 4", "gains beat uniform credit (step 0, DDIM SDE)", "default", "default_uniform"),
    Claim("Fig. 4", "gains beat uniform credit (every step, guard weighting)", "allsteps", "uniform_guard"),
    Claim("Fig. 4", "the paper's recipe beats Flow-GRPO", "paper", "flow_grpo"),
    Claim("Fig. 6", "the DDIM SDE beats Flow-GRPO's SDE with gains (step 0)", "default", "default_flow_sde"),
    Claim("Fig. 6", "the DDIM SDE beats Flow-GRPO's SDE with uniform credit (step 0)", "default_uniform",
          "default_uniform_flow_sde"),
    Claim("Fig. 6", "the DDIM SDE beats Flow-GRPO's SDE with gains (every step)", "allsteps", "allsteps_flow_sde"),
    Claim("Fig. 10", "T' = 2 and T' = 5 perform alike", "allsteps", "allsteps_t5", kind="alike"),
    Claim("Fig. 10", "T' >= 2 beats T' = 1 (Tweedie: 'noisy estimates')", "allsteps", "allsteps_tweedie"),
    Claim("Fig. 9", "joint normalisation of the gains beats per-step (faster convergence)", "allsteps",
          "allsteps_per_step"),
    Claim("Fig. 7", "an EMA baseline does not beat plain gains", "allsteps", "allsteps_gain_ema", kind="no_better"),
    Claim("Fig. 7", "GAE does not beat plain gains", "allsteps", "allsteps_gae", kind="no_better"),
    Claim("Fig. 7", "gain-weighted distillation does not beat plain gains ('far less stable')", "allsteps",
          "allsteps_distill", kind="no_better"),
    Claim("Table 1", "at CFG 4.5 gains beat uniform credit", "default_cfg45", "default_uniform_cfg45"),
)


#: the budget points of the table (forward-equivalent NFEs): one run evaluates after the first iteration past each
POINTS: tuple[int, ...] = (7_500, 15_000, 30_000, 60_000, 90_000, 120_000)
#: what every league run adds to its recipe (before ``-- overrides``): no final-image rollouts that only feed the
#: train/reward_final log (they spent 11.7 % of the default's 30,000-NFE budget on logging), no evaluation grids (the
#: report draws its samples from the saved adapter), held-out sampling in batches of 64 (the same images as the
#: default 128: the initial noise is drawn for all prompts at once; 0.75x and 0.81x the time of 128 in two
#: interleaved measurements on the 2-core machine)
LEAGUE_OVERRIDES: tuple[str, ...] = ("loop.final_reward_every=0", "eval.grid_prompts=0", "eval.batch_size=64")


@dataclass
class Settings:
    """The league's protocol (what ``--quick`` and the flags change)."""

    budget: float = float(POINTS[-1])
    fractions: tuple[float, ...] = tuple(p / POINTS[-1] for p in POINTS)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    grid_seeds: tuple[int, ...] = (100, 101)
    grid_factors: tuple[float, ...] = (1 / 3, 1.0, 3.0)
    grid_budget_fraction: float = 1.0  #: the grid runs to this fraction of the budget, evaluated at the fractions below it
    grid_extend: int = 6  #: a best lr at the grid's edge adds the next one beyond it (×3 or ÷3), at most this often
    #: a still-rising method's budget doubles (:func:`still_rising`) at most this often
    max_extend: int = 2
    #: still rising: the mean held-out GenEval gained at least this over the last interval (and peaks at the end)
    rise_tol: float = 0.01
    #: the central claim's power (:func:`decide_power`): the arms of each comparison of ``league_report.CENTRAL``
    #: get more seeds until the minimum detectable difference at their measured paired sd is at most this (0: off)
    power_target: float = 0.04
    max_seeds: int = 20  #: ... but never more than this many seeds per arm
    #: per-method budgets set by hand (``--budget-for``); they take precedence over ``<ledger>/budgets.json``
    budget_for: dict[str, float] = field(default_factory=dict)
    methods: tuple[str, ...] = tuple(m.name for m in METHODS)
    claims: bool = True
    grid: bool = True
    #: a pipeline check (``make league-quick``): its report says so at the top and ranks nothing
    check: bool = False
    out: Path = OUT
    extra: tuple[str, ...] = ()
    prefix: tuple[str, ...] = ()  #: a launcher each run's command goes through (srun ...)
    cap: int = 5000  #: loop.iterations: a cap the budget reaches first
    #: the committed ledger (the report's directory, docs/league for make league): every finished run's config.yaml,
    #: metrics.csv and adapter are copied to ``<ledger>/runs/<phase>/<method>/<run>`` and restored into ``out`` when
    #: ``out`` lacks them (a fresh clone resumes the league where the last commit left it); its results.csv and
    #: lr_grid.csv rows count as finished runs where neither ``out`` nor ``runs/`` has the run (runs measured before
    #: the archive existed). None: ``out`` only.
    ledger: Path | None = None

    @property
    def grid_budget(self) -> float:
        return self.budget * self.grid_budget_fraction

    @property
    def grid_fractions(self) -> tuple[float, ...]:
        return tuple(f / self.grid_budget_fraction for f in self.fractions if f <= self.grid_budget_fraction + 1e-12)


#: ``--scale paper``: the same methods on SD3.5-Medium with the GenEval rules served by a detector (reward=
#: geneval_server, data=geneval: eval/geneval is GenEval's own score), 8 GPUs per run (trainer=ddp); each run is
#: launched through ``--prefix`` (e.g. ``srun -N1 --gpus-per-node 8 --exclusive``) so the pool fills a cluster
PAPER_EXTRA = ("model=sd35_medium", "trainer=ddp", "reward=geneval_server", "data=geneval", "loop.prompts_per_iter=8",
               "eval.num_steps=40")
PAPER_BUDGET = 5e6


def quick_settings() -> Settings:
    return Settings(budget=8_000.0, fractions=(1.0,), seeds=(0, 1), methods=QUICK_METHODS, claims=False, grid=False,
                    out=OUT.parent / "league_quick", check=True, max_extend=0, power_target=0.0)


# ---------------------------------------------------------------------------------------------------- where methods end
BUDGETS_FILE = "budgets.json"  #: in the ledger: {method: budget} of the methods whose budget was extended


def _ledger_numbers(s: Settings, file: str, cast, what: str) -> dict:
    """``{method: number}`` kept in ``<ledger>/<file>`` by a decision of the league (positive numbers only); an
    unreadable file is noted (``what``: the setting every method then keeps) and read as empty."""
    f = s.ledger / file if s.ledger is not None else None
    if f is None or not f.is_file():
        return {}
    try:
        raw = json.loads(f.read_text() or "{}")
        return {str(k): cast(v) for k, v in raw.items() if cast(v) > 0}
    except (ValueError, TypeError, AttributeError) as e:
        note(f"{f}: not a {{method: number}} JSON object ({e}); every method at {what}")
        return {}


def extended_budgets(s: Settings) -> dict[str, float]:
    """``{method: budget}`` decided by :func:`decide_extensions` (``<ledger>/budgets.json``), then ``s.budget_for``."""
    return {**_ledger_numbers(s, BUDGETS_FILE, float, "--budget"), **s.budget_for}


def method_budget(s: Settings, name: str) -> float:
    """The budget of ``name``'s table / claims runs: ``s.budget`` unless extended."""
    return float(extended_budgets(s).get(name, s.budget))


def method_fractions(s: Settings, budget: float) -> tuple[float, ...]:
    """The evaluation points of a run to ``budget`` as fractions of it: ``s.fractions`` of ``s.budget``, then for each
    doubling (``s.budget`` → 2×) the points 1.5× and 2× the budget before it."""
    pts = [f * s.budget for f in s.fractions]
    b = s.budget
    while budget > b * (1 + 1e-9):
        pts += [1.5 * b, 2 * b]
        b *= 2
    return tuple(sorted({round(p / budget, 9) for p in pts if p <= budget * (1 + 1e-9)}))


def still_rising(curve: Sequence[tuple[float, float]], tol: float) -> bool:
    """``curve``: ``[(budget point, mean held-out GenEval over seeds)]``. Still rising: the largest mean is at the last
    point and the last interval gained at least ``tol``, i.e. the method has neither peaked nor flattened."""
    pts = sorted(curve)
    if len(pts) < 2:
        return False
    vals = [v for _, v in pts]
    return vals[-1] >= max(vals) and vals[-1] - vals[-2] >= tol


def decide_extensions(s: Settings, names: Sequence[str]) -> dict[str, float]:
    """Apply :func:`still_rising` to each of ``names`` whose table / claims runs are all finished at its budget (every
    seed of ``s.seeds``): a still-rising one gets twice its budget (at most ``s.max_extend`` doublings), written to
    ``<ledger>/budgets.json``. Returns the new budgets (empty: nothing to extend)."""
    import league_report

    if s.ledger is None or s.max_extend <= 0:
        return {}
    rows = collect(s)
    done = extended_budgets(s)
    new: dict[str, float] = {}
    for name in names:
        if name in s.budget_for:
            continue
        b = method_budget(s, name)
        if b >= s.budget * 2 ** s.max_extend * (1 - 1e-9):
            continue
        mine = [r for r in rows if r["method"] == name and abs(r.get("run_budget", 0) - b) < 1e-6 * b
                and r["phase"] in ("table", "claims")]
        if {r["seed"] for r in mine if abs(r["fraction"] - 1.0) < 1e-9} < set(s.seeds):
            continue
        curve = league_report.mean_curve(league_report.by_method(mine)[name])
        if still_rising(curve, s.rise_tol):
            new[name] = 2 * b
    if new:
        f = s.ledger / BUDGETS_FILE
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({**{k: v for k, v in done.items() if k not in s.budget_for}, **new}, indent=1,
                                sort_keys=True) + "\n")
    return new


# ---------------------------------------------------------------------------------------------------- the claim's power
SEEDS_FILE = "seeds.json"  #: in the ledger: {method: seeds} of the central claim's arms given more than ``s.seeds``


def power_seeds(s: Settings) -> dict[str, int]:
    """``{method: number of seeds}`` decided by :func:`decide_power` (``<ledger>/seeds.json``)."""
    return _ledger_numbers(s, SEEDS_FILE, int, "--seeds") if s.power_target > 0 else {}


def method_seeds(s: Settings, name: str) -> tuple[int, ...]:
    """The seeds of ``name``'s table / claims runs: ``s.seeds``, then (where :func:`decide_power` gave it more) the
    next integers after them that are not grid seeds."""
    seeds = list(s.seeds)
    want, nxt = power_seeds(s).get(name, 0), max(s.seeds, default=-1) + 1
    while len(seeds) < want:
        if nxt not in s.grid_seeds:
            seeds.append(nxt)
        nxt += 1
    return tuple(seeds)


def decide_power(s: Settings) -> dict[str, int]:
    """Seeds for the central claim (item 4 of the league's protocol). For each comparison of
    ``league_report.CENTRAL`` whose two arms are planned and have finished every planned seed at their planned
    budget: the paired test at both arms' peaks gives the sd of the paired differences, and
    ``league_report.seeds_for`` the seeds at which the minimum detectable difference (α 0.05, power 80 %) is at most
    ``s.power_target``; an arm with fewer seeds gets that many (at most ``s.max_seeds``), written to
    ``<ledger>/seeds.json``. Sequential: the sd is re-measured on the new seeds and may ask for more. Returns the new
    counts (empty: nothing to add)."""
    import league_report as lr

    if s.ledger is None or s.power_target <= 0:
        return {}
    planned = set(s.methods) | ({m.name for m in CLAIM_ARMS if m.parent in s.methods} if s.claims else set())
    rows, legacy = lr.select_protocol(collect(s), lambda m: method_budget(s, m))
    data = lr.by_method(rows)
    ended = {m: {int(r["seed"]) for r in rows if r["method"] == m and abs(float(r["fraction"]) - 1.0) < 1e-9}
             for m in planned}
    have = power_seeds(s)
    new: dict[str, int] = {}
    for a, b, _ in lr.CENTRAL:
        if not {a, b} <= planned or {a, b} & legacy or any(not set(method_seeds(s, m)) <= ended[m] for m in (a, b)):
            continue
        t = lr.paired_test(data[a][lr.peak_budget(data[a])], data[b][lr.peak_budget(data[b])])
        if t["n"] < 2 or not t["sd"] > 0:
            continue
        need = min(lr.seeds_for(t["sd"], s.power_target, n_max=s.max_seeds) or s.max_seeds, s.max_seeds)
        for m in (a, b):
            if need > max(len(method_seeds(s, m)), new.get(m, 0)):
                new[m] = need
    if new:
        f = s.ledger / SEEDS_FILE
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({**have, **new}, indent=1, sort_keys=True) + "\n")
    return new


def method(name: str) -> Method:
    for m in (*METHODS, *CLAIM_ARMS):
        if m.name == name:
            return m
    raise KeyError(name)


def lr_str(lr: float) -> str:
    """Two significant digits, as a Hydra value and a directory name: 3.3e-04 -> ``0.00033``."""
    return f"{float(f'{lr:.2g}'):g}"


def grid_lrs(lr: float, factors: Sequence[float]) -> list[str]:
    return [lr_str(lr * f) for f in factors]


def grid_list(s: Settings, m: Method, lr0: float) -> list[str]:
    """The method's grid: ``lr0 × grid_factors``, and while its finished runs put the best lr (:func:`grid_scores`) at
    an edge, the next lr beyond that edge (a factor 3), at most ``grid_extend`` times: no method is held at the edge
    of a grid unless the cap is reached (:func:`chosen_lrs` says so)."""
    lrs = sorted(lr0 * f for f in s.grid_factors)
    for _ in range(s.grid_extend):
        scores = grid_scores(s, m, [lr_str(x) for x in lrs])
        if any(v is None for v in scores.values()):
            break
        vals = [scores[lr_str(x)] for x in lrs]
        best = max(range(len(vals)), key=lambda i: vals[i])
        if best == len(lrs) - 1:
            lrs.append(lrs[-1] * 3)
        elif best == 0:
            lrs.insert(0, lrs[0] / 3)
        else:
            break
    return [lr_str(x) for x in lrs]


# ---------------------------------------------------------------------------------------------------- planning
@dataclass
class Run:
    phase: str  #: grid | table | claims
    method: Method
    lr: str
    seed: int
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    status: str = "missing"
    reason: str = ""
    cost: float = 1.0  #: expected seconds (for longest-first scheduling)

    def command(self, python: str = sys.executable, prefix: Sequence[str] = ()) -> list[str]:
        cmd = [*prefix, python, "-m", "stepflow.train", *self.overrides, f"seed={self.seed}",
               f"hydra.run.dir={ablations.hydra_value(str(self.run_dir))}"]
        if self.status == "resume":
            cmd.append(f"ckpt_path={ablations.hydra_value(str(self.run_dir / 'checkpoints' / 'last.ckpt'))}")
        return cmd


def run_overrides(m: Method, lr: str, budget: float, fractions: Sequence[float], s: Settings) -> list[str]:
    fr = ",".join(f"{f:g}" for f in fractions)
    return [*m.base_overrides(), f"train.lr={lr}", f"loop.budget={int(round(budget))}", f"loop.iterations={s.cap}",
            "eval.every=0", "eval.at_start=false", f"eval.at_fractions=[{fr}]", *LEAGUE_OVERRIDES, *s.extra]


#: ``{method's overrides: its config's lr}``: composing a recipe takes about a second and a plan or report asks for
#: every method's lr many times; cleared by :func:`forget_configs` where the config files may have changed since (each
#: phase of a league run, each report)
_LR_CACHE: dict[tuple[str, ...], float] = {}


def configured_lr(m: Method, compose) -> float:
    key = tuple(m.base_overrides())
    if key not in _LR_CACHE:
        _LR_CACHE[key] = float(compose("train", list(key)).train.lr)
    return _LR_CACHE[key]


def forget_configs() -> None:
    _LR_CACHE.clear()


def chosen_lrs(s: Settings, compose) -> dict[str, tuple[str, str]]:
    """``{method: (lr, why)}``: the grid's choice where the grid is finished for that method, else the config's lr."""
    out = {}
    for name in s.methods:
        m = method(name)
        lr0 = configured_lr(m, compose)
        if not s.grid:
            out[name] = (lr_str(lr0), "the config's lr (no grid)")
            continue
        scores = grid_scores(s, m, grid_list(s, m, lr0))
        if scores and all(v is not None for v in scores.values()):
            best = max(scores, key=lambda k: scores[k])
            keys = list(scores)
            edge = " (at the grid's edge after its extensions)" if best in (keys[0], keys[-1]) else ""
            out[name] = (best, "grid: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()) + edge)
        else:
            out[name] = (lr_str(lr0), "the config's lr (grid unfinished)")
    return out


def grid_scores(s: Settings, m: Method, lrs: Sequence[str]) -> dict[str, float | None]:
    """Each grid lr's *peak*: the largest mean held-out GenEval over the grid seeds at one of the grid's budget points
    (:func:`league_report.mean_curve`, the criterion the table reports); None where a run is unfinished."""
    import league_report

    scores: dict[str, float | None] = {}
    for lr in lrs:
        rows: list[dict[str, Any]] | None = []
        for seed in s.grid_seeds:
            d = s.out / "grid" / m.name / run_name("grid", lr, seed)
            if finished(d):
                rows += [{**r, "seed": seed} for r in eval_rows(d, s.grid_budget, s.grid_fractions)]
                continue
            got = [] if d.exists() else ledger_run_rows(s, "grid", m.name, seed, lr, s.grid_fractions, s.grid_budget)
            if not got:
                rows = None
                break
            rows += got
        curve = league_report.mean_curve(_per_budget(rows)) if rows else []
        scores[lr] = max(v for _, v in curve) if curve else None
    return scores


def _per_budget(rows: Sequence[dict[str, Any]]) -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for r in rows:
        out.setdefault(int(r["budget"]), {})[int(r["seed"])] = float(r["geneval"])
    return out


def plan(s: Settings, phases: Sequence[str], check_config: bool = True) -> list[Run]:
    from stepflow.config import composer

    runs: list[Run] = []
    restore_archive(s)
    with composer() as compose:
        ms = [method(n) for n in s.methods]
        if "base" in phases:
            for m in BASES if s.claims else BASES[:1]:
                ovr = [*m.base_overrides(), "loop.iterations=1", "eval.every=0", *LEAGUE_OVERRIDES, *s.extra]
                runs += _runs("base", m, "", (0,), ovr, s, compose, check_config)
        if "grid" in phases and s.grid:
            for m in ms:
                for lr in grid_list(s, m, configured_lr(m, compose)):
                    ovr = run_overrides(m, lr, s.grid_budget, s.grid_fractions, s)
                    runs += _runs("grid", m, lr, s.grid_seeds, ovr, s, compose, check_config)
        chosen = chosen_lrs(s, compose) if ({"table", "claims"} & set(phases)) else {}
        if "table" in phases:
            for m in ms:
                lr, b = chosen[m.name][0], method_budget(s, m.name)
                ovr = run_overrides(m, lr, b, method_fractions(s, b), s)
                runs += _runs("table", m, lr, method_seeds(s, m.name), ovr, s, compose, check_config)
        if "claims" in phases and s.claims:
            for m in CLAIM_ARMS:
                if m.parent not in chosen:
                    continue
                lr, b = chosen[m.parent][0], method_budget(s, m.name)
                ovr = run_overrides(m, lr, b, method_fractions(s, b), s)
                runs += _runs("claims", m, lr, method_seeds(s, m.name), ovr, s, compose, check_config)
    return runs


def _runs(phase, m, lr, seeds, ovr, s: Settings, compose, check_config) -> list[Run]:
    planned = None
    if check_config:
        from omegaconf import OmegaConf

        planned = OmegaConf.to_container(compose("train", list(ovr)), resolve=True)
    out = []
    for seed in seeds:
        d = s.out / phase / m.name / run_name(phase, lr, seed)
        status, reason = ablations.job_status(d, planned)
        if status == "missing" and finished(d):  # restored from the ledger without its adapter
            status, reason = "finished", ""
        budget = next(float(o.split("=", 1)[1]) for o in ovr if o.startswith("loop.budget=")) if phase != "base" else 0
        if status == "finished" and budget and not any(r["fraction"] == 1.0 for r in eval_rows(d, budget, [1.0])):
            status, reason = "stale", "its adapter exists but it stopped before its budget (a signal, before the fix)"
        if status == "missing" and not d.exists() and budget and not keeps_adapter(phase, d.name) and \
                ledger_run_rows(s, phase, m.name, seed, lr, planned_fractions(ovr), budget):
            # (a run whose adapter the ledger keeps is run again: the image grids need it)
            status, reason = "finished", "in the ledger's csv (measured before runs were archived)"
        cost = expected_seconds(m, ovr)
        done = ablations.run_budget(d) if status == "resume" and budget else None
        if done is not None and done < budget:  # an extension: only the new part is run
            cost *= 1.0 - done / budget
        out.append(Run(phase, m, lr, seed, d, list(ovr), status, reason, cost=cost))
    return out


#: seconds per forward-equivalent NFE measured with two runs at once on the 2-core machine (docs/results.md's league
#: tables; the default 3.8 ms): only the order of the runs (longest first) depends on them
MS_PER_NFE_DEFAULT = 3.8
MS_PER_NFE = {"grpo_guard": 18.0, "mixgrpo_flash": 17.0, "tempflow": 11.0, "dancegrpo": 10.0, "mixgrpo": 8.5,
              "tpgrpo": 7.5, "g2rpo": 7.0, "nft": 5.2, "awm": 5.0, "advantageflow": 5.0}


#: a league run's time outside training, in forward-equivalent NFEs of the default's training (ratios measured in one
#: run of the default, `python -m stepflow.train loop.iterations=4 loop.budget=null eval.every=0 eval.at_start=false
#: loop.final_reward_every=0`: 27 s of training for 1,762 NFEs, 49 s of start-up and end, 51 s for the final held-out
#: evaluation at batch 128 of which 2.5 s drew its grid; at batch 64 without the grid about 0.78 x 48.5 s): the
#: start-up and one evaluation (285 prompts, 10 ODE steps, the judge)
START_NFE, EVAL_NFE = 3100.0, 2400.0


def expected_seconds(m: Method, ovr: Sequence[str]) -> float:
    budget = next((float(o.split("=", 1)[1]) for o in ovr if o.startswith("loop.budget=")), 0.0)
    outside = START_NFE + EVAL_NFE * max(1, len(planned_fractions(ovr)))
    return (budget * MS_PER_NFE.get(m.name, 4.5) + outside * MS_PER_NFE_DEFAULT) / 1000.0


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


#: settings that name a run, not what it trains
_NOT_TRAINING = ("experiment_name", "eval.every", "eval.grid_prompts", "eval.guidance", "loop.guidance")


def config_differences(compose, a: Method, b: Method) -> list[tuple[str, Any, Any]]:
    """``[(setting, a's value, b's value)]``: every resolved training setting in which method ``b``'s recipe differs
    from ``a``'s (settings that only one has are shown as ``—``; naming and logging settings left out)."""
    from omegaconf import OmegaConf

    fa = _flat(OmegaConf.to_container(compose("train", a.base_overrides()), resolve=True))
    fb = _flat(OmegaConf.to_container(compose("train", b.base_overrides()), resolve=True))
    out = []
    for k in sorted(set(fa) | set(fb)):
        if k in _NOT_TRAINING or k.startswith("hydra"):
            continue
        va, vb = fa.get(k, "—"), fb.get(k, "—")
        if va != vb:
            out.append((k, va, vb))
    return out


def pairing_exceptions(compose, names: Sequence[str]) -> dict[str, list[str]]:
    """Where seed s does not give a method the same prompts and first initial noises as the default: ``{method:
    [reasons]}`` for a category-balanced prompt list (``data.balance_by``: another prompt order), other prompts
    per iteration or group size (the same order, cut differently), and ``loop.same_latent=false`` (each sample its
    own initial noise: the first noise of a group differs)."""
    ref = compose("train", [])
    out: dict[str, list[str]] = {}
    for name in names:
        cfg = compose("train", method(name).base_overrides())
        why = []
        if cfg.data.get("balance_by"):
            why.append(f"prompts drawn from a list balanced by {cfg.data.balance_by} (another prompt order)")
        if (cfg.loop.prompts_per_iter, cfg.loop.group_size) != (ref.loop.prompts_per_iter, ref.loop.group_size):
            why.append(f"{cfg.loop.prompts_per_iter} prompts x {cfg.loop.group_size} samples per iteration (the "
                       "same prompt order, cut into other iterations)")
        if not cfg.loop.same_latent:
            why.append("loop.same_latent=false (each sample its own initial noise)")
        if why:
            out[name] = why
    return out


def planned_fractions(ovr: Sequence[str]) -> list[float]:
    v = next((o.split("=", 1)[1] for o in ovr if o.startswith("eval.at_fractions=")), "[]")
    return [float(x) for x in v.strip("[]").split(",") if x.strip()]


# ---------------------------------------------------------------------------------------------------- the ledger
ARCHIVED = ("config.yaml", "metrics.csv")  #: what of every finished run the ledger keeps (tens of kB)
#: and where the run has one: the settings of its last resume (an extended run's budget and evaluation points)
ARCHIVED_IF_PRESENT = ("config.resume.yaml",)
MARKER = "archived.json"  #: written into the ledger's copy: the run finished (its adapter may not be kept)


def note(msg: str) -> None:
    """One line on stderr about the ledger (what was skipped or moved aside, and why)."""
    print(f"[league] {msg}", file=sys.stderr, flush=True)


def text_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of every line of ``path`` that is UTF-8 text without NUL bytes; each other line is
    named (file and line) and skipped: what a crash during a write or a disk fault leaves must not stop the league."""
    out, bad = [], []
    for i, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            bad.append(i)
            continue
        if "\x00" in line:
            bad.append(i)
            continue
        out.append((i, line))
    if bad:
        note(f"{path}: line{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:8]))}"
             f"{' ...' if len(bad) > 8 else ''} {'are' if len(bad) > 1 else 'is'} not text (a disk fault?); skipped")
    return out


def read_records(path: Path, keys: Sequence[str] = ("phase", "method", "run", "rc", "wall_s")) -> list[dict[str, Any]]:
    """The JSON records of a ``.jsonl`` file that hold ``keys``; a line that is no such record (a half-written last
    line after a crash during the append) is named (file and line) and skipped."""
    out = []
    for i, line in text_lines(path):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            ok = isinstance(r, dict) and all(k in r for k in keys)
        except ValueError:
            ok = False
        if not ok:
            note(f"{path}:{i}: not a complete record (a line half-written when a run was stopped?); skipped")
            continue
        out.append(r)
    return out


def read_csv_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a csv file as dicts, reading what it can (:func:`text_lines`; a row that csv cannot split is named
    and skipped)."""
    import io

    good = text_lines(path)
    if not good:
        return []
    rows = []
    header = next(csv.reader([good[0][1]]), [])
    for i, line in good[1:]:
        try:
            values = next(csv.reader(io.StringIO(line)), [])
        except csv.Error as e:
            note(f"{path}:{i}: {e}; skipped")
            continue
        if values:
            rows.append(dict(zip(header, values)))
    return rows


def broken_run(run_dir: Path) -> str | None:
    """Why a run directory (under ``out`` or the ledger's ``runs/``) cannot be used, else None: a ``config.yaml`` that
    is no YAML mapping of the training groups, a ``metrics.csv`` that is not csv text, a ``checkpoints/last.ckpt``
    that is empty or no checkpoint (it would be resumed, fail, and be resumed again by every rerun)."""
    import zipfile

    import yaml

    run_dir = Path(run_dir)
    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        try:
            c = yaml.safe_load(cfg.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}: {getattr(e, 'problem', '')}" if mark is not None else type(e).__name__
            return f"{cfg} is not YAML ({where})"
        if not (isinstance(c, dict) and all(isinstance(c.get(k), dict) for k in ("loop", "train", "eval"))):
            return f"{cfg} is not a training config (no loop / train / eval groups)"
    metrics = run_dir / "metrics.csv"
    if metrics.is_file():
        data = metrics.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            return f"{metrics} is not text (line {line})"
        if "\x00" in text:
            line = text[:text.index("\x00")].count("\n") + 1
            return f"{metrics} holds NUL bytes (line {line})"
        try:
            head = next(csv.reader(text.splitlines()), [])
            list(csv.reader(text.splitlines()))
        except csv.Error as e:
            return f"{metrics} is not csv ({e})"
        if text.strip() and "iteration" not in head:
            return f"{metrics} has no iteration column (line 1: {','.join(head)[:80]!r})"
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    if ckpt.is_file() and (ckpt.stat().st_size == 0 or not zipfile.is_zipfile(ckpt)):
        return f"{ckpt} is {'empty' if ckpt.stat().st_size == 0 else 'no checkpoint'}"
    return None


def _live(run_dir: Path) -> bool:
    """A run holds the directory's lock (its process is alive on this host): never moved."""
    lock = Path(run_dir) / ".stepflow.lock"
    if not lock.is_file():
        return False
    try:
        holder = json.loads(lock.read_text() or "{}")
        os.kill(int(holder["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def set_aside(run_dir: Path, why: str) -> Path:
    """Move a broken run directory to ``<its parent>/.stale/<name>-<time>`` with one line saying which and why (the
    next invocation reruns the run; nothing is deleted)."""
    import shutil

    dest = run_dir.parent / ".stale" / f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(run_dir), str(dest))
    note(f"moved {run_dir} aside to {dest}: {why}; the run will be run again")
    return dest


def quarantine(s: Settings, dry_run: bool = False) -> int:
    """Every broken run directory (:func:`broken_run`) of the ledger's ``runs/`` and of ``out`` moved aside
    (:func:`set_aside`), so that the league reads what it can and goes on; ``dry_run``: only named. Returns how
    many."""
    roots = [r for r in ((s.ledger / "runs") if s.ledger is not None else None, Path(s.out)) if r is not None]
    n = 0
    for root in roots:
        if not root.is_dir():
            continue
        for d in sorted(p for p in root.glob("*/*/*") if p.is_dir() and not p.is_symlink()):
            if any(part.startswith(".") for part in d.relative_to(root).parts) or _live(d):
                continue
            why = broken_run(d)
            if why is None:
                continue
            n += 1
            if dry_run:
                note(f"{d} is broken ({why}); a run without --dry-run moves it aside")
            else:
                set_aside(d, why)
    return n


def keeps_adapter(phase: str, run: str) -> bool:
    """The ledger keeps the adapter (1 MB) of the table's seed 0 only: the image grids are drawn from it."""
    return phase == "table" and run == "seed=0"


def finished(run_dir: Path) -> bool:
    """A finished run: :func:`report.run_finished`, or a run restored from the ledger (its marker, no checkpoint
    written since)."""
    run_dir = Path(run_dir)
    if report.run_finished(run_dir):
        return True
    return (run_dir / MARKER).is_file() and (run_dir / "metrics.csv").is_file() and \
        not (run_dir / "checkpoints" / "last.ckpt").is_file()


def run_name(phase: str, lr: str, seed: int) -> str:
    return f"lr={lr},seed={seed}" if phase == "grid" else f"seed={seed}"


def archive_run(s: Settings, run_dir: Path) -> Path | None:
    """Copy a finished run's :data:`ARCHIVED` files (and the adapter where :func:`keeps_adapter`) to
    ``<ledger>/runs/<phase>/<method>/<run>``, replacing an older copy; returns the copy, or None without a ledger,
    for a run outside ``out`` or an unfinished one."""
    import shutil

    run_dir = Path(run_dir)
    if s.ledger is None or not finished(run_dir):
        return None
    try:
        rel = run_dir.resolve().relative_to(Path(s.out).resolve())
    except ValueError:
        return None
    if len(rel.parts) != 3:
        return None
    dest = s.ledger / "runs" / rel
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in (*ARCHIVED, *(n for n in ARCHIVED_IF_PRESENT if (run_dir / n).is_file())):
        shutil.copy2(run_dir / name, tmp / name)
    adapter = keeps_adapter(rel.parts[0], rel.parts[2]) and (run_dir / "lora").is_dir()
    if adapter:
        shutil.copytree(run_dir / "lora", tmp / "lora")
    (tmp / MARKER).write_text(json.dumps({"phase": rel.parts[0], "method": rel.parts[1], "run": rel.parts[2],
                                          "adapter": adapter, "archived": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def sync_archive(s: Settings) -> int:
    """Archive every finished run under ``out`` whose copy is missing or older; returns how many were copied."""
    if s.ledger is None:
        return 0
    n = 0
    for metrics in sorted(Path(s.out).glob("*/*/*/metrics.csv")):
        d = metrics.parent
        if any(part.startswith(".") for part in d.relative_to(s.out).parts) or not finished(d):
            continue
        copy = s.ledger / "runs" / d.relative_to(s.out) / "metrics.csv"
        if copy.is_file() and copy.read_bytes() == metrics.read_bytes():
            continue
        n += archive_run(s, d) is not None
    return n


def restore_archive(s: Settings) -> int:
    """Copy every archived run that ``out`` lacks (no config.yaml there) back into ``out``; returns how many."""
    import shutil

    if s.ledger is None or not (s.ledger / "runs").is_dir():
        return 0
    n = 0
    root = s.ledger / "runs"
    for cfg in sorted(root.glob("*/*/*/config.yaml")):
        src = cfg.parent
        if any(part.startswith(".") for part in src.relative_to(root).parts):
            continue
        dest = Path(s.out) / src.relative_to(root)
        if (dest / "config.yaml").is_file():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dest, dirs_exist_ok=True)
        n += 1
    return n


_LEDGER_CACHE: dict[Path, tuple[float, list[dict[str, Any]]]] = {}


def ledger_rows(s: Settings, phase: str) -> list[dict[str, Any]]:
    """The ledger csv's rows of ``phase`` (lr_grid.csv for the grid, results.csv otherwise), typed as
    :func:`collect` returns them."""
    if s.ledger is None:
        return []
    f = s.ledger / ("lr_grid.csv" if phase == "grid" else "results.csv")
    if not f.is_file():
        return []
    mtime = f.stat().st_mtime
    if f not in _LEDGER_CACHE or _LEDGER_CACHE[f][0] != mtime:
        rows = []
        for r in read_csv_rows(f):  # every row it can read (the lines it cannot are named)
            try:
                row: dict[str, Any] = {"phase": r["phase"], "method": r["method"], "seed": int(r["seed"]),
                                       "lr": lr_str(float(r["lr"])), "budget": int(r["budget"]),
                                       "fraction": float(r["fraction"]), "iteration": int(r["iteration"]),
                                       "nfe": int(r["nfe"]), "seconds": float(r["seconds"]),
                                       "reward_images": int(r["reward_images"]), "geneval": float(r["geneval"])}
                # rows written before run_budget existed: the run's budget is the point over its fraction
                row["run_budget"] = int(float(r["run_budget"])) if r.get("run_budget") not in (None, "") else \
                    int(round(row["budget"] / row["fraction"]))
                row.update({c: float(r[c]) if r.get(c) not in (None, "") else math.nan
                            for c in (*CATEGORIES, *SCENE_COLUMNS)})
            except (KeyError, TypeError, ValueError):
                continue
            rows.append(row)
        _LEDGER_CACHE[f] = (mtime, rows)
    return [r for r in _LEDGER_CACHE[f][1] if r["phase"] == phase]


def ledger_run_rows(s: Settings, phase: str, method_name: str, seed: int, lr: str, fractions: Sequence[float],
                    budget: float | None = None) -> list[dict[str, Any]]:
    """The ledger's rows of one run at ``fractions`` (of a run to ``budget``, when given), or [] unless it has every
    one of them."""
    rows = [r for r in ledger_rows(s, phase) if r["method"] == method_name and r["seed"] == seed
            and r["lr"] == lr_str(float(lr)) and any(abs(r["fraction"] - f) < 1e-9 for f in fractions)
            and (budget is None or abs(r["run_budget"] - budget) <= 0.5)]
    got = {round(r["fraction"], 9) for r in rows}
    return rows if fractions and got >= {round(f, 9) for f in fractions} else []


# ---------------------------------------------------------------------------------------------------- results
#: beside GenEval, every evaluation's exact-scene score and mean number of objects not asked for (overall and per
#: category: ``exact_scene_<category>``, ``extra_objects_<category>``; stepflow.core.heldout.SCENE_COMPONENTS)
SCENE = ("exact_scene", "extra_objects")
SCENE_COLUMNS = [*SCENE, *(f"{k}_{c}" for k in SCENE for c in CATEGORIES)]


def eval_rows(run_dir: Path, budget: float, fractions: Sequence[float]) -> list[dict[str, Any]]:
    """The run's evaluations as budget points: ``[{budget, fraction, run_budget, iteration, nfe, seconds,
    reward_images, geneval, <category>..., exact_scene, extra_objects, ...}]``. Budget point f·``budget`` takes the
    first evaluation whose spent NFEs reach it (the run evaluates after the first iteration past each point; one
    iteration that passes two points serves both); ``nfe``, ``seconds`` and ``reward_images`` are what the run had
    actually spent there."""
    rows = report.read_metrics(run_dir / "metrics.csv")
    spent: dict[int, dict[str, float]] = {}
    for r in rows:
        if "cost/nfe_fwd_equiv_total" in r:
            spent[int(r["iteration"])] = r
    evals = []
    for r in rows:
        tr = spent.get(int(r["iteration"])) if "eval/geneval" in r else None
        if tr is not None:
            evals.append((tr["cost/nfe_fwd_equiv_total"], r, tr))
    evals.sort(key=lambda e: e[0])
    out = []
    for f in sorted(fractions):
        hit = next((e for e in evals if e[0] >= f * budget * (1 - 1e-9)), None)
        if hit is None:
            continue
        nfe, r, tr = hit
        row = {"budget": int(round(f * budget)), "fraction": f, "run_budget": int(round(budget)),
               "iteration": int(r["iteration"]), "nfe": int(nfe),
               "seconds": round(tr.get("cost/train_seconds_total", math.nan), 1),
               "reward_images": int(tr.get("cost/reward_images_total", 0)), "geneval": r["eval/geneval"]}
        for c in CATEGORIES:
            row[c] = r.get(f"eval/geneval_{c}", math.nan)
        for k in SCENE_COLUMNS:
            row[k] = r.get(f"eval/{k}", math.nan)
        out.append(row)
    return out


RESULT_COLUMNS = ["phase", "method", "seed", "lr", "budget", "fraction", "run_budget", "iteration", "nfe", "seconds",
                  "reward_images", "geneval", *CATEGORIES, *SCENE_COLUMNS]


def base_scores(s: Settings) -> dict[str, dict[str, float]]:
    """``{base name: {"geneval": ..., <category>: ...}}`` from the base runs' iteration-0 evaluations."""
    out = {}
    for m in BASES:
        f = s.out / "base" / m.name / "seed=0" / "metrics.csv"
        if not f.is_file():
            continue
        r0 = next((r for r in report.read_metrics(f) if int(r["iteration"]) == 0 and "eval/geneval" in r), None)
        if r0 is not None:
            out[m.name] = {"geneval": r0["eval/geneval"], **{c: r0.get(f"eval/geneval_{c}", math.nan) for c in CATEGORIES},
                           **{k: r0.get(f"eval/{k}", math.nan) for k in SCENE_COLUMNS}}
    return out


def collect(s: Settings, phases: Sequence[str] = ("table", "claims")) -> list[dict[str, Any]]:
    """One row per finished run and budget point of ``phases`` (the runs on disk, whatever the plan)."""
    import yaml

    out = []
    for phase in phases:
        for mdir in sorted((s.out / phase).glob("*")):
            if not mdir.is_dir() or mdir.name.startswith("."):
                continue
            for d in sorted(mdir.iterdir()):
                if not d.is_dir() or d.name.startswith(".") or not finished(d):
                    continue
                try:
                    cfg = yaml.safe_load((d / "config.yaml").read_text()) or {}
                    budget = float(cfg["loop"]["budget"])
                    fractions = [float(f) for f in cfg["eval"]["at_fractions"]]
                    seed, lr = int(cfg["seed"]), lr_str(float(cfg["train"]["lr"]))
                    evals = eval_rows(d, budget, fractions)
                except (OSError, KeyError, TypeError, ValueError, csv.Error, yaml.YAMLError) as e:
                    note(f"{d}: cannot read its config.yaml / metrics.csv ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:120]}); left out of the report")
                    continue
                for r in evals:
                    out.append({"phase": phase, "method": mdir.name, "seed": seed, "lr": lr, **r})
        out += [r for r in ledger_rows(s, phase)  # runs measured before the archive: their committed rows
                if not (s.out / phase / r["method"] / run_name(phase, r["lr"], r["seed"])).exists()]
    return out


def write_csv(rows: Sequence[dict[str, Any]], path: Path, columns: Sequence[str] = RESULT_COLUMNS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return path


# ---------------------------------------------------------------------------------------------------- running
def record_run(r: Run, rc: int, wall_s: float, ledger: Path | None = None) -> None:
    """Append the run's exit and wall time to ``<out>/runs.jsonl``, or with a ledger to ``<ledger>/runs.jsonl``
    (the report sums them: what the league cost)."""
    out = (ledger if ledger is not None else r.run_dir.parents[2]) / "runs.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh:
        fh.write(json.dumps({"phase": r.phase, "method": r.method.name, "run": r.run_dir.name, "rc": rc,
                             "wall_s": round(wall_s, 1), "end": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")


def time_left(queued: Sequence[float], live: Sequence[float], jobs: int) -> float:
    """Seconds until a pool is done: the live runs' remaining seconds, then the queued runs longest first, each on the
    first worker to free (as :func:`run_pool` starts them), on ``jobs`` workers."""
    free = sorted(max(0.0, x) for x in live)[:max(1, jobs)]
    free += [0.0] * (max(1, jobs) - len(free))
    heapq.heapify(free)
    for c in sorted(queued, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + max(0.0, c))
    return max(free)


def left_text(sec: float) -> str:
    if sec >= 3600:
        return f"about {sec / 3600:.1f} h left"
    return f"about {sec / 60:.0f} min left" if sec >= 120 else f"about {sec:.0f} s left"


def run_pool(runs: Sequence[Run], jobs: int, env: dict[str, str], prefix: Sequence[str] = (),
             s: Settings | None = None) -> list[int]:
    """Run the runs ``jobs`` at a time, longest expected first; Ctrl-C / SIGTERM stops the running ones cleanly
    (stepflow checkpoints and exits) and starts no more. With ``s``, each finished run goes to its ledger."""
    from tqdm import tqdm

    jobs = max(1, int(jobs))  # 0 would start nothing and wait for ever
    todo = sorted(runs, key=lambda r: -r.cost)
    live: list[tuple[Run, subprocess.Popen, Any, float]] = []
    codes: list[int] = []
    stopping = False

    def stop(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True
        for _, p, _, _ in live:
            p.send_signal(signal.SIGTERM)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    # the time left comes from the runs' expected seconds, scaled by what the finished ones took against theirs:
    # tqdm's own estimate divides by the recent rate, which parallel runs finishing together make twice too long
    spent, expected, shown = 0.0, 0.0, 0.0

    def show(now: float, refresh: bool = True) -> None:
        nonlocal shown
        ratio = spent / expected if expected > 0 else 1.0
        left = time_left([r.cost * ratio for r in todo], [r.cost * ratio - (now - t0) for r, _, _, t0 in live], jobs)
        bar.set_postfix_str(left_text(left), refresh=refresh)
        shown = now

    bar = tqdm(total=len(todo), desc="league", unit="run", dynamic_ncols=True,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
               postfix=left_text(time_left([r.cost for r in todo], [], jobs)))
    try:
        while todo or live:
            while todo and len(live) < jobs and not stopping:
                r = todo.pop(0)
                r.run_dir.parent.mkdir(parents=True, exist_ok=True)
                fh = open(r.run_dir.parent / f"{r.run_dir.name}.out", "a")
                cmd = r.command(prefix=prefix)
                fh.write(f"$ {shlex.join(cmd)}\n")
                fh.flush()
                live.append((r, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                                 start_new_session=True), fh, time.time()))
            if stopping and not live:
                break
            time.sleep(1.0)
            if time.time() - shown >= 60:
                show(time.time())
            for item in list(live):
                r, p, fh, t0 = item
                rc = p.poll()
                if rc is None:
                    continue
                live.remove(item)
                fh.close()
                codes.append(rc)
                if rc == 0 and r.status != "resume":  # a resumed run did only part of its expected work
                    spent, expected = spent + time.time() - t0, expected + r.cost
                record_run(r, rc, time.time() - t0, None if s is None else s.ledger)
                if s is not None and rc == 0:
                    try:
                        archive_run(s, r.run_dir)
                    except OSError as e:  # the run is kept in out; the next --report archives it
                        bar.write(f"[league] could not archive {r.run_dir}: {e}")
                show(time.time(), refresh=False)
                bar.update(1)
                msg = f"{r.phase}/{r.method.name}/{r.run_dir.name}: exit {rc} after {time.time() - t0:.0f} s"
                bar.write(f"[league] {msg}" + ("" if rc == 0 else f" (log: {r.run_dir.parent / (r.run_dir.name + '.out')})"))
    finally:
        bar.close()
        for sig, h in old.items():
            signal.signal(sig, h)
    return codes


def check_args(ap: argparse.ArgumentParser, a: argparse.Namespace, s: Settings) -> None:
    """The command line's values into ``s``, each checked before anything runs (argparse's one-line error)."""
    try:
        s.prefix = tuple(shlex.split(a.prefix))
    except ValueError as e:
        ap.error(f"--prefix: cannot split {a.prefix!r} into a command ({e}); close its quotes")
    if a.methods is not None:
        names = tuple(n.strip() for n in a.methods.split(",") if n.strip())
        known = {m.name for m in METHODS}
        bad = [n for n in names if n not in known]
        if bad:
            ap.error(f"--methods: unknown {bad}; choose from {sorted(known)}")
        if not names:
            ap.error(f"--methods: names no method ({a.methods!r}); give comma-separated names, e.g. default,nft")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            ap.error(f"--methods: {dup[0]} is given twice (its runs would share one run dir); name each method once")
        s.methods = names
    if a.seeds is not None:
        s.seeds = ablations.int_list(ap, "--seeds", a.seeds)
        s.power_target = 0.0  # the seeds named are the seeds run: no central-claim seeds added
    if a.max_seeds is not None:
        if a.max_seeds < 0:
            ap.error(f"--max-seeds: must be an integer >= 0 (0: no seeds added for the central claim), got {a.max_seeds}")
        s.max_seeds = a.max_seeds  # named: seeds are added up to it, --seeds or not
        s.power_target = Settings.power_target if a.max_seeds > len(s.seeds) else 0.0
    if a.budget is not None:
        if not (math.isfinite(a.budget) and a.budget * s.grid_budget_fraction >= 1):
            ap.error(f"--budget: must be a finite number of forward-equivalent NFEs >= {1 / s.grid_budget_fraction:g} "
                     f"(the grid runs to {s.grid_budget_fraction:g} of it), got {a.budget}")
        s.budget = a.budget
    for item in (x.strip() for x in (a.budget_for or "").split(",") if x.strip()):
        name, eq, val = item.partition("=")
        known = {m.name for m in (*METHODS, *CLAIM_ARMS)}
        try:
            b = float(val)
        except ValueError:
            b = math.nan
        if not eq or name.strip() not in known or not (math.isfinite(b) and b >= s.budget):
            ap.error(f"--budget-for: {item!r} must be <method>=<NFEs> with a league method or claims arm and a budget "
                     f">= --budget ({s.budget:g}), e.g. flow_grpo=240000")
        s.budget_for[name.strip()] = b
    if a.jobs < 1:
        ap.error(f"--jobs: must be an integer >= 1 (runs at once), got {a.jobs}")
    s.claims = s.claims and not a.no_claims
    s.grid = s.grid and not a.no_grid
    if a.out:
        s.out = ablations.writable_dir(ap, "--out", Path(a.out).expanduser().resolve())
    if a.docs:
        ablations.writable_dir(ap, "--docs", Path(a.docs).expanduser().resolve())


def main(argv: Sequence[str] | None = None) -> int:
    argv, extra = ablations.split_overrides(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Arguments after `--` are Hydra overrides added to every run.")
    ap.add_argument("--quick", action="store_true", help="make league-quick: 4 methods, 2 seeds, one budget of 8,000")
    ap.add_argument("--scale", default="mini", choices=["mini", "paper"],
                    help="mini: the embedded world on the CPU; paper: SD3.5-M, GenEval, 8 GPUs per run (see --prefix)")
    ap.add_argument("--prefix", default="", help="a launcher for every run's command, e.g. 'srun -N1 --gpus-per-node 8'")
    ap.add_argument("--phase", default="all", choices=["base", "grid", "table", "claims", "all"])
    ap.add_argument("--methods", default=None, help="comma-separated method names (default: every league method)")
    ap.add_argument("--seeds", default=None, help="comma-separated table seeds (default 0..4; given, the central "
                    "claim's arms get no more unless --max-seeds is given too)")
    ap.add_argument("--max-seeds", type=int, default=None,
                    help="the most seeds the central claim's arms get for its power (default 20; 0: none added)")
    ap.add_argument("--budget", type=float, default=None, help="forward-equivalent NFEs per run (default 120000)")
    ap.add_argument("--budget-for", default=None,
                    help="per-method budgets, e.g. flow_grpo=240000,awm=180000 (else still-rising methods double, "
                         "see the report's rule)")
    ap.add_argument("--no-claims", action="store_true", help="skip the claims arms")
    ap.add_argument("--no-grid", action="store_true", help="skip the lr grid (every method at its config's lr)")
    ap.add_argument("--out", default=None, help="run directory root (default outputs/league)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (default 1; 2 on 2 cores)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    ap.add_argument("--report", action="store_true", help="only write the report from the runs on disk")
    ap.add_argument("--docs", default=None, help="where the report goes (default docs/league; quick: <out>/report)")
    ap.add_argument("--list", action="store_true", help="list the methods and claims arms")
    a = ap.parse_args(argv)

    if a.list:
        for m in (*METHODS, *CLAIM_ARMS):
            print(f"{m.name:26s} {shlex.join(m.base_overrides()) or '(defaults)':60s} {m.title}")
        return 0
    s = quick_settings() if a.quick else Settings()
    if a.scale == "paper":
        s.budget, s.out = PAPER_BUDGET, s.out.parent / f"{s.out.name}_paper"
        extra = [*PAPER_EXTRA, *extra]
    check_args(ap, a, s)
    s.extra = tuple(extra)
    docs = Path(a.docs).resolve() if a.docs else (DOCS if not (a.quick or a.out or a.scale == "paper") else s.out / "report")
    s.ledger = docs
    quarantine(s, dry_run=a.dry_run)  # broken run dirs (ledger and out) moved aside: the league goes on

    if not a.report:
        phases = ["base", "grid", "table", "claims"] if a.phase == "all" else [a.phase]
        env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        queue, tried = list(phases), set()
        while queue:  # the table's lr depends on the finished grid: plan each phase after the one before ran
            ph = queue.pop(0)
            forget_configs()  # hours may have passed: read the recipes' files again
            try:
                runs = plan(s, [ph])
            except Exception as e:  # noqa: BLE001 - a bad override or experiment: one line
                print(f"league: error: cannot compose a planned run: {' '.join(str(e).split())[:400]}", file=sys.stderr)
                return 2
            if ph == "grid" and not a.dry_run and any(r.status != "finished" for r in runs):
                queue.insert(0, "grid")  # after these runs the grid may extend at an edge: plan it again
            n = {k: sum(r.status == k for r in runs) for k in ("finished", "resume", "stale", "missing")}
            hours = time_left([r.cost for r in runs if r.status != "finished"], [], a.jobs) / 3600
            print(f"[league] {ph}: {len(runs)} runs under {s.out / ph}: {n['finished']} finished, {n['resume']} to "
                  f"resume, {n['stale']} stale, {n['missing']} to run (about {hours:.1f} h at --jobs {a.jobs})")
            todo = [r for r in runs if r.status != "finished"]
            if not a.dry_run and todo and {str(r.run_dir) for r in todo} <= tried:
                print(f"[league] {ph}: {len(todo)} runs ran and are still unfinished (see their .out logs); stopping")
                return 1
            tried |= {str(r.run_dir) for r in todo}
            if a.dry_run:
                for r in todo:
                    print(shlex.join(r.command(prefix=s.prefix)))
                continue
            for r in todo:
                if r.status == "stale":
                    dest = ablations.move_stale(r)  # reads only r.run_dir
                    print(f"[league]   stale {r.run_dir.name} ({r.reason}) moved to {dest}")
            codes = run_pool(todo, a.jobs, env, s.prefix, s) if todo else []
            if any(c != 0 for c in codes):
                print(f"[league] {ph}: {sum(c != 0 for c in codes)} of {len(codes)} runs failed or were stopped")
                return 1
            if ph in ("table", "claims"):  # where methods end: a still-rising one runs on to twice its budget
                names = s.methods if ph == "table" else [m.name for m in CLAIM_ARMS if m.parent in s.methods]
                new = decide_extensions(s, names)
                if new:
                    print("[league] still rising at the end of their budget (rule: peak at the last point, last "
                          f"interval >= {s.rise_tol:g}): " + ", ".join(f"{k} -> {v:,.0f} NFEs" for k, v in new.items())
                          + f" (kept in {s.ledger / BUDGETS_FILE})")
                    tried = {t for t in tried if not any(f"{os.sep}{ph}{os.sep}{k}{os.sep}" in t for k in new)}
                    queue.insert(0, ph)
                    continue
                more = decide_power(s)
                if more:
                    print(f"[league] the central claim's power (detectable difference <= {s.power_target:g} at the "
                          f"measured paired sd, at most {s.max_seeds} seeds): " + ", ".join(
                              f"{k} -> {v} seeds" for k, v in more.items()) + f" (kept in {s.ledger / SEEDS_FILE})")
                    queue[:0] = [p for p in ("table", "claims") if p in phases and p not in queue]
        if a.dry_run:
            return 0
    import league_report  # experiments/league_report.py

    restore_archive(s)
    sync_archive(s)
    md = league_report.write_report(s, docs, readme=ROOT / "README.md" if docs == DOCS else None)
    print(f"[league] report: {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
