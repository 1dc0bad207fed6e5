#!/usr/bin/env python
"""Ablation report from run directories alone: a markdown table (mean ± 95 % CI over seeds) and reward plots.

    python experiments/report.py <sweep dir> [--out DIR] [--metric eval/geneval] [--target X | --target-frac F]
                                 [--include-unfinished]

A *run* is any directory under ``<sweep dir>`` holding ``config.yaml`` (the resolved config written by
``stepflow.train``) and ``metrics.csv`` (directories whose name starts with ``.`` are skipped: ``.hydra``,
``.submitit``, ``.stale``). Runs are grouped

- into *ablations* by their parent directory (``<sweep>/<ablation>/<run>``, the layout of ``experiments/ablations.py``;
  runs directly under ``<sweep dir>`` form one ablation named after it), and
- into *arms* by their resolved config with the seed removed (so the grouping never depends on directory names). An
  arm is labelled by its run directory name without the ``seed=N`` item (Hydra's ``override_dirname``, e.g.
  ``advantage=gain,sampler=ddim_sde``) or, failing that, by the config keys that differ between the arms.

An optional ``ablation.json`` in an ablation directory (written by ``ablations.py``) adds a title, the question, the
arm order and a target; the report does not need it.

Per arm, over the finished runs (seeds): final held-out reward (last ``eval/<reward>`` row), final strict GenEval
(``eval/geneval``, when logged), iterations to reach a target held-out reward (first evaluation at or above it;
evaluations happen every ``eval.every`` iterations), training wall-clock (sum of ``time/iteration_s``; evaluation
excluded), NFEs (``cost/nfe_total``), reward calls (sum of ``cost/reward_calls``) and rewarded images
(``cost/reward_images_total``), each as mean ± half-width of the 95 % confidence interval of the mean,
``t_{0.975, n-1} · s / sqrt(n)`` with the sample standard deviation ``s`` (n − 1 degrees of freedom); ``n = 1``
gives the value alone. The default target is the base model's held-out reward plus half of the best arm's
improvement (``--target-frac 0.5``), so that every ablation gets a target in its own units.

Writes ``<out>/report.md`` (default ``<sweep dir>/report``), ``<out>/summary.json`` and per ablation
``<ablation>_iteration.png`` (held-out and training reward vs iteration), ``<ablation>_nfe.png`` (vs cumulative
NFEs) and ``<ablation>_wallclock.png`` (vs cumulative training seconds, the paper's Fig. 5); where runs log per-step
weights (``train/weight_step{k}``: ``train.weighting=auto|noise|gain_var``),
``<ablation>_step_weights.png`` (each step's share of the weights vs iteration, stacked, mean over seeds).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

#: config keys that differ between the seeds of one arm (dropped before grouping runs into arms)
SEED_KEYS = ("seed", "loop.seed", "ckpt_path")
TRAIN_REWARD = "train/reward_final"
REPORT_DIR = "report"


# ---------------------------------------------------------------------------------------------------- statistics
def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, int]:
    """``(mean, half-width, n)`` of the two-sided ``confidence`` interval of the mean (t-distribution, n − 1 dof).

    The half-width is ``t.ppf((1 + confidence) / 2, n − 1) · s / sqrt(n)`` with the sample standard deviation ``s``
    (ddof = 1); NaN for ``n < 2``. NaN values are dropped; an empty input gives ``(nan, nan, 0)``.
    """
    from scipy.stats import t as student_t

    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0
    m = sum(xs) / n
    if n < 2:
        return m, math.nan, 1
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, float(student_t.ppf(0.5 + confidence / 2.0, n - 1)) * s / math.sqrt(n), n


def fmt_ci(m: float, h: float, n: int, digits: int = 3) -> str:
    """``0.512 ± 0.034``; the value alone when the CI is undefined (n = 1) or zero (identical values, e.g. the NFEs
    of a deterministic schedule); ``—`` when there is no value."""
    if n == 0 or math.isnan(m):
        return "—"
    if abs(m) >= 1e5:
        return f"{m:.3g}" if math.isnan(h) or h == 0 else f"{m:.3g} ± {h:.2g}"
    if math.isnan(h) or h == 0:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {h:.{digits}f}"


# ---------------------------------------------------------------------------------------------------- runs
def read_metrics(path: Path) -> list[dict[str, float]]:
    """Rows of a stepflow ``metrics.csv``: ``{"iteration": int, <metric>: float, ...}`` (empty cells dropped)."""
    rows: list[dict[str, float]] = []
    with Path(path).open(newline="") as fh:
        for raw in csv.DictReader(fh):
            row: dict[str, float] = {}
            for k, v in raw.items():
                if k is None or v is None or v == "":
                    continue
                try:
                    row[k] = float(v)
                except ValueError:
                    continue
            if "iteration" in row:
                row["iteration"] = int(row["iteration"])
                rows.append(row)
    return rows


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"a.b.c": value}`` (lists are kept as values)."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(flatten(v, key))
            else:
                out[key] = v
    return out


def final_eval_iteration(rows: Sequence[dict[str, float]]) -> int | None:
    """Iteration of the last row holding an ``eval/`` metric (None if there is none)."""
    its = [r["iteration"] for r in rows if any(k.startswith("eval/") for k in r)]
    return max(its) if its else None


def run_finished(run_dir: str | Path, iterations: int | None = None) -> bool:
    """True when the run in ``run_dir`` completed: ``metrics.csv`` has the final evaluation row (an ``eval/`` row at
    iteration ``loop.iterations``, read from ``config.yaml`` unless ``iterations`` is given) or the run saved its
    adapter (``lora/pytorch_lora_weights.safetensors``, written after the final evaluation) and neither a checkpoint
    nor a resume's ``config.resume.yaml`` is newer than that adapter (the directory is being run again or extended)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        return False
    lora, ckpt = run_dir / "lora" / "pytorch_lora_weights.safetensors", run_dir / "checkpoints" / "last.ckpt"
    resumed = run_dir / "config.resume.yaml"
    # the adapter marks a finished run unless a checkpoint was written after it (the directory is being rerun) or a
    # resume started after it (the run is being extended: every resume that finishes writes the adapter again)
    if lora.is_file() and not (ckpt.is_file() and ckpt.stat().st_mtime > lora.stat().st_mtime + 1.0) and \
            not (resumed.is_file() and resumed.stat().st_mtime > lora.stat().st_mtime):
        return True
    if iterations is None:
        cfg_file = run_dir / "config.yaml"
        if not cfg_file.is_file():
            return False
        try:
            cfg = yaml.safe_load(cfg_file.read_text()) or {}
            iterations = int(cfg["loop"]["iterations"])
        except (KeyError, TypeError, ValueError, yaml.YAMLError):
            return False
    try:
        last = final_eval_iteration(read_metrics(metrics))
    except (OSError, csv.Error, ValueError):  # not text (UnicodeDecodeError): not a finished run
        return False
    return last is not None and last >= iterations


