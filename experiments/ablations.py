#!/usr/bin/env python
"""Ablation suites of stepflow: plan the runs, launch the missing ones with Hydra ``--multirun``, write the report.

    python experiments/ablations.py                          # miniature suite ("full", make ablations), CPU
    python experiments/ablations.py --suite quick            # reduced suite (make ablations-quick)
    python experiments/ablations.py --suite paper            # paper scale on SLURM (make ablations SCALE=paper)
    python experiments/ablations.py --suite quick --dry-run  # print the plan and the command lines only
    python experiments/ablations.py --suite step0            # method x SDE on the default (step-0) recipe
    python experiments/ablations.py --only substeps,credit --seeds 0,1 --jobs 2 -- model.path=/my/base_model

Each ablation is one experiment file (``conf/experiment/``) plus its axes; a suite is a list of ablations, the
seeds, and overrides common to all its runs. Runs land in ``<sweep dir>/<ablation>/<run>``, where ``<run>`` is
Hydra's ``override_dirname`` of the run's own overrides, i.e. its arm and seed, sorted (e.g.
``advantage=gain,sampler=ddim_sde,seed=0``; the experiment, the suite's common overrides and ``ckpt_path`` are
excluded), so the names are deterministic and a second invocation finds the runs of the first.

Skipping: before launching, every planned (arm, seed) run is checked. A run whose ``metrics.csv`` holds the final
evaluation row (or whose ``lora/`` adapter exists) and whose stored ``config.yaml`` agrees with the planned config is
*finished* and skipped; an unfinished run with ``checkpoints/last.ckpt`` is *resumed* (``ckpt_path=...``; so is a run
whose plan only raises ``loop.iterations`` or ``loop.budget``, evaluating at every point it did: it is extended, and
its ``config.resume.yaml`` is then the config compared); a run whose stored config disagrees with the plan
otherwise (a changed experiment file or override) is *stale*: it is moved to ``<ablation>/.stale/`` and rerun;
anything else is (re)started. Only missing runs are launched: when every arm of an
ablation miss the same seeds, one multirun over the axes (``advantage=uniform,gain sampler=... seed=0,1,2``; likewise
for any sub-grid of the axes that misses the same seeds), else one multirun per arm with that arm's missing seeds,
and one command per resumed run. A run identical to one of an earlier ablation (the baseline arm the ablations
share: same resolved config apart from the experiment's name, same seed) is not run twice: its directory becomes a
relative symlink to that run.

Afterwards ``<sweep dir>/report/`` is written by ``experiments/report.py`` (markdown table + PNG plots).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402  (experiments/report.py)

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------- definitions
@dataclass
class Ablation:
    """One ablation: an experiment file and its arms.

    axes: ``{override key: [values]}``; the arms are their product (in order). extra_arms: further arms, each a dict
    of overrides (e.g. the adaptive substep count). Every arm must set at least one override.
    """

    name: str
    experiment: str
    axes: dict[str, list[str]] = field(default_factory=dict)
    extra_arms: list[dict[str, str]] = field(default_factory=list)
    title: str = ""
    question: str = ""

    def product_arms(self) -> list[dict[str, str]]:
        keys = list(self.axes)
        return [dict(zip(keys, vals)) for vals in itertools.product(*(self.axes[k] for k in keys))] if keys else []

    def arms(self) -> list[dict[str, str]]:
        arms = self.product_arms() + [dict(a) for a in self.extra_arms]
        for a in arms:
            if not a:
                raise ValueError(f"ablation {self.name}: an arm without overrides")
        return arms


@dataclass
class Suite:
    """A list of ablations run with the same seeds, common overrides and launcher."""

    name: str
    ablations: list[Ablation]
    seeds: list[int]
    common: list[str] = field(default_factory=list)  #: overrides of every run (not part of run directory names)
    launcher: str | None = None  #: hydra/launcher option; None = Hydra's basic launcher (sequential, in-process)
    sweep_dir: str = "outputs/ablations"
    description: str = ""


#: the four ablations of `make ablations`: name -> (miniature experiment, paper experiment, axes, extra arms, title,
#: question)
_ABLATIONS: dict[str, tuple[str, str, dict[str, list[str]], list[dict[str, str]], str, str]] = {
    "method_sampler": (
        "mini_fig6_sde", "paper_fig6_sde",
        {"advantage": ["uniform", "gain"], "sampler": ["flow_sde", "ddim_sde"]}, [],
        "method x SDE (paper Fig. 4 and Fig. 6)",
        "Flow-GRPO's uniform credit vs Stepwise-Flow-GRPO's gains, each with Flow-GRPO's SDE (a = 0.7) and the "
        "DDIM-style SDE (eta = 0.9). Paper: gains are more sample-efficient, the DDIM SDE helps both, the two stack."),
    "substeps": (
        "mini_fig10_substeps", "paper_fig10_substeps",
        {"loop.substeps": ["1", "2", "5", "8"]}, [{"loop.adaptive_substeps": "true"}],
        "substeps T' of the x0 estimate (paper Fig. 10, App. C.2)",
        "Euler substeps T' of the x0 estimates behind the stepwise rewards (1 = Tweedie) and the adaptive count "
        "ceil(5 t). Paper: T' in {2, 5, 8} perform alike per iteration and per GPU-hour."),
    "normalization": (
        "mini_fig9_norm", "paper_fig9_norm",
        {"advantage": ["gain", "gain_per_step"]}, [],
        "joint vs per-step normalisation of the gains (paper Fig. 9, App. C.1)",
        "Gains normalised jointly over group x steps (advantage=gain) or separately per step "
        "(advantage=gain_per_step). Paper: joint converges faster, final rewards similar."),
    "credit": (
        "mini_fig7_credit", "paper_fig7_credit",
        {"advantage": ["gain", "gain_ema", "gae"]}, [{"objective": "distill"}],
        "credit variants (paper Fig. 7, App. A)",
        "Plain gains vs gains minus a per-step EMA baseline (alpha 0.9) vs GAE over the gains (gamma 1, lambda 0.9) "
        "vs gain-weighted ODE progressive distillation. Paper: no variant is significantly better than plain gains."),
}


def make_ablations(scale: str, names: Sequence[str] | None = None,
                   axes_override: dict[str, dict[str, list[str]]] | None = None,
                   extra_override: dict[str, list[dict[str, str]]] | None = None) -> list[Ablation]:
    """The ablations at ``scale`` ("mini" | "paper"), optionally a subset and with reduced axes."""
    out = []
    for name, (mini, paper, axes, extra, title, question) in _ABLATIONS.items():
        if names is not None and name not in names:
            continue
        ax = (axes_override or {}).get(name, axes)
        ex = (extra_override or {}).get(name, extra)
        out.append(Ablation(name, mini if scale == "mini" else paper, {k: list(v) for k, v in ax.items()},
                            [dict(e) for e in ex], title, question))
    return out


#: overrides of the quick suite: the miniature protocol at under a third of the length and half the group
QUICK_COMMON = ["loop.iterations=6", "loop.group_size=8", "eval.every=3", "eval.max_prompts=96"]


def build_suites() -> dict[str, Suite]:
    full = Suite(
        "full", make_ablations("mini"), [0, 1, 2], sweep_dir="outputs/ablations/full",
        description="Miniature suite (`make ablations`): the embedded world on the CPU, the paper's protocol at "
                    "miniature scale (conf/experiment/mini_base.yaml), 3 seeds per arm.")
    quick = Suite(
        "quick",
        make_ablations("mini", axes_override={"substeps": {"loop.substeps": ["1", "5"]},
                                              "credit": {"advantage": ["gain", "gae"]}},
                       extra_override={"substeps": [], "credit": []}),
        [0, 1], common=list(QUICK_COMMON), sweep_dir="outputs/ablations/quick",
        description="Quick suite (`make ablations-quick`): the miniature suite reduced to 6 iterations of 2 prompts "
                    "x 8 samples, evaluation on 96 held-out prompts every 3 iterations, 2 seeds, fewer arms "
                    "(T' in {1, 5}; credit gain vs GAE). A check of the whole pipeline with a first signal, not a "
                    "result.")
    paper = Suite(
        "paper", make_ablations("paper"), [0, 1, 2], launcher="slurm", sweep_dir="outputs/ablations/paper",
        description="Paper-scale suite (`make ablations SCALE=paper`): SD3.5-Medium on 8 GPUs per run through the "
                    "SLURM launcher (conf/hydra/launcher/slurm.yaml), the paper's settings (paper_base.yaml).")
    ddim, over_all = {"sampler": "ddim_sde"}, {"advantage.over": "all"}
    step0 = Suite(
        "step0",
        [Ablation("method_sampler", "mini_step0", {"advantage": ["uniform", "gain"], "sampler": ["flow_sde", "ddim_sde"]},
                  [], "method x SDE with only step 0 trained (the default recipe)",
                  "Uniform credit vs gains, each with Flow-GRPO's SDE (a = 0.7) and the DDIM SDE (eta = 0.9, eta_s), on "
                  "the default recipe: 60 iterations x 4 prompts x 16, only denoising step 0 trained."),
         Ablation("cost", "mini_step0", {}, [{"advantage": "gain", **ddim}, {"advantage": "gain", **over_all, **ddim},
                                             {"advantage": "gain", **over_all, "loop.adaptive_substeps": "true", **ddim},
                                             {"advantage": "gain", **over_all, "sampler": "flow_sde"},
                                             {"advantage": "uniform", **ddim}],
                  "doing only the work the credit uses (step 0 trained)",
                  "The default recipe normalises step 0's gains over the trained step only, so it estimates and "
                  "scores just X_0 and X_1 and stops the rollout after X_1; against gains normalised over every step "
                  "(advantage.over=all, the paper's Eq. 5, which needs every state: with the DDIM and Flow-GRPO "
                  "SDEs), the same with adaptive substeps ceil(T' t), and uniform credit; per iteration and per "
                  "second (the default gain and uniform arms are method_sampler's runs).")],
        [0, 1, 2], sweep_dir="outputs/ablations/step0",
        description="Step-0 suite: method x SDE and the work reductions on the default recipe of "
                    "`python -m stepflow.train` (conf/experiment/mini_step0.yaml), 3 seeds per arm.")
    every = {"train.train_steps": "null"}  # every noisy step trained (gains normalised over all steps, Eq. 5)
    allsteps = Suite(
        "allsteps",
        [Ablation("weighting", "mini_step0", {}, [{**every, "train.weighting": w} for w in
                                                  ("none", "noise", "guard", "grad_rms", "gain_var")],
                  "every noisy step trained, with each per-step weighting",
                  "Training all 9 noisy steps of the default recipe: unweighted, TempFlow-GRPO's noise weighting, "
                  "GRPO-Guard's normalised ratio, per-step gradient RMS normalisation, gain-variance weights."),
         Ablation("window", "mini_step0", {}, [{**every, "window": w} for w in ("fixed", "sliding", "random")],
                  "SDE windows (3 steps)",
                  "Flow-GRPO-Fast's fixed window (steps 0-2), MixGRPO's sliding window (moved one step every 10 "
                  "iterations) and DanceGRPO's random subset (3 steps per iteration); ODE elsewhere, only the window "
                  "trained."),
         Ablation("auto", "mini_step0", {}, [{"train.train_steps": "null", "train.weighting": "auto"}],
                  "train.weighting=auto",
                  "Every noisy step measured, weighted by its online gradient signal fraction (no step named).")],
        [0, 1, 2], common=["window.size=3", "window.every=10", "advantage.over=all"], sweep_dir="outputs/ablations/allsteps",
        description="Every-step suite: credit for every step on the default recipe (conf/experiment/mini_step0.yaml), "
                    "weightings, SDE windows and automatic step weighting, 3 seeds per arm.")
    source = Suite(
        "source",
        [Ablation("reward_source", "mini_allsteps", {}, [{"advantage.reward_source": r} for r in ("tweedie", "completion")],
                  "stepwise rewards from x̂0 estimates or from ODE completions",
                  "The every-step recipe (conf/experiment/mini_allsteps.yaml) with its rewards R_k from T' substep "
                  "x̂0 estimates (the paper's) or from the Euler ODE completion of each state (T - k NFEs each): "
                  "what the cheap estimate costs in learning, per iteration and per NFE.")],
        [0, 1, 2], sweep_dir="outputs/ablations/source",
        description="Reward-source suite: the every-step recipe trained with x̂0-estimate and ODE-completion rewards, "
                    "3 seeds per arm (docs/results.md, \"Credit quality\").")
    return {s.name: s for s in (full, quick, paper, step0, allsteps, source)}


# ---------------------------------------------------------------------------------------------------- naming
def override_key(override: str) -> str:
    """The key of a ``key=value`` override (``+``/``~``/``++`` prefixes dropped), as Hydra's ``key_or_group``."""
    return override.split("=", 1)[0].lstrip("+~")


