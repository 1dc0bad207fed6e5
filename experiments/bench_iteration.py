#!/usr/bin/env python
"""Benchmark: one GRPO iteration with gain credit against one with uniform credit, interleaved in one process.

    python experiments/bench_iteration.py [--settings shapes_default,shapes_paper,sd3_default,sd3_paper] \
        [--iters 6] [--warmup 1] [--json out.json] [--threads 1] [--compare KEY=V1,V2 [--scheme uniform] [--memory]] \
        [-- extra Hydra overrides]

For each setting, builds a gain module and a uniform module from the training config (``conf/train.yaml`` + the
setting's overrides), then alternates their iterations (gain, uniform, gain, ...) so load on the machine hits both
alike; the first ``--warmup`` iterations of each are dropped. Reports medians of: seconds per phase (rollout,
estimate, reward, advantage, update) and per iteration; NFEs (sample-level transformer forwards, CFG counted twice)
and forward-equivalent NFEs (a backward counted as 2 forwards); images decoded and scored; the share of the
iteration spent inside model evaluations (transformer forward + backward, VAE decode); the gain ÷ uniform ratios.

``--compare KEY=V1,V2 --memory``: memory instead of time. Each value trains in its own process (``python -m
stepflow.train``, ``--warmup + --iters`` iterations; one process's heap would hold the other variant's freed memory),
and the table gives each phase's peak resident set (``mem/peak_rss_gib_<phase>``, Linux), medians over the
iterations after the warm-up, and the activations the rollout kept (``mem/retained_gib``, ``loop.retain_graph``).

Settings (CPU, one torch thread):

- ``shapes_default``: the no-argument default recipe (shapes, step 0 trained, T′ = 2, 4 prompts × 16);
- ``shapes_paper``: the paper's settings on the embedded world (T′ = 5, steps 0–8 trained, β_KL 0.04, flow_sde);
- ``shapes_paper_adaptive``: the paper's settings with adaptive substeps ceil(T′·t);
- ``sd3_default`` / ``sd3_paper``: the same on the tiny SD3 pipeline (64 px, 16-channel VAE) with PickScore's
  formula on a tiny random CLIP (``reward=pickscore_tiny``); the default recipe there: step 0 trained (with the
  first-step guard so it is noisy) and its gains normalised over it (``advantage.over=trained``), as for shapes;
- ``sd3_paper_tiny_decoder``: the paper's settings with the x̂0 estimates decoded by a tiny AutoencoderTiny
  (``model.estimate_vae``; random weights here: the timing is what it measures).

Prints a markdown table (pasted into docs/results.md) and writes JSON with every iteration's numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "shapes_default": [],
    "shapes_paper": ["loop.substeps=5", "train.train_steps=null", "train.timestep_fraction=0.99", "train.beta_kl=0.04",
                     "train.kl_mode=flow_grpo_parity", "sampler=flow_sde"],
    "shapes_paper_adaptive": ["loop.substeps=5", "train.train_steps=null", "train.timestep_fraction=0.99",
                              "train.beta_kl=0.04", "train.kl_mode=flow_grpo_parity", "sampler=flow_sde",
                              "loop.adaptive_substeps=true"],
    "sd3_default": ["model=sd3_tiny", "reward=pickscore_tiny", "sampler.first_step_guard=true", "train.train_steps=[0]",
                    "advantage.over=trained"],
    "sd3_paper": ["model=sd3_tiny", "reward=pickscore_tiny", "loop.substeps=5", "train.timestep_fraction=0.99",
                  "train.beta_kl=0.04", "train.kl_mode=flow_grpo_parity", "sampler=flow_sde"],
    "sd3_paper_tiny_decoder": ["model=sd3_tiny", "reward=pickscore_tiny", "loop.substeps=5", "train.timestep_fraction=0.99",
                               "train.beta_kl=0.04", "train.kl_mode=flow_grpo_parity", "sampler=flow_sde",
                               "+model.estimate_vae={taesd}"],
}
PHASES = ("rollout", "estimate", "reward", "advantage", "update")


class ModelClock:
    """Seconds spent inside the model: the policy's velocity (forward) and decode, and the backward passes."""

    def __init__(self, module):
        self.seconds = 0.0
        pol, learner = module.policy, module.learner
        for name in ("velocity", "decode"):
            setattr(pol, name, self._timed(getattr(pol, name)))
        learner.backward = self._timed(learner.backward)

    def _timed(self, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def build(overrides: list[str], scheme: str, run_dir: Path):
    from stepflow.config import compose
    from stepflow.train import build_module

    cfg = compose("train", [*overrides, f"advantage={scheme}"])
    module = build_module(cfg, run_dir)
    return module, ModelClock(module)


def one(module, clock) -> dict[str, float]:
    m0 = clock.seconds
    t0 = time.perf_counter()
    m = module.iterate()
    wall = time.perf_counter() - t0
    rec = {p: m[f"time/{p}_s"] for p in PHASES}
    rec.update(iteration=wall, model_share=(clock.seconds - m0) / wall, nfe=m["cost/nfe"],
               fwd_equiv=m["cost/nfe_fwd_equiv"], images=m["cost/reward_images"],
               decoded=m["cost/reward_images"])
    return rec


def bench(name: str, overrides: list[str], iters: int, warmup: int, run_dir: Path) -> dict:
    from tqdm.auto import tqdm

    mods = {s: build(overrides, s, run_dir / name / s) for s in ("gain", "uniform")}
    recs: dict[str, list[dict]] = {s: [] for s in mods}
    for i in tqdm(range(iters + warmup), desc=name):
        for s, (module, clock) in mods.items():  # interleaved: gain, uniform, gain, uniform, ...
            r = one(module, clock)
            if i >= warmup:
                recs[s].append(r)
    med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in recs.items()}
    g, u = med["gain"], med["uniform"]
    return {"setting": name, "overrides": overrides, "iterations": iters, "median": med, "runs": recs,
            "ratio": {k: g[k] / u[k] if u[k] else float("nan") for k in ("iteration", "nfe", "fwd_equiv", "images")}}