@dataclass
class Run:
    """One run directory: its resolved config and metric rows."""

    path: Path
    config: dict[str, Any]
    rows: list[dict[str, float]]
    ablation: str = ""

    @classmethod
    def load(cls, path: Path) -> "Run":
        cfg = yaml.safe_load((path / "config.yaml").read_text()) or {}
        return cls(path=path, config=cfg, rows=read_metrics(path / "metrics.csv"))

    @property
    def flat(self) -> dict[str, Any]:
        return flatten(self.config)

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    @property
    def iterations(self) -> int | None:
        try:
            return int(self.config["loop"]["iterations"])
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def finished(self) -> bool:
        return run_finished(self.path, self.iterations)

    def arm_key(self) -> str:
        flat = {k: v for k, v in self.flat.items() if k not in SEED_KEYS}
        return json.dumps(flat, sort_keys=True, default=str)

    def dir_label(self) -> str | None:
        """The run directory's name without its ``seed=N`` item (None if it has none)."""
        items = self.path.name.split(",")
        rest = [s for s in items if not re.fullmatch(r"\+*seed=\S+", s)]
        if len(rest) == len(items):
            return None
        return ",".join(rest) or "(default)"

    def series(self, metric: str) -> list[tuple[int, float]]:
        """``[(iteration, value)]`` of the rows holding ``metric`` (last value per iteration)."""
        out: dict[int, float] = {}
        for r in self.rows:
            if metric in r:
                out[r["iteration"]] = r[metric]
        return sorted(out.items())

    def last(self, metric: str) -> float:
        s = self.series(metric)
        return s[-1][1] if s else math.nan

    def total(self, metric: str) -> float:
        s = self.series(metric)
        return float(sum(v for _, v in s)) if s else math.nan

    def cumulative(self, metric: str) -> dict[int, float]:
        """``{iteration: running sum of metric over rows up to that iteration}`` (iteration 0 -> 0)."""
        acc, out = 0.0, {0: 0.0}
        for it, v in self.series(metric):
            acc += v
            out[it] = acc
        return out

    def at_iteration(self, metric: str) -> dict[int, float]:
        """``{iteration: value}`` of a cumulative counter such as ``cost/nfe_total`` (iteration 0 -> 0)."""
        out = {0: 0.0}
        out.update(dict(self.series(metric)))
        return out