def run_name(arm: dict[str, str], seed: int) -> str:
    """The run directory name Hydra gives the job: ``override_dirname`` of the arm's overrides and the seed (each
    ``key=value``, sorted as strings, joined by ``,``; Hydra's defaults kv_sep ``=`` and item_sep ``,``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [f"{k}={v}" for k, v in arm.items()] + [f"seed={seed}"]
    # as Hydra's sweeper rewrites each job's overrides: parsed values as strings (`true` -> `True`, 1e-3 -> 0.001)
    parsed = OverridesParser.create().parse_overrides(lines)
    return ",".join(sorted(f"{o.key_or_group}={o.get_value_element_as_str()}" for o in parsed))


def arm_label(arm: dict[str, str]) -> str:
    """The arm's name in the report: its run directory name without the seed."""
    return ",".join(sorted(f"{k}={v}" for k, v in arm.items()))


def hydra_value(s: str) -> str:
    """Quote a string for a Hydra override value when it holds characters the override grammar treats specially."""
    if re.fullmatch(r"[A-Za-z0-9_./:@+-]*", s):
        return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


# ---------------------------------------------------------------------------------------------------- planning
@dataclass
class Job:
    """One planned run: (ablation, arm, seed) and its state on disk."""

    ablation: Ablation
    arm: dict[str, str]
    seed: int
    run_dir: Path
    status: str = "missing"  #: finished | resume | stale | missing | shared
    reason: str = ""
    same_as: "Job | None" = None  #: shared: the identical run of an earlier ablation (linked, not run again)