def compare(name: str, overrides: list[str], key: str, values: list[str], iters: int, warmup: int,
            run_dir: Path, scheme: str = "gain") -> str:
    """One setting, one scheme, ``key`` set to each of ``values``, iterations interleaved: per-phase medians and the
    ratio of each variant's s/it to the first's (how chunk sizes and micro-batches were chosen)."""
    from tqdm.auto import tqdm

    mods = {v: build([*overrides, f"{key}={v}"], scheme, run_dir / name / f"{key}={v}") for v in values}
    recs: dict[str, list[dict]] = {v: [] for v in values}
    for i in tqdm(range(iters + warmup), desc=f"{name} {key}"):
        for v, (module, clock) in mods.items():
            r = one(module, clock)
            if i >= warmup:
                recs[v].append(r)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in recs.items()}
    base = med[values[0]]["iteration"]
    lines = [f"| {name} ({scheme}) | " + " | ".join(PHASES) + " | s/it | vs first |", "|" + "---|" * (len(PHASES) + 3)]
    for v in values:
        m = med[v]
        lines.append(f"| {key}={v} | " + " | ".join(f"{m[p]:.2f}" for p in PHASES)
                     + f" | {m['iteration']:.2f} | {m['iteration'] / base:.2f}× |")
    return "\n".join(lines)


