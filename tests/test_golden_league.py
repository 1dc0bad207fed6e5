"""Golden test of the league: iteration 1 of every ``experiment=league/<name>`` recipe gives the recorded numbers.

Two sets, both recorded from commit 87b3586 (before the architecture refactor): tests/golden/league_it1.json runs each
recipe at its own batch (``golden_full``: ``make test-golden``, about 12 minutes on 2 cores), and
tests/golden/league_it1_small.json runs the same first iteration on 2 prompts x 8 samples with a 2-prompt final
evaluation (``slow``: ``make test-slow``, what CI runs; about 3x cheaper, the same code paths).

tests/golden/league_it1.json holds, per recipe, the command's arguments (``experiment=league/<name>
loop.iterations=1 eval.every=0 eval.at_start=false eval.max_prompts=12``: the evaluation draws from its own seed, so it
does not change the training numbers, and the small one keeps the test short) and the iteration-1 rewards,
advantages / gains, gradient norm, losses, KL, ratios, clip fractions and ``cost/nfe``, recorded before the
architecture refactor (from commit 87b3586) by experiments/record_league_golden.py. Every recorded metric must still
be logged and agree within 1e-6·max(1, |x|) (tests/test_golden.py's rule); metrics added later are not compared. A
change that alters training on purpose re-records the recipes it changes (``python experiments/record_league_golden.py
--only <name> ...``) and says why in its commit.

The fast test checks that every recipe file of stepflow/conf/experiment/league/ has an entry in the small set (a new
recipe gets recorded; ``make test-golden`` checks the full set's entries too); the others run each recipe once through
the CLI's command in the test's process (``run_in_process``: no fresh interpreter's imports; small: 10-60 s each on 2
CPU cores; full: 40-80 s).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from stepflow.testing.harness import ROOT, run_in_process

GOLDEN = Path(__file__).resolve().parent / "golden" / "league_it1.json"
GOLDEN_SMALL = GOLDEN.with_name("league_it1_small.json")
LEAGUE = ROOT / "stepflow" / "conf" / "experiment" / "league"
RECIPES: dict = json.loads(GOLDEN.read_text())["recipes"]
SMALL: dict = json.loads(GOLDEN_SMALL.read_text())["recipes"]


def _iteration_row(metrics_csv: Path, iteration: int = 1) -> dict[str, float]:
    """Every non-empty value of the rows of ``iteration`` in metrics.csv, merged (the train and the eval row)."""
    out: dict[str, float] = {}
    with metrics_csv.open() as fh:
        for row in csv.DictReader(fh):
            if row.get("iteration") not in ("", None) and int(float(row["iteration"])) == iteration:
                out.update({k: float(v) for k, v in row.items() if k != "iteration" and v not in ("", None)})
    return out


@pytest.mark.parametrize("recorded, size", [pytest.param(RECIPES, "full", marks=[pytest.mark.slow, pytest.mark.golden_full]),
                                            (SMALL, "small")])
def test_every_league_recipe_is_recorded(recorded, size):
    files = sorted(p.stem for p in LEAGUE.glob("*.yaml"))
    assert files, f"no league recipes in {LEAGUE}"
    missing = sorted(set(files) - set(recorded))
    assert not missing, (f"league recipes without a golden entry ({size}): {missing}; record them with "
                         f"`python experiments/record_league_golden.py --size {size} --only {' '.join(missing)}`")
    gone = sorted(set(recorded) - set(files))
    assert not gone, f"golden entries ({size}) without a recipe file: {gone}"
    for name, entry in recorded.items():
        assert entry["args"][0] == f"experiment=league/{name}" and entry["metrics"].get("cost/nfe"), name
        small = "loop.group_size=8" in entry["args"]
        assert small == (size == "small"), (name, entry["args"])


#: the recipes recorded from 87b3586 (the refactor's guard): CI compares them; the later ones' small entries run with
#: make test-extended (their full-batch entries with make test-golden)
GUARDS = {"advantageflow", "awm", "dancegrpo", "flow_grpo", "flow_grpo_fast", "g2rpo", "grpo_guard", "mixgrpo",
          "mixgrpo_flash", "nft", "paper", "tempflow", "tpgrpo"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in GUARDS else pytest.mark.extended) for n in sorted(SMALL)])
def test_league_recipe_matches_the_golden_iteration(name, tmp_path):
    _compare(name, SMALL[name], tmp_path)


@pytest.mark.slow
@pytest.mark.golden_full
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_league_recipe_at_its_own_batch_matches_the_golden_iteration(name, tmp_path):
    _compare(name, RECIPES[name], tmp_path)


def _compare(name: str, entry: dict, tmp_path: Path) -> None:
    r = run_in_process("stepflow.train", *entry["args"], f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    got = _iteration_row(tmp_path / "metrics.csv")
    want = entry["metrics"]
    missing = sorted(set(want) - set(got))  # every recorded metric is still logged (new diagnostics may be added)
    assert not missing, f"league/{name}: no longer logged: {missing}"
    bad = {k: (got[k], w) for k, w in want.items() if abs(got[k] - w) > 1e-6 * max(1.0, abs(w))}
    assert not bad, f"league/{name} iteration 1, (got, recorded): {bad}"