def planned_config(experiment: str, overrides: Sequence[str], compose=None) -> dict[str, Any]:
    """The resolved config a run will get (Hydra compose of ``train`` with the run's overrides); ``compose``: the
    composer of a block of plannings (:func:`stepflow.config.composer`), else one is opened for this call."""
    from omegaconf import OmegaConf

    from stepflow.config import composer

    if compose is None:
        with composer() as c:
            return planned_config(experiment, overrides, c)
    cfg = compose("train", [f"experiment={experiment}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def config_mismatch(stored: dict[str, Any], planned: dict[str, Any]) -> list[str]:
    """Keys present in both configs whose values differ (``seed``, ``loop.seed`` and :data:`IGNORED_KEYS` ignored).
    Keys only one side has (a default added to train.yaml later) do not count; a ``_target_`` compares the class or
    function it names, not its dotted path (a part moved to another module, or named through a re-export, is the
    same part)."""
    a, b = report.flatten(stored), report.flatten(planned)
    return sorted(k for k in a.keys() & b.keys()
                  if k not in report.SEED_KEYS and k not in IGNORED_KEYS and _differ(k, a[k], b[k]))


def _differ(key: str, a: Any, b: Any) -> bool:
    if key == "_target_" or key.endswith("._target_"):
        return a != b and _target(a) != _target(b)
    return _norm(a) != _norm(b)


def _target(path: Any) -> Any:
    """The object a ``_target_`` names, as ``module.qualname`` of where it is defined (the path itself where it does
    not import)."""
    if not isinstance(path, str):
        return path
    obj = _import_quietly(path)
    if obj is None:  # a stored path that no longer imports is compared as written
        return path
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', path)}"


def _import_quietly(path: str) -> Any:
    """The object at a dotted path, or None where it does not import (hydra's ``get_object`` logs each failure)."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # noqa: BLE001  (any import failure: try a shorter module path)
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def _norm(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return float(v)
    return v


#: keys that do not make two runs different: names, the resume path, and settings that change only how fast the same
#: numbers are computed, up to float rounding (chunk sizes of the batched estimates and decodes, overlapped reward
#: calls, compilation, CPU threads; tests/test_train_loop.py checks the chunk sizes and the overlap)
IGNORED_KEYS = ("experiment_name", "ckpt_path", "loop.estimate_chunk", "loop.decode_chunk", "loop.overlap_reward",
                "loop.overlap_chunks", "loop.compile", "torch_threads")


#: what a plan may raise over a stored run for that run to be *extended* from its checkpoint rather than rerun: how
#: long it goes on and where it is evaluated (training does not read them: tests/test_budget.py
#: ``test_a_finished_budget_run_extended_from_its_checkpoint_is_the_run_to_the_larger_budget``)
EXTENDABLE = ("loop.iterations", "loop.budget", "eval.at_fractions")


def stored_config(run_dir: Path) -> dict[str, Any]:
    """The settings a run directory's run last ran with: its ``config.resume.yaml`` (written by each resume: only
    the settings a resume may change differ, ``stepflow.rundir.RESUMABLE``) where there is one, else its
    ``config.yaml``; {} where neither reads as a mapping."""
    import yaml

    for name in ("config.resume.yaml", "config.yaml"):
        f = Path(run_dir) / name
        if f.is_file():
            try:
                cfg = yaml.safe_load(f.read_text())
            except (yaml.YAMLError, UnicodeDecodeError):
                cfg = None
            if isinstance(cfg, dict):
                return cfg
    return {}


def _points(cfg: dict[str, Any]) -> tuple[Any, list[float]]:
    """A config's budget (``stepflow.core.budget.Budget`` or None) and its evaluation points in the budget's units."""
    from stepflow.core.budget import parse_budget

    loop, ev = cfg.get("loop") or {}, cfg.get("eval") or {}
    budget = parse_budget(loop.get("budget"))
    points = [] if budget is None else [float(f) * budget.total for f in ev.get("at_fractions") or ()]
    return budget, points


def run_budget(run_dir: Path) -> float | None:
    """The budget the run in ``run_dir`` last ran to (:func:`stored_config`), or None (none, or not readable)."""
    try:
        b = _points(stored_config(run_dir))[0]
    except (TypeError, ValueError, AttributeError):
        return None
    return None if b is None else b.total


def extension(stored: dict[str, Any], planned: dict[str, Any], diff: Sequence[str]) -> str | None:
    """Why the planned run continues the stored one (its reason), or None: they differ only in :data:`EXTENDABLE`,
    the plan goes on longer (more iterations or a larger budget of the same kind, neither less) and evaluates at
    the same points up to the stored run's budget (the stored run's evaluations are then the planned run's first
    ones)."""
    if not diff or not set(diff) <= set(EXTENDABLE):
        return None
    try:
        it0, it1 = int(stored["loop"]["iterations"]), int(planned["loop"]["iterations"])
        (b0, p0), (b1, p1) = _points(stored), _points(planned)
    except (KeyError, TypeError, ValueError):
        return None
    if it1 < it0 or (b0 is None) != (b1 is None) or (b0 is not None and (b0.kind != b1.kind or b1.total < b0.total)):
        return None
    if b0 is not None:  # (fractions written to 9 digits: the same point within a millionth of the budget)
        tol = 1e-6 * b1.total
        if not all(any(abs(p - q) <= tol for q in p1) for p in p0):
            return None
        if not all(any(abs(q - p) <= tol for p in p0) for q in p1 if q <= b0.total + tol):
            return None  # a point the stored run passed without evaluating: rerun
        if b1.total > b0.total:
            unit = "NFEs" if b0.kind == "nfe" else "s of training"
            return f"extend from {b0.total:,.0f} to {b1.total:,.0f} {unit}"
    return f"extend from {it0} to {it1} iterations" if it1 > it0 else None


def job_status(run_dir: Path, planned: dict[str, Any] | None = None) -> tuple[str, str]:
    """``(status, reason)`` of the run directory of a planned job (see the module docstring)."""
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        return "missing", "no run yet" if not run_dir.exists() else "no config.yaml"
    has_ckpt = (run_dir / "checkpoints" / "last.ckpt").is_file()
    if planned is not None:
        stored = stored_config(run_dir)
        diff = config_mismatch(stored, planned)
        why = extension(stored, planned, diff)
        if why is not None and has_ckpt:
            return "resume", why
        if diff:
            return "stale", f"config differs from the plan in {', '.join(diff[:4])}"
    iterations = None if planned is None else int(planned["loop"]["iterations"])
    if report.run_finished(run_dir, iterations):
        return "finished", ""
    if has_ckpt:
        return "resume", "unfinished, has checkpoints/last.ckpt"
    return "missing", "unfinished, no checkpoint"


def run_signature(planned: dict[str, Any]) -> str:
    """What makes two runs identical: the resolved config without :data:`IGNORED_KEYS`."""
    flat = {k: _norm(v) for k, v in report.flatten(planned).items() if k not in IGNORED_KEYS}
    return json.dumps(flat, sort_keys=True, default=str)


def plan(suite: Suite, sweep_dir: Path, extra: Sequence[str] = (), check_config: bool = True) -> list[Job]:
    """Every (ablation, arm, seed) of the suite with its status on disk.

    With ``check_config`` every arm is composed; a run whose resolved config (experiment name aside) and seed equal an
    earlier ablation's run -- the baseline arm that several ablations share -- is *shared*: it is not run again but
    linked to that run (unless a finished run of its own exists)."""
    jobs = []
    first: dict[tuple[str, int], Job] = {}
    from stepflow.config import composer

    with composer() if check_config else contextlib.nullcontext() as compose:
        for abl in suite.ablations:
            for arm in abl.arms():
                planned = sig = None
                if check_config:  # one composition per arm: the seed keys are not compared
                    ovr = [*suite.common, *extra, *(f"{k}={v}" for k, v in arm.items())]
                    planned = planned_config(abl.experiment, ovr, compose)
                    sig = run_signature(planned)
                for seed in suite.seeds:
                    run_dir = sweep_dir / abl.name / run_name(arm, seed)
                    twin = first.get((sig, seed)) if sig is not None else None
                    if twin is not None and (run_dir.is_symlink() or not run_dir.exists()):
                        jobs.append(Job(abl, arm, seed, run_dir, "shared", f"same run as {twin.ablation.name}/"
                                        f"{twin.run_dir.name}", same_as=twin))
                        continue
                    status, reason = job_status(run_dir, planned)
                    if twin is not None and status != "finished":  # a leftover of its own: replaced by the link
                        jobs.append(Job(abl, arm, seed, run_dir, "shared", f"same run as {twin.ablation.name}/"
                                        f"{twin.run_dir.name} (own unfinished copy moved aside)", same_as=twin))
                        continue
                    job = Job(abl, arm, seed, run_dir, status, reason)
                    jobs.append(job)
                    if sig is not None:
                        first.setdefault((sig, seed), job)
    return jobs


def exclude_keys(suite: Suite, extra: Sequence[str] = ()) -> list[str]:
    """Override keys left out of run directory names: the experiment, ckpt_path and the suite's common overrides."""
    keys = ["experiment", "ckpt_path"] + [override_key(o) for o in [*suite.common, *extra]]
    return list(dict.fromkeys(keys))


