#!/usr/bin/env python
"""(Re-)record tests/golden/league_it1.json: the first iteration's numbers of every ``experiment=league/<name>`` recipe.

    python experiments/record_league_golden.py                      # every recipe of stepflow/conf/experiment/league/
    python experiments/record_league_golden.py --only nft awm       # only these (the others' entries are kept)
    python experiments/record_league_golden.py --check              # run and compare with the file, write nothing
    python experiments/record_league_golden.py --size small         # the small-batch set (league_it1_small.json)

tests/test_golden_league.py (``slow``) runs each recipe for one iteration (``python -m stepflow.train
experiment=league/<name> loop.iterations=1 eval.every=0 <overrides>``) and asserts that every metric recorded here is
still logged and equal within 1e-6·max(1, |x|): a refactor must not change any training number. Run this script
ONLY for a change that alters training on purpose (or to add a new league recipe: the fast test of
tests/test_golden_league.py fails until every recipe file has an entry), and say why in the commit.

Recorded per recipe, from the iteration-1 row(s) of the run's metrics.csv: every metric whose name starts with one
of :data:`PREFIXES`, and ``cost/nfe``; plus the overrides used (:data:`OVERRIDES`: none so far; only ones that do
not change what the first iteration computes), the wall seconds of the process and of the iteration (information
only; the test derives its timeout from them). :data:`EXCLUDE` lists metrics left out because they are not
reproducible run to run (none so far: two runs of league/flow_grpo agreed exactly).

The code measured is the ``stepflow`` that ``import stepflow`` finds: to record from another checkout (e.g. the code
before a refactor, ``git worktree add /tmp/base <commit>``), run with ``PYTHONPATH=/tmp/base``; the runs then use that
checkout's recipes and run in it, and the file written is still this checkout's (``--out`` to change it).
Runs are single-threaded (trainer=cpu: torch_threads 1); ``--jobs`` runs that many at once (default 2).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
GOLDEN = HERE / "tests" / "golden" / "league_it1.json"
#: the small-batch set CI compares (``make test-slow``): the same first iteration of the same recipe on 2 prompts x 8
#: samples (the recipes' 4 x 16, or their own sizes, otherwise) and a 2-prompt final evaluation without a grid, about
#: 3x cheaper; the full-size set (``make test-golden``) runs each recipe's own batch
GOLDEN_SMALL = HERE / "tests" / "golden" / "league_it1_small.json"
SMALL_ARGS = ["loop.prompts_per_iter=2", "loop.group_size=8", "eval.max_prompts=2", "eval.grid_prompts=0"]

#: the one iteration every recipe runs (then `OVERRIDES[name]`, then hydra.run.dir)
BASE_ARGS = ["loop.iterations=1", "eval.every=0", "eval.at_start=false", "eval.max_prompts=12"]
#: per-recipe extra overrides (each must leave the rows of the first iteration unchanged); none are needed so far:
#: every recipe's one iteration (with the start and end evaluations) ends within about 3 minutes on 2 CPU cores
OVERRIDES: dict[str, list[str]] = {}
#: per-recipe overrides of the small set only: the same computation at about 16 samples where the recipe's own
#: sizes are tied (a BranchGRPO tree's leaves are its group: 1 prompt x 16 leaves)
SMALL_OVERRIDES: dict[str, list[str]] = {"branchgrpo": ["loop.prompts_per_iter=1", "loop.group_size=16"]}
#: metrics compared: names starting with one of these, and exactly `cost/nfe`
PREFIXES = ("train/reward", "train/adv", "train/gain", "train/grad_norm", "train/loss", "train/policy_loss",
            "train/kl", "train/ratio", "train/clip_frac")
EXACT = ("cost/nfe",)
#: per-recipe metrics left out because they are not reproducible run to run (name -> {metric: why})
EXCLUDE: dict[str, dict[str, str]] = {}


def recipes(root: Path) -> list[str]:
    """The league recipes of the checkout at ``root`` (stepflow/conf/experiment/league/*.yaml), sorted."""
    return sorted(p.stem for p in (root / "stepflow" / "conf" / "experiment" / "league").glob("*.yaml"))


def iteration_row(metrics_csv: Path, iteration: int = 1) -> dict[str, float]:
    """Every non-empty value of the rows of ``iteration`` in a run's metrics.csv, merged (train and eval rows)."""
    out: dict[str, float] = {}
    with metrics_csv.open() as fh:
        for row in csv.DictReader(fh):
            if row.get("iteration") in ("", None) or int(float(row["iteration"])) != iteration:
                continue
            for k, v in row.items():
                if k == "iteration" or v in ("", None):
                    continue
                if k in out and out[k] != float(v):
                    raise ValueError(f"{metrics_csv}: {k} logged twice for iteration {iteration}: {out[k]} != {v}")
                out[k] = float(v)
    return out


def compared(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith(PREFIXES) or k in EXACT}


def run_recipe(name: str, overrides: list[str], timeout: int = 3600, base: list[str] = BASE_ARGS) -> dict:
    """One iteration of ``experiment=league/<name>``; its compared metrics and timings."""
    from stepflow.testing.harness import run_cli

    with tempfile.TemporaryDirectory(prefix=f"league_{name}_") as d:
        args = [f"experiment=league/{name}", *base, *overrides]
        t0 = time.perf_counter()
        r = run_cli("stepflow.train", *args, f"hydra.run.dir={d}", timeout=timeout)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"league/{name} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        row = iteration_row(Path(d) / "metrics.csv")
    metrics = compared(row)
    if "cost/nfe" not in metrics:
        raise RuntimeError(f"league/{name}: no iteration-1 training row in metrics.csv")
    return {"metrics": metrics, "wall_s": round(wall, 1), "iteration_s": round(row.get("time/iteration_s", -1.0), 1)}


def diff(got: dict[str, float], want: dict[str, float]) -> dict[str, tuple]:
    """Recorded metrics missing or off by more than 1e-6·max(1, |x|) (tests/test_golden.py's rule)."""
    bad = {k: (None, w) for k, w in want.items() if k not in got}
    bad.update({k: (got[k], w) for k, w in want.items() if k in got and abs(got[k] - w) > 1e-6 * max(1.0, abs(w))})
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="record only these recipes (keep the others' entries)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each is single-threaded; default 2)")
    ap.add_argument("--size", choices=("full", "small"), default="full",
                    help="full: each recipe's own batch (league_it1.json); small: 2 prompts x 8 samples "
                         "(league_it1_small.json, what CI compares)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"the file (default {GOLDEN.relative_to(HERE)} or {GOLDEN_SMALL.relative_to(HERE)})")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error(f"--jobs: must be >= 1, got {a.jobs}")
    base = BASE_ARGS + (SMALL_ARGS if a.size == "small" else [])
    a.out = a.out or (GOLDEN_SMALL if a.size == "small" else GOLDEN)

    import stepflow
    from stepflow.testing.harness import ROOT

    names = recipes(ROOT)
    if a.only:
        unknown = sorted(set(a.only) - set(names))
        if unknown:
            ap.error(f"no such league recipe in {ROOT}: {', '.join(unknown)} (have: {', '.join(names)})")
        names = [n for n in names if n in a.only]
    old = json.loads(a.out.read_text()) if a.out.exists() else {}
    print(f"stepflow from {Path(stepflow.__file__).parent}; {len(names)} recipe(s), {a.jobs} at a time", flush=True)

    def extra(name: str) -> list[str]:
        return OVERRIDES.get(name, []) + (SMALL_OVERRIDES.get(name, []) if a.size == "small" else [])

    def one(name: str):
        try:
            res = run_recipe(name, extra(name), base=base)
        except RuntimeError as e:  # the others are still recorded
            print(f"  {e}", flush=True)
            return name, None
        print(f"  league/{name}: {res['wall_s']:.0f} s (iteration {res['iteration_s']:.0f} s), "
              f"{len(res['metrics'])} metrics", flush=True)
        return name, res

    with ThreadPoolExecutor(a.jobs) as pool:
        results = dict(pool.map(one, names))
    failed_runs = sorted(n for n, r in results.items() if r is None)
    results = {n: r for n, r in results.items() if r is not None}

    if a.check:
        failed = len(failed_runs)
        for name, res in results.items():
            want = old.get("recipes", {}).get(name)
            if want is None:
                print(f"league/{name}: not recorded")
                failed += 1
                continue
            bad = diff(res["metrics"], want["metrics"])
            print(f"league/{name}: " + ("matches" if not bad else f"{len(bad)} differ: {bad}"))
            failed += bool(bad)
        return 1 if failed else 0

    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    entries = dict(old.get("recipes", {}))
    for name, res in results.items():
        excluded = EXCLUDE.get(name, {})
        entries[name] = {
            "args": [f"experiment=league/{name}", *base, *extra(name)],
            "overrides": extra(name),
            "metrics": {k: v for k, v in res["metrics"].items() if k not in excluded},
            "excluded": excluded,
            "recorded_from": commit,
            "wall_s": res["wall_s"],
            "iteration_s": res["iteration_s"],
        }
    doc = {
        **{k: v for k, v in old.items() if k not in ("about", "command", "compared", "recipes")},  # notes kept
        "about": f"iteration 1 of every experiment=league/<name> recipe, {a.size} batch (tests/test_golden_league.py); "
                 "re-record with experiments/record_league_golden.py only for a change that alters training on purpose",
        "command": "python -m stepflow.train <args> hydra.run.dir=<tmp>",
        "compared": {"prefixes": list(PREFIXES), "exact": list(EXACT), "tolerance": "1e-6 * max(1, |recorded|)"},
        "recipes": entries,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {a.out} ({len(entries)} recipes)" + (f"; failed: {', '.join(failed_runs)}" if failed_runs else ""))
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