def run_dirs(root: str | Path) -> list[Path]:
    """Directories under ``root`` (and ``root`` itself) holding ``config.yaml`` + ``metrics.csv``, sorted. Symlinked
    run directories are followed (``ablations.py`` links a run shared by several ablations); hidden directories and
    ``<root>/report`` are skipped."""
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        d = Path(dirpath)
        rel = d.relative_to(root).parts
        real = d.resolve()

        def keep(n: str, d=d, rel=rel, real=real) -> bool:
            if n.startswith(".") or (not rel and n == REPORT_DIR):
                return False
            target = (d / n).resolve()
            return target != real and target not in real.parents  # no symlink cycles

        dirnames[:] = sorted(n for n in dirnames if keep(n))
        if "config.yaml" in filenames and "metrics.csv" in filenames:
            found.append(d)
    return sorted(found)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def find_runs(root: str | Path) -> list[Run]:
    """Every run directory under ``root`` (see :func:`run_dirs`) loaded as a :class:`Run`."""
    root = Path(root)
    runs = []
    for d in run_dirs(root):
        try:
            cfg = yaml.safe_load((d / "config.yaml").read_text()) or {}
            if not isinstance(cfg, dict):
                raise ValueError("not a mapping")
        except (OSError, ValueError, yaml.YAMLError) as e:  # UnicodeDecodeError is a ValueError
            print(f"report: skipping {d}: config.yaml cannot be read ({_first_line(e)}); rerun the run or remove it",
                  file=sys.stderr)
            continue
        try:
            run = Run(path=d, config=cfg, rows=read_metrics(d / "metrics.csv"))
        except (OSError, ValueError, csv.Error) as e:
            print(f"report: skipping {d}: metrics.csv cannot be read ({_first_line(e)}); rerun the run or remove it",
                  file=sys.stderr)
            continue
        run.ablation = root.name if d.parent == root or d == root else str(d.parent.relative_to(root))
        runs.append(run)
    return runs