def launcher_args(launcher: str | None, jobs: int = 1) -> list[str]:
    if launcher:
        return [f"hydra/launcher={launcher}"]
    if jobs > 1:
        return ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"]
    return []


def multirun_command(suite: Suite, abl: Ablation, sweep_dir: Path, overrides: Sequence[str], seeds: Sequence[int],
                     extra: Sequence[str] = (), launcher: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """``python -m stepflow.train --multirun experiment=<abl> <common> <overrides> seed=<seeds> hydra...``."""
    excl = exclude_keys(suite, extra)
    return [python, "-m", "stepflow.train", "--multirun", f"experiment={abl.experiment}", *suite.common, *extra,
            *overrides, f"seed={','.join(str(s) for s in seeds)}",
            f"hydra.sweep.dir={hydra_value(str(sweep_dir / abl.name))}",
            "hydra.sweep.subdir=${hydra.job.override_dirname}",
            f"hydra.job.config.override_dirname.exclude_keys=[{','.join(excl)}]", *launcher]


def plan_commands(suite: Suite, jobs: Sequence[Job], sweep_dir: Path, extra: Sequence[str] = (),
                  launcher: Sequence[str] = (), python: str = sys.executable) -> list[list[str]]:
    """Command lines that run exactly the unfinished jobs (see the module docstring)."""
    cmds: list[list[str]] = []
    for abl in suite.ablations:
        mine = [j for j in jobs if j.ablation.name == abl.name]
        fresh: dict[str, list[int]] = {}
        arm_of: dict[str, dict[str, str]] = {}
        for j in mine:
            if j.status in ("missing", "stale"):
                key = arm_label(j.arm)
                fresh.setdefault(key, []).append(j.seed)
                arm_of[key] = j.arm
        # product arms that miss the same seeds and form a sub-grid of the axes: one multirun over that grid
        by_seeds: dict[tuple[int, ...], list[dict[str, str]]] = {}
        for arm in abl.product_arms():
            seeds = tuple(fresh.get(arm_label(arm), ()))
            if seeds:
                by_seeds.setdefault(seeds, []).append(arm)
        for seeds, arms in by_seeds.items():
            values = {k: [v for v in abl.axes[k] if any(a[k] == v for a in arms)] for k in abl.axes}
            grid = [dict(zip(values, vs)) for vs in itertools.product(*values.values())]
            if len(arms) < 2 or len(grid) != len(arms):
                continue  # not a grid: one multirun per arm below
            axes = [f"{k}={','.join(v)}" for k, v in values.items()]
            cmds.append(multirun_command(suite, abl, sweep_dir, axes, list(seeds), extra, launcher, python))
            for arm in arms:
                fresh.pop(arm_label(arm), None)
        for key, seeds in fresh.items():
            ovr = [f"{k}={v}" for k, v in arm_of[key].items()]
            cmds.append(multirun_command(suite, abl, sweep_dir, ovr, seeds, extra, launcher, python))
        for j in mine:
            if j.status == "resume":
                ovr = [f"{k}={v}" for k, v in j.arm.items()]
                ovr.append(f"ckpt_path={hydra_value(str(j.run_dir / 'checkpoints' / 'last.ckpt'))}")
                cmds.append(multirun_command(suite, abl, sweep_dir, ovr, [j.seed], extra, launcher, python))
    return cmds


# ---------------------------------------------------------------------------------------------------- running
def link_shared(job: Job) -> Path:
    """Make ``job.run_dir`` a relative symlink to the run it shares (an unfinished own copy is moved aside)."""
    assert job.same_as is not None
    d = job.run_dir
    if d.is_symlink():
        d.unlink()
    elif d.exists():
        move_stale(job)
    d.parent.mkdir(parents=True, exist_ok=True)
    d.symlink_to(os.path.relpath(job.same_as.run_dir, d.parent), target_is_directory=True)
    return d


def move_stale(job: Job) -> Path:
    """Move a stale run directory to ``<ablation>/.stale/<name>-<time>`` (ignored by the report)."""
    dest = job.run_dir.parent / ".stale" / f"{job.run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(job.run_dir), str(dest))
    return dest


def write_metadata(suite: Suite, sweep_dir: Path, extra: Sequence[str]) -> None:
    """``suite.json`` in the sweep dir and ``ablation.json`` per ablation (titles, questions, arm order)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    meta = {"suite": suite.name, "description": suite.description, "seeds": suite.seeds,
            "common_overrides": [*suite.common, *extra], "launcher": suite.launcher,
            "ablations": [{"name": a.name, "experiment": a.experiment} for a in suite.ablations]}
    (sweep_dir / "suite.json").write_text(json.dumps(meta, indent=1) + "\n")
    for a in suite.ablations:
        d = sweep_dir / a.name
        d.mkdir(parents=True, exist_ok=True)
        (d / "ablation.json").write_text(json.dumps({
            "name": a.name, "experiment": a.experiment, "title": a.title, "question": a.question,
            "axes": a.axes, "extra_arms": a.extra_arms, "arm_labels": [arm_label(x) for x in a.arms()],
            "seeds": suite.seeds, "common_overrides": [*suite.common, *extra]}, indent=1) + "\n")


def run_commands(cmds: Sequence[list[str]], env: dict[str, str], concurrent: bool, log=print) -> list[int]:
    """Run the commands (sequentially, or all at once for cluster launchers whose multirun blocks on the queue);
    returns their exit codes."""
    if concurrent:
        procs = []
        for c in cmds:
            log(f"[ablations] $ {shlex.join(c)}")
            procs.append(subprocess.Popen(c, cwd=ROOT, env=env))
        return [p.wait() for p in procs]
    codes = []
    for i, c in enumerate(cmds, 1):
        log(f"[ablations] ({i}/{len(cmds)}) $ {shlex.join(c)}")
        t0 = time.time()
        rc = subprocess.call(c, cwd=ROOT, env=env)
        log(f"[ablations] ({i}/{len(cmds)}) exit {rc} after {time.time() - t0:.0f} s")
        codes.append(rc)
    return codes


def split_overrides(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """``(options, hydra overrides)``: the command line split at its first ``--`` (``sys.argv[1:]`` when None)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def int_list(ap: argparse.ArgumentParser, flag: str, text: str, lo: int = 0) -> tuple[int, ...]:
    """A comma-separated list of distinct integers >= ``lo`` (``--seeds 0,1``); anything else is one line naming
    ``flag`` (argparse's error: exit 2)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if not x.lstrip("+-").isdigit() or int(x) < lo]
    if bad or not items:
        ap.error(f"{flag}: must be comma-separated integers >= {lo} (e.g. 0,1,2), got {text!r}")
    vals = tuple(int(x) for x in items)
    dup = sorted({v for v in vals if vals.count(v) > 1})
    if dup:
        ap.error(f"{flag}: {dup[0]} is given twice (its runs would share one run dir); give each once")
    return vals


def writable_dir(ap: argparse.ArgumentParser, flag: str, path: Path) -> Path:
    """``path`` is a directory or can be made one (no file in its way, its first existing parent writable)."""
    q = Path(path)
    while not q.exists() and q != q.parent:
        q = q.parent
    if not q.is_dir() or not os.access(q, os.W_OK):
        what = "is a file" if q.is_file() else "cannot be written"
        ap.error(f"{flag}: {path} cannot be a directory ({q} {what}); give a directory that can be written")
    return Path(path)


def main(argv: Sequence[str] | None = None) -> int:
    argv, extra = split_overrides(argv)
    suites = build_suites()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Arguments after `--` are Hydra overrides added to every run.")
    ap.add_argument("--suite", default="full", choices=sorted(suites))
    ap.add_argument("--sweep-dir", default=None, help="default: outputs/ablations/<suite>")
    ap.add_argument("--only", default=None, help="comma-separated ablation names (default: all of the suite)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default: the suite's)")
    ap.add_argument("--launcher", default=None, help="hydra/launcher option (default: the suite's; paper: slurm)")
    ap.add_argument("--jobs", type=int, default=1, help="local runs at once (joblib launcher; default 1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/OpenMP threads per local run (OMP_NUM_THREADS; default 1, 0 = leave unset)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and commands, run nothing")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--no-config-check", action="store_true",
                    help="do not compare stored configs with the plan (finished = final eval row / lora only)")
    a = ap.parse_args(argv)

    suite = suites[a.suite]
    if a.only is not None:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {x.name for x in suite.ablations}]
        if unknown:
            ap.error(f"--only: unknown ablation(s) {unknown}; choose from {[x.name for x in suite.ablations]}")
        if not names:
            ap.error(f"--only: names no ablation ({a.only!r}); choose from {[x.name for x in suite.ablations]}")
        suite.ablations = [x for x in suite.ablations if x.name in names]
    if a.seeds is not None:
        suite.seeds = list(int_list(ap, "--seeds", a.seeds))
    if a.launcher is not None:
        suite.launcher = a.launcher or None
    if a.jobs < 1:
        ap.error(f"--jobs: must be an integer >= 1 (local runs at once), got {a.jobs}")
    if a.threads < 0:
        ap.error(f"--threads: must be an integer >= 0 (0 = leave OMP_NUM_THREADS unset), got {a.threads}")
    sweep_dir = Path(a.sweep_dir or suite.sweep_dir).expanduser()
    sweep_dir = (sweep_dir if sweep_dir.is_absolute() else ROOT / sweep_dir).resolve()
    writable_dir(ap, "--sweep-dir", sweep_dir)

    try:
        jobs = plan(suite, sweep_dir, extra, check_config=not a.no_config_check)
    except Exception as e:  # noqa: BLE001 - a bad override or experiment: one line
        print(f"ablations: error: cannot compose a planned run: {' '.join(str(e).split())[:400]}", file=sys.stderr)
        return 2
    n = {s: sum(j.status == s for j in jobs) for s in ("finished", "resume", "stale", "missing", "shared")}
    print(f"[ablations] suite {suite.name}: {len(jobs)} runs in {len(suite.ablations)} ablations "
          f"({len(suite.seeds)} seeds) under {sweep_dir}: {n['finished']} finished (skipped), {n['shared']} shared "
          f"with an identical run of another ablation (linked), {n['resume']} to resume, {n['stale']} stale (rerun), "
          f"{n['missing']} to run")
    for j in jobs:
        if j.status in ("stale", "resume", "shared"):
            print(f"[ablations]   {j.status}: {j.ablation.name}/{j.run_dir.name}: {j.reason}")
    cmds = plan_commands(suite, jobs, sweep_dir, extra, launcher_args(suite.launcher, a.jobs))
    if a.dry_run:
        for c in cmds:
            print(shlex.join(c))
        return 0
    write_metadata(suite, sweep_dir, extra)
    for j in jobs:
        if j.status == "stale":
            print(f"[ablations]   moved stale {j.run_dir.name} to {move_stale(j)}")
        elif j.status == "shared":
            link_shared(j)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.threads > 0 and not suite.launcher:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(a.threads)
    t0 = time.time()
    codes = run_commands(cmds, env, concurrent=bool(suite.launcher))
    failed = sum(rc != 0 for rc in codes)
    print(f"[ablations] {len(cmds)} commands in {time.time() - t0:.0f} s, {failed} failed")
    if not a.no_report:
        md = report.build_report(sweep_dir)
        print(f"[ablations] report: {md}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
