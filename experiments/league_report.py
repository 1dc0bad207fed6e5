"""The league's report (docs/league/): written by experiments/league.py after its runs (filled in below)."""
from __future__ import annotations

from pathlib import Path


def write_report(s, docs: Path) -> Path:
    import league

    docs.mkdir(parents=True, exist_ok=True)
    rows = league.collect(s)
    league.write_csv(rows, docs / "results.csv")
    md = docs / "report.md"
    md.write_text(f"# League\n\n{len(rows)} rows.\n")
    return md
