"""Golden test: the first 3 iterations of the default recipe give the recorded metrics (refactors change nothing).

Recorded by ``python -m stepflow.train loop.iterations=3 eval.every=0 eval.max_prompts=48`` before the architecture
refactor (tests/golden/train_3it.json). Every ``train/*`` metric and ``cost/nfe`` must agree to 1e-6. A change that
alters the training on purpose re-records the file (``STEPFLOW_RECORD_GOLDEN=1 pytest tests/test_golden.py``) and
says why in its commit. Metrics added later are not compared; every recorded one must still be there.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from stepflow.testing.harness import run_in_process

GOLDEN = Path(__file__).resolve().parent / "golden" / "train_3it.json"
ARGS = ["loop.iterations=3", "eval.every=0", "eval.max_prompts=48"]


def _compared(row: dict[str, str]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if v not in ("", None) and (k.startswith("train/") or k == "cost/nfe")}


@pytest.mark.slow
def test_default_recipe_matches_the_golden_metrics(tmp_path):
    r = run_in_process("stepflow.train", *ARGS, f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    with (tmp_path / "metrics.csv").open() as fh:
        rows = [row for row in csv.DictReader(fh) if row.get("cost/nfe")]
    got = [{"iteration": float(row["iteration"]), **_compared(row)} for row in rows]
    if os.environ.get("STEPFLOW_RECORD_GOLDEN"):
        old = json.loads(GOLDEN.read_text())
        GOLDEN.write_text(json.dumps({**old, "iterations": got}, indent=1, sort_keys=True) + "\n")
        pytest.skip("re-recorded tests/golden/train_3it.json")
    want = json.loads(GOLDEN.read_text())["iterations"]
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):  # every recorded metric is still logged (new diagnostics may be added)
        assert not set(w) - set(g), sorted(set(w) - set(g))
        bad = {k: (g[k], w[k]) for k in w if abs(g[k] - w[k]) > 1e-6 * max(1.0, abs(w[k]))}
        assert not bad, f"iteration {w['iteration']:.0f}: {bad}"