def memory(name: str, overrides: list[str], key: str, values: list[str], iters: int, warmup: int, run_dir: Path,
           scheme: str = "gain", threads: int = 1) -> str:
    """``--memory``: each value of ``key`` trained in a process of its own; per-phase peak resident set (GiB)."""
    import csv
    import math
    import os
    import subprocess

    lines = [f"| {name} ({scheme}) | " + " | ".join(PHASES) + " | kept activations |", "|" + "---|" * (len(PHASES) + 2)]
    for v in values:
        d = run_dir / name / f"memory_{key}_{v}"
        cmd = [sys.executable, "-m", "stepflow.train", *overrides, f"advantage={scheme}", f"{key}={v}",
               f"loop.iterations={iters + warmup}", "eval.every=0", "eval.at_start=false", f"torch_threads={threads}",
               f"hydra.run.dir={d}"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if r.returncode != 0:
            raise SystemExit(f"{key}={v}: stepflow.train failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        rows = [x for x in csv.DictReader((d / "metrics.csv").open()) if x.get("time/iteration_s")][warmup:]

        def med(k, rows=rows):
            xs = [float(x[k]) for x in rows if x.get(k) not in (None, "")]
            return statistics.median(xs) if xs else float("nan")

        kept = med("mem/retained_gib")
        lines.append(f"| {key}={v} | " + " | ".join(f"{med(f'mem/peak_rss_gib_{p}'):.2f}" for p in PHASES)
                     + f" | {'—' if math.isnan(kept) else f'{kept:.3g}'} |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    head = ("| setting | scheme | s/it | " + " | ".join(PHASES) + " | NFE | fwd-equiv NFE | images | model share |"
            " gain ÷ uniform (s/it, fwd-equiv) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        for s in ("gain", "uniform"):
            m = r["median"][s]
            ratio = f"**{r['ratio']['iteration']:.2f}×**, {r['ratio']['fwd_equiv']:.2f}×" if s == "gain" else ""
            lines.append(f"| {r['setting']} | {s} | {m['iteration']:.2f} | " + " | ".join(f"{m[p]:.2f}" for p in PHASES)
                         + f" | {m['nfe']:.0f} | {m['fwd_equiv']:.0f} | {m['images']:.0f} | {m['model_share']:.0%} | {ratio} |")
    return "\n".join(lines)


def _resolve(overrides: list[str]) -> list[str]:
    """Fill ``{taesd}`` with the cached tiny AutoencoderTiny."""
    if not any("{taesd}" in o for o in overrides):
        return list(overrides)
    from stepflow.testing.tiny_policies import tiny_taesd_dir

    return [o.replace("{taesd}", str(tiny_taesd_dir())) for o in overrides]


@contextmanager
def _quiet():
    import logging
    import warnings

    logging.getLogger("lightning").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _writable(ap, flag: str, path: Path) -> None:
    """``path`` is a directory or can be made one (no file in its way, its first existing parent writable)."""
    import os

    q = Path(path).expanduser().resolve()
    while not q.exists() and q != q.parent:
        q = q.parent
    if not q.is_dir() or not os.access(q, os.W_OK):
        ap.error(f"{flag}: {path} cannot be written ({q} {'is a file' if q.is_file() else 'cannot be written'}); "
                 "give a directory that can be")


def check_args(ap, args) -> tuple[list[str], str, list[str]]:
    """Every argument checked before anything loads (argparse's one-line error, exit 2); returns the settings'
    names, and the ``--compare`` key and values."""
    names = [x.strip() for x in args.settings.split(",") if x.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        ap.error(f"--settings: {'unknown setting ' + repr(unknown[0]) if unknown else 'names no setting'}; choose "
                 f"from {', '.join(SETTINGS)}")
    if args.iters < 1:
        ap.error(f"--iters: must be an integer >= 1 (measured iterations per scheme), got {args.iters}")
    if args.warmup < 0:
        ap.error(f"--warmup: must be an integer >= 0, got {args.warmup}")
    if args.threads < 1:
        ap.error(f"--threads: must be an integer >= 1 (torch threads), got {args.threads}")
    if args.memory and not args.compare:
        ap.error("--memory: needs --compare KEY=V1,V2 (the variants to train, each in its own process)")
    key, vals = "", []
    if args.compare is not None:
        key, eq, text = args.compare.partition("=")
        vals = [v.strip() for v in text.split(",") if v.strip()]
        if not eq or not key.strip() or not vals:
            ap.error(f"--compare: must be KEY=V1,V2 (a config key and its values), got {args.compare!r}")
        key = key.strip()
    _writable(ap, "--run-dir", Path(args.run_dir))
    if args.json:
        _writable(ap, "--json", Path(args.json).expanduser().resolve().parent)
    from stepflow.cli import group_options

    schemes = group_options("advantage") or []
    if args.scheme not in schemes:
        ap.error(f"--scheme: unknown advantage scheme {args.scheme!r}; choose from {', '.join(schemes)}")
    return names, key, vals


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--iters", type=int, default=6, help="measured iterations per scheme")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--run-dir", default="/tmp/stepflow_bench")
    ap.add_argument("--compare", default=None, metavar="KEY=V1,V2",
                    help="instead of gain vs uniform: gain with KEY set to each value, interleaved")
    ap.add_argument("--scheme", default="gain", help="with --compare: the advantage scheme (gain, uniform, ...)")
    ap.add_argument("--memory", action="store_true",
                    help="with --compare: each value in its own training process; the per-phase peak resident set")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides added to every setting")
    args = ap.parse_args(argv)
    names, key, vals = check_args(ap, args)
    try:
        return _run(args, names, key, vals)
    except Exception as e:  # noqa: BLE001 - a setting that does not compose or build: one line (as the CLI's)
        from stepflow.cli import compose_error, debugging

        if debugging():
            raise
        raise SystemExit(f"bench_iteration.py: error: {compose_error(e)}") from None


def _run(args, names: list[str], key: str, vals: list[str]) -> list[dict]:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "tests"))
    results = []
    if args.compare:
        if args.memory:
            for name in names:
                print(memory(name, _resolve(SETTINGS[name]) + args.overrides, key, vals, args.iters,
                             args.warmup, Path(args.run_dir), scheme=args.scheme, threads=args.threads), flush=True)
            return results
        with _quiet():
            for name in names:
                print(compare(name, _resolve(SETTINGS[name]) + args.overrides, key, vals, args.iters, args.warmup,
                              Path(args.run_dir), scheme=args.scheme), flush=True)
        return results
    with _quiet():
        for name in names:
            results.append(bench(name, _resolve(SETTINGS[name]) + args.overrides, args.iters, args.warmup,
                                 Path(args.run_dir)))
            print(table(results[-1:]), flush=True)
    print(table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
