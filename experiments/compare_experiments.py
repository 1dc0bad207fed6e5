"""Record or compare 3 iterations of every ``conf/experiment/*`` (refactors must not change what a config trains).

Each experiment runs in-process on the tiny shapes policy (real models and their rewards cannot load here, so
``model``/``reward``/``data`` are replaced by the embedded world's and the batch shrunk; everything else the
experiment sets — credit, sampler, window, weighting, train steps, KL, normalisation — is its own), for 3
iterations without evaluation. ``--record FILE`` writes every ``train/*`` metric and ``cost/nfe`` per iteration;
``--compare FILE`` reruns and prints the metrics that differ by more than 1e-6 (relative), exit 1 if any.

    python experiments/compare_experiments.py --record /tmp/before.json       # on the old code
    python experiments/compare_experiments.py --compare /tmp/before.json      # on the new code
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=shapes", "reward=shapes_geneval", "data=shapes", "trainer=cpu", "logger=csv",
         "loop.iterations=3", "loop.prompts_per_iter=2", "loop.group_size=4", "eval.every=0", "eval.max_prompts=4",
         "eval.num_steps=2", "train.micro_batch_size=8", ]


#: options whose name changed (the recorded variant keeps its old name)
RENAMED = {"advantage=distill": ["advantage=gain", "objective=distill"],
           "train.train_steps=auto": ["train.train_steps=null", "train.weighting=auto"]}
#: every option of the groups an objective touches, once each, on the miniature base recipe
VARIANTS = {f"variant/{o}": ["experiment=mini_base", *RENAMED.get(o, [o])] for o in [
    "advantage=uniform", "advantage=gain_per_step", "advantage=gain_ema", "advantage=gae", "advantage=gain_trained",
    "advantage=distill", "sampler=flow_sde", "sampler=cps", "sampler=ode", "window=fixed", "window=sliding",
    "window=random", "train.weighting=noise", "train.weighting=guard", "train.weighting=grad_rms",
    "train.weighting=gain_var", "train.train_steps=auto", "train.train_steps=[0,2]", "train.timestep_fraction=0.5",
    "train.updates_per_iter=2", "train.beta_kl=0.01"]}


def experiments() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")) + sorted(VARIANTS)


def run_one(name: str, extra: list[str]) -> list[dict[str, float]]:
    import csv

    from stepflow.config import compose
    from stepflow.train import run

    first = VARIANTS.get(name, [f"experiment={name}"])
    cfg = compose("train", [*first, *SMALL, *extra])
    with tempfile.TemporaryDirectory() as d:
        run(cfg, Path(d))
        with (Path(d) / "metrics.csv").open() as fh:
            rows = [r for r in csv.DictReader(fh) if r.get("cost/nfe")]
    return [{k: float(v) for k, v in r.items() if v not in ("", None) and (k.startswith("train/") or k == "cost/nfe")}
            for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--record", type=Path)
    g.add_argument("--compare", type=Path)
    ap.add_argument("--only", nargs="*", default=None, help="experiment names (default: all)")
    ap.add_argument("overrides", nargs="*", help="extra overrides for every run")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    names = a.only or experiments()
    want = json.loads(a.compare.read_text()) if a.compare else {}
    got, bad = {}, []
    for name in names:
        try:
            got[name] = run_one(name, a.overrides)
        except Exception as e:  # noqa: BLE001 - recorded: a config that fails must fail the same way
            got[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(f"{name}: {'error ' + got[name]['error'] if isinstance(got[name], dict) else f'{len(got[name])} iterations'}",
              flush=True)
        if a.compare:
            w, g_ = want.get(name), got[name]
            if w is None:
                bad.append(f"{name}: not recorded")
            elif isinstance(w, dict) or isinstance(g_, dict):
                if w != g_:
                    bad.append(f"{name}: {w} != {g_}")
            else:
                for i, (wr, gr) in enumerate(zip(w, g_)):
                    missing = sorted(set(wr) - set(gr))
                    diff = {k: (gr[k], wr[k]) for k in wr if k in gr and abs(gr[k] - wr[k]) > 1e-6 * max(1.0, abs(wr[k]))}
                    if missing or diff:
                        bad.append(f"{name} iteration {i}: missing {missing} differ {diff}")
                if len(w) != len(g_):
                    bad.append(f"{name}: {len(g_)} iterations, recorded {len(w)}")
    if a.record:
        a.record.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        return 0
    print("\n".join(bad) if bad else f"all {len(names)} experiments reproduce their recorded metrics")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