# ---------------------------------------------------------------------------------------------------- grouping
@dataclass
class Arm:
    label: str
    runs: list[Run] = field(default_factory=list)  # finished runs (or all with --include-unfinished)
    unfinished: int = 0


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def group_arms(runs: Sequence[Run], include_unfinished: bool = False, order: Sequence[str] = ()) -> list[Arm]:
    """Group the runs of one ablation into arms (same config up to the seed); ordered by ``order`` (labels), then by
    label."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.arm_key(), []).append(r)
    labels: dict[str, str] = {}
    dir_labels = {k: {r.dir_label() for r in rs} for k, rs in groups.items()}
    if all(len(v) == 1 and None not in v for v in dir_labels.values()) and \
            len({next(iter(v)) for v in dir_labels.values()}) == len(groups):
        labels = {k: next(iter(v)) for k, v in dir_labels.items()}
    else:  # label by the config keys that differ between arms
        flats = {k: {kk: vv for kk, vv in rs[0].flat.items() if kk not in SEED_KEYS} for k, rs in groups.items()}
        keys = sorted({kk for f in flats.values() for kk in f})
        varying = [kk for kk in keys if len({json.dumps(f.get(kk), default=str) for f in flats.values()}) > 1]
        prefer = [kk for kk in varying if kk.endswith((".scheme", ".name"))] or varying
        shown = prefer + [kk for kk in varying if kk not in prefer and not kk.startswith("advantage.")][:4]
        for k, f in flats.items():
            labels[k] = ",".join(f"{kk}={_short(f.get(kk))}" for kk in shown) or "(all runs)"
        if len(set(labels.values())) < len(labels):  # still ambiguous: number them
            for i, k in enumerate(sorted(labels)):
                labels[k] = f"{labels[k]} #{i}"
    arms = []
    for k, rs in groups.items():
        rs = sorted(rs, key=lambda r: str(r.seed))
        done = [r for r in rs if r.finished]
        use = rs if include_unfinished else done
        arms.append(Arm(label=labels[k], runs=use, unfinished=len(rs) - len(done)))
    rank = {lab: i for i, lab in enumerate(order)}
    arms.sort(key=lambda a: (rank.get(a.label, len(rank)), a.label))
    return arms


def heldout_metric(runs: Iterable[Run]) -> str | None:
    """The held-out reward column, ``eval/<reward name>``: an ``eval/`` metric other than ``eval/geneval*``."""
    cols = sorted({k for r in runs for row in r.rows for k in row if k.startswith("eval/")})
    own = [c for c in cols if not c.startswith("eval/geneval")]
    if own:
        return own[0]
    return "eval/geneval" if "eval/geneval" in cols else None


def iterations_to_target(run: Run, metric: str, target: float) -> float:
    """First evaluated iteration whose ``metric`` is >= ``target`` (NaN if never)."""
    for it, v in run.series(metric):
        if v >= target:
            return float(it)
    return math.nan


# ---------------------------------------------------------------------------------------------------- plots
def _curve(runs: Sequence[Run], metric: str, x_of=None, smooth: int = 1):
    """Mean and CI band of ``metric`` over runs, aligned by iteration. ``x_of(run) -> {iteration: x}`` maps iterations
    to another axis (averaged over runs). Returns (x, mean, lo, hi) lists."""
    per_it: dict[int, list[float]] = {}
    xs: dict[int, list[float]] = {}
    for r in runs:
        s = r.series(metric)
        if smooth > 1 and len(s) > 1:
            vals = [v for _, v in s]
            sm = [sum(vals[max(0, i - smooth + 1):i + 1]) / len(vals[max(0, i - smooth + 1):i + 1]) for i in range(len(vals))]
            s = [(it, v) for (it, _), v in zip(s, sm)]
        xmap = x_of(r) if x_of else None
        for it, v in s:
            if xmap is not None and it not in xmap:
                continue
            per_it.setdefault(it, []).append(v)
            xs.setdefault(it, []).append(float(xmap[it]) if xmap is not None else float(it))
    out = ([], [], [], [])
    for it in sorted(per_it):
        m, h, n = mean_ci(per_it[it])
        h = 0.0 if math.isnan(h) else h
        out[0].append(sum(xs[it]) / len(xs[it]))
        out[1].append(m)
        out[2].append(m - h)
        out[3].append(m + h)
    return out


def plot_ablation(name: str, arms: Sequence[Arm], metric: str | None, out_dir: Path, title: str = "") -> list[Path]:
    """Three PNGs: reward vs iteration, vs cumulative NFEs, vs cumulative training seconds (held-out reward on the
    left, training reward of the final image on the right; mean over seeds with the 95 % CI band)."""
    axes_defs = [
        ("iteration", "iteration", None),
        ("nfe", "NFEs (cumulative function evaluations)", lambda r: r.at_iteration("cost/nfe_total")),
        ("wallclock", "training wall-clock (s, evaluation excluded)", lambda r: r.cumulative("time/iteration_s")),
    ]
    paths = []
    n_train = max((len(r.series(TRAIN_REWARD)) for a in arms for r in a.runs), default=1)
    smooth = max(1, n_train // 10)
    for suffix, xlabel, x_of in axes_defs:
        fig, axs = plt.subplots(1, 2, figsize=(11, 3.8))
        for i, arm in enumerate(arms):
            if not arm.runs:
                continue
            color = f"C{i % 10}"
            label = f"{arm.label} (n={len(arm.runs)})"
            for ax, m, sm, marker in ((axs[0], metric, 1, "o"), (axs[1], TRAIN_REWARD, smooth, None)):
                if m is None:
                    continue
                x, mu, lo, hi = _curve(arm.runs, m, x_of, smooth=sm)
                if not x:
                    continue
                ax.plot(x, mu, color=color, marker=marker, ms=3, lw=1.4, label=label)
                ax.fill_between(x, lo, hi, color=color, alpha=0.18, lw=0)
        axs[0].set(title=f"held-out reward ({metric or 'n/a'})", xlabel=xlabel)
        axs[1].set(title=f"training reward, final image{f' (moving avg {smooth})' if smooth > 1 else ''}",
                   xlabel=xlabel)
        for ax in axs:
            ax.grid(alpha=0.3)
        handles, labels = axs[0].get_legend_handles_labels()
        if not handles:
            handles, labels = axs[1].get_legend_handles_labels()
        if handles:
            axs[0].legend(handles, labels, fontsize=7, loc="best")
        fig.suptitle(f"{name}{' — ' + title if title else ''}: mean ± 95 % CI over seeds", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{_safe(name)}_{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "ablation"


# ---------------------------------------------------------------------------------------------------- report
COLUMNS = ("final held-out reward", "final GenEval (strict)", "iterations to target", "train wall-clock (s)",
           "NFEs", "reward calls", "rewarded images")


def summarize_arm(arm: Arm, metric: str | None, target: float | None) -> dict[str, Any]:
    """Per-arm statistics: ``{column: (mean, half-width, n)}`` plus ``reached`` for the target."""
    rs = arm.runs
    res: dict[str, Any] = {}
    res["final held-out reward"] = mean_ci([r.last(metric) for r in rs]) if metric else (math.nan, math.nan, 0)
    res["final GenEval (strict)"] = mean_ci([r.last("eval/geneval") for r in rs])
    if metric and target is not None:
        its = [iterations_to_target(r, metric, target) for r in rs]
        res["iterations to target"] = mean_ci(its)
        res["reached"] = sum(not math.isnan(v) for v in its)
    else:
        res["iterations to target"] = (math.nan, math.nan, 0)
        res["reached"] = 0
    res["train wall-clock (s)"] = mean_ci([r.total("time/iteration_s") for r in rs])
    res["NFEs"] = mean_ci([r.last("cost/nfe_total") for r in rs])
    res["reward calls"] = mean_ci([r.total("cost/reward_calls") for r in rs])
    res["rewarded images"] = mean_ci([r.last("cost/reward_images_total") for r in rs])
    return res


def choose_target(arms: Sequence[Arm], metric: str | None, target: float | None, frac: float) -> tuple[float | None, str]:
    """The target held-out reward and a sentence saying how it was chosen."""
    if metric is None:
        return None, "no held-out reward logged"
    if target is not None:
        return float(target), f"{metric} ≥ {target:g} (given)"
    runs = [r for a in arms for r in a.runs]
    base = mean_ci([r.series(metric)[0][1] for r in runs if r.series(metric) and r.series(metric)[0][0] == 0])[0]
    finals = [mean_ci([r.last(metric) for r in a.runs])[0] for a in arms if a.runs]
    finals = [f for f in finals if not math.isnan(f)]
    if math.isnan(base) or not finals or max(finals) <= base:
        return None, "no target: no arm improved on the base model's held-out reward"
    t = base + frac * (max(finals) - base)
    return t, (f"{metric} ≥ {t:.4g}: the base model's {base:.4g} plus {frac:.0%} of the best arm's improvement "
               f"(to {max(finals):.4g})")


def _shown(p: Path) -> str:
    """``p`` relative to the working directory when it lies below it (reports committed to a repository)."""
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def step_weight_curves(runs: Sequence[Run]) -> tuple[list[int], list[float], list[list[float]]]:
    """The logged steps ``k`` of ``train/weight_step{k}``, the iterations, and per step its weight at each iteration
    averaged over the runs that logged it there (0 where none did)."""
    steps = sorted({int(k.rsplit("step", 1)[1]) for r in runs for row in r.rows for k in row
                    if k.startswith("train/weight_step")})
    curves = [_curve(runs, f"train/weight_step{k}") for k in steps]
    its = sorted(set().union(*(c[0] for c in curves))) if curves else []
    return steps, its, [[dict(zip(c[0], c[1])).get(it, 0.0) for it in its] for c in curves]


def plot_step_weights(name: str, arms: Sequence[Arm], out_dir: Path) -> Path | None:
    """For the arms whose runs log per-step weights (``train/weight_step{k}``: ``train.weighting=auto``,
    ``train.weighting=noise|gain_var``): one panel per arm, each step's share of the weights (mean over seeds, then
    normalised to sum 1 per iteration) vs iteration, stacked, so the steps the weighting chose and when are visible.
    None when no arm logs them."""
    logged = [(arm, *step_weight_curves(arm.runs)) for arm in arms]
    logged = [x for x in logged if x[1]]
    if not logged:
        return None
    fig, axs = plt.subplots(1, len(logged), figsize=(5.5 * len(logged), 3.6), squeeze=False)
    for ax, (arm, steps, its, ys) in zip(axs[0], logged):
        tot = [sum(col) or 1.0 for col in zip(*ys)]  # shares: auto's weights sum to 1, noise / gain_var's mean 1
        ys = [[v / t for v, t in zip(row, tot)] for row in ys]
        ax.stackplot(its, ys, labels=[f"step {k}" for k in steps], colors=[f"C{k % 10}" for k in steps], alpha=0.85)
        ax.set(title=f"{arm.label} (n={len(arm.runs)})", xlabel="iteration", ylabel="share of the step weights",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axs[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"{name}: per-step loss weights over training", fontsize=10)
    fig.tight_layout()
    path = out_dir / f"{_safe(name)}_step_weights.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_report(root: str | Path, out_dir: str | Path | None = None, metric: str | None = None,
                 target: float | None = None, target_frac: float = 0.5, include_unfinished: bool = False) -> Path:
    """Write ``report.md``, ``summary.json`` and the plots for every ablation under ``root``; returns report.md."""
    root = Path(root).resolve()
    out = Path(out_dir) if out_dir else root / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    runs = find_runs(root)
    by_abl: dict[str, list[Run]] = {}
    for r in runs:
        by_abl.setdefault(r.ablation, []).append(r)
    suite = _read_json(root / "suite.json")
    lines = [f"# Ablation report: {root.name}", "",
             f"Sweep directory `{_shown(root)}`; generated {time.strftime('%Y-%m-%d %H:%M:%S')} by `experiments/report.py` from "
             f"the run directories ({len(runs)} runs, {len(by_abl)} ablations).", ""]
    if suite.get("description"):
        lines += [suite["description"], ""]
    lines += ["Every cell is the mean ± the half-width of the 95 % confidence interval of the mean over seeds "
              "(t-distribution with n − 1 degrees of freedom; a single seed shows the value alone). *Final held-out "
              "reward*: the last evaluation (held-out prompts, ODE sampling, EMA weights). *Iterations to target*: "
              "first evaluation at or above the target, over the runs that reached it. *Train wall-clock*: the sum of "
              "the iterations' times (evaluation excluded). *NFEs*: transformer function evaluations (rollout, x̂0 "
              "estimates, update). *Reward calls* / *rewarded images*: batched reward-model calls / images scored.", ""]
    summary: dict[str, Any] = {"sweep_dir": str(root), "ablations": {}}
    if not runs:
        lines += ["No runs found (directories with config.yaml + metrics.csv).", ""]
    for name in sorted(by_abl, key=lambda n: (_order(suite, n), n)):
        rs = by_abl[name]
        meta = _read_json((root / name) / "ablation.json") if (root / name).is_dir() else {}
        arms = group_arms(rs, include_unfinished, order=meta.get("arm_labels", ()))
        m = metric or meta.get("metric") or heldout_metric(rs)
        tgt, tgt_text = choose_target(arms, m, target if target is not None else meta.get("target"),
                                      float(meta.get("target_frac", target_frac)))
        title = meta.get("title", "")
        lines += [f"## {name}{' — ' + title if title else ''}", ""]
        if meta.get("question"):
            lines += [meta["question"], ""]
        exps = sorted({str(r.config.get("experiment_name")) for r in rs if r.config.get("experiment_name")})
        if exps:
            lines += [f"Experiment: {', '.join('`' + e + '`' for e in exps)}. Target: {tgt_text}.", ""]
        else:
            lines += [f"Target: {tgt_text}.", ""]
        lines += ["| arm | seeds | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
        summary["ablations"][name] = {"metric": m, "target": tgt, "arms": {}}
        for arm in arms:
            st = summarize_arm(arm, m, tgt)
            seeds = f"{len(arm.runs)}" + (f" (+{arm.unfinished} unfinished)" if arm.unfinished and not include_unfinished
                                         else "")
            cells = []
            for c in COLUMNS:
                mm, hh, nn = st[c]
                if c == "iterations to target":
                    cell = fmt_ci(mm, hh, nn, 1)
                    if arm.runs and tgt is not None and st["reached"] < len(arm.runs):
                        cell += f" ({st['reached']}/{len(arm.runs)} reached)"
                elif c in ("NFEs", "reward calls", "rewarded images", "train wall-clock (s)"):
                    cell = fmt_ci(mm, hh, nn, 0 if c != "train wall-clock (s)" else 1)
                else:
                    cell = fmt_ci(mm, hh, nn, 3)
                cells.append(cell)
            lines.append(f"| `{arm.label}` | {seeds} | " + " | ".join(cells) + " |")
            summary["ablations"][name]["arms"][arm.label] = {
                "runs": [str(r.path.relative_to(root)) if r.path.is_relative_to(root) else str(r.path) for r in arm.runs],
                "unfinished": arm.unfinished, "reached_target": st["reached"],
                **{c: {"mean": _num(st[c][0]), "ci95": _num(st[c][1]), "n": st[c][2]} for c in COLUMNS}}
        lines.append("")
        pngs = plot_ablation(name, arms, m, out, title)
        lines += [f"![{name}: reward vs {p.stem.rsplit('_', 1)[-1]}]({p.name})" for p in pngs] + [""]
        sw = plot_step_weights(name, arms, out)
        if sw is not None:
            lines += [f"![{name}: per-step weights]({sw.name})", ""]
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = out / "report.md"
    md.write_text("\n".join(lines))
    return md


def _num(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _order(suite: dict, name: str) -> int:
    names = [a.get("name") for a in suite.get("ablations", [])]
    return names.index(name) if name in names else len(names)


def main(argv: Sequence[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", help="directory holding the run directories (e.g. outputs/ablations/full)")
    ap.add_argument("--out", default=None, help="output directory (default: <sweep_dir>/report)")
    ap.add_argument("--metric", default=None, help="held-out metric (default: eval/<reward name>)")
    ap.add_argument("--target", type=float, default=None, help="absolute target of the held-out metric")
    ap.add_argument("--target-frac", type=float, default=0.5,
                    help="target = base + FRAC x (best arm's final - base) (default 0.5)")
    ap.add_argument("--include-unfinished", action="store_true", help="also use runs that have not finished")
    a = ap.parse_args(argv)
    root = Path(a.sweep_dir)
    if not root.is_dir():
        print(f"report: error: not a directory: {root}", file=sys.stderr)
        raise SystemExit(2)
    md = build_report(root, a.out, a.metric, a.target, a.target_frac, a.include_unfinished)
    print(f"report: wrote {md}")
    return md


if __name__ == "__main__":
    main()
