"""The league's report: ``docs/league/`` from the runs of experiments/league.py.

    python experiments/league.py --report        # rewrite docs/league/ from outputs/league/

Writes ``results.csv`` (one row per method, seed and budget point), ``lr_grid.csv``, ``report.md`` (tables of mean
± 95 % CI per method and budget and per GenEval category, paired comparisons with Holm's correction, the minimum
detectable difference at 80 % power, the cost table and the claims table) and the figures ``curves.png`` (held-out
GenEval against NFEs, seconds and iterations) and ``samples.png`` (every method's final samples of seed 0 on the
same held-out prompts and noises).

The statistics are small pure functions (tests/test_league.py checks them against scipy and a simulation):
paired differences are over the seeds both methods have (seed s of every method shares its prompts, its first
initial noises and the held-out noises).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ALPHA, POWER = 0.05, 0.80


# ---------------------------------------------------------------------------------------------------- statistics
def paired_test(a: dict[int, float], b: dict[int, float], confidence: float = 0.95) -> dict[str, float]:
    """Paired t-test of ``a − b`` over their common keys (seeds): ``{diff, half, n, sd, t, p}``.

    d_s = a_s − b_s, mean d̄, sd s_d (ddof 1), t = d̄ / (s_d / √n) with n − 1 degrees of freedom, two-sided p, and the
    ``confidence`` interval d̄ ± t_{(1+c)/2, n−1} s_d / √n. n < 2: NaN statistics; s_d = 0: p = 0 (d̄ ≠ 0) or 1."""
    from scipy.stats import t as student_t

    keys = sorted(set(a) & set(b))
    d = [a[k] - b[k] for k in keys]
    n = len(d)
    nan = math.nan
    if n == 0:
        return {"diff": nan, "half": nan, "n": 0, "sd": nan, "t": nan, "p": nan}
    m = sum(d) / n
    if n < 2:
        return {"diff": m, "half": nan, "n": 1, "sd": nan, "t": nan, "p": nan}
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * se
    if se == 0:
        return {"diff": m, "half": 0.0, "n": n, "sd": 0.0, "t": math.inf if m else 0.0, "p": 0.0 if m else 1.0}
    t = m / se
    return {"diff": m, "half": half, "n": n, "sd": sd, "t": t, "p": float(2 * student_t.sf(abs(t), n - 1))}


def holm(pvals: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error): sorted ascending p_(1) ≤ … ≤ p_(m),
    p̃_(i) = max_{j ≤ i} min(1, (m − j + 1) p_(j)); NaN entries are left out of the family and stay NaN."""
    idx = [i for i, p in enumerate(pvals) if not math.isnan(p)]
    m = len(idx)
    out = [math.nan] * len(pvals)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvals[i])):
        running = max(running, min(1.0, (m - rank) * pvals[i]))
        out[i] = running
    return out


def detectable_difference(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference δ a two-sided paired t-test at level ``alpha`` over ``n`` seeds detects
    with probability ``power`` when the paired differences have standard deviation ``sd``: the root in δ of
    P(|T| > t_{1−α/2, n−1}) = power with T noncentral t (n − 1 dof, noncentrality δ √n / sd)."""
    from scipy.optimize import brentq
    from scipy.stats import nct
    from scipy.stats import t as student_t

    if n < 2 or not sd > 0:
        return math.nan
    crit = float(student_t.ppf(1 - alpha / 2, n - 1))

    def gap(delta: float) -> float:
        nc = delta * math.sqrt(n) / sd
        p = float(nct.sf(crit, n - 1, nc) + nct.cdf(-crit, n - 1, nc))
        return (p if math.isfinite(p) else _power_by_integral(crit, n - 1, nc)) - power

    hi = sd
    while gap(hi) < 0:  # power grows with delta: bracket the root
        hi *= 2
    return float(brentq(gap, 1e-9 * sd, hi))


def _power_by_integral(crit: float, df: int, nc: float) -> float:
    """P(|T| > crit) for T noncentral t (``df`` dof, noncentrality ``nc``) as the integral over V ~ χ²(df) of
    P(|Z + nc| > crit·√(V/df)), Z standard normal: where scipy's ``nct`` returns NaN (few dof, large ``nc``; e.g.
    2 seeds)."""
    from scipy.integrate import quad
    from scipy.stats import chi2, norm

    def f(v: float) -> float:
        s = crit * math.sqrt(v / df)
        return float(chi2.pdf(v, df)) * float(norm.sf(s - nc) + norm.cdf(-s - nc))

    return float(quad(f, 0, math.inf, limit=200)[0])


# ---------------------------------------------------------------------------------------------------- tables
def by_method(rows: Sequence[dict[str, Any]], key: str = "geneval") -> dict[str, dict[int, dict[int, float]]]:
    """``{method: {budget: {seed: value}}}``."""
    out: dict[str, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        out[r["method"]][int(r["budget"])][int(r["seed"])] = float(r[key])
    return out


def comparisons_to_leader(data: dict[str, dict[int, dict[int, float]]], budget: int,
                          methods: Sequence[str]) -> list[dict[str, Any]]:
    """Every method against the one with the highest mean at ``budget`` (paired over seeds), Holm-adjusted over the
    family of these comparisons."""
    means = {m: sum(v.values()) / len(v) for m in methods if (v := data.get(m, {}).get(budget))}
    if not means:
        return []
    lead = max(means, key=lambda m: means[m])
    out = [{"method": m, "leader": lead, **paired_test(data[lead][budget], data[m][budget])}
           for m in sorted(means, key=lambda m: -means[m]) if m != lead]
    for r, p in zip(out, holm([r["p"] for r in out])):
        r["p_holm"] = p
    return out


def claim_verdict(test: dict[str, float], p_adj: float, kind: str, mdd: float) -> str:
    """reproduced / refuted / not decidable for a claim of ``kind`` (:class:`league.Claim`), ``test["diff"]`` =
    better − worse. ``better``: reproduced when the Holm-adjusted p < α with the claimed sign, refuted when
    significant with the opposite sign. ``alike``: refuted when significant either way, reproduced when the 95 % CI of
    the difference lies inside ± the detectable difference. ``no_better`` (worse does not beat better): refuted when
    worse wins significantly, reproduced when the CI excludes worse winning by the detectable difference or more
    (its lower end above −mdd)."""
    if kind not in ("better", "alike", "no_better"):
        raise ValueError(f"kind: must be better, alike or no_better, got {kind!r}")
    if test["n"] < 2 or math.isnan(test.get("p", math.nan)):
        return "not decidable (too few seeds)"
    sig = p_adj < ALPHA
    if kind == "alike":
        if sig:
            return "refuted (they differ)"
        if not math.isnan(mdd) and abs(test["diff"]) + test["half"] < mdd:
            return "reproduced (alike within the detectable difference)"
        return "not decidable at this power"
    if kind == "no_better":
        if sig and test["diff"] < 0:
            return "refuted (it beats plain gains)"
        if not math.isnan(mdd) and test["diff"] - test["half"] > -mdd:
            return ("reproduced (plain gains significantly better)" if sig else
                    "reproduced (it does not beat plain gains by the detectable difference)")
        return "not decidable at this power"
    if sig:
        return "reproduced" if test["diff"] > 0 else "refuted (the opposite holds)"
    return "not decidable at this power"


def fmt(m: float, h: float, digits: int = 3) -> str:
    if math.isnan(m):
        return "—"
    return f"{m:.{digits}f}" if math.isnan(h) else f"{m:.{digits}f} ± {h:.{digits}f}"


def fmt_p(p: float) -> str:
    return "—" if math.isnan(p) else ("< 0.001" if p < 1e-3 else f"{p:.3f}")


# ---------------------------------------------------------------------------------------------------- report
README_BEGIN = "<!-- the league's table: `python experiments/league.py --report` rewrites it -->"
README_END = "<!-- end of the league's table -->"


def readme_table(rows: Sequence[dict[str, Any]], titles: dict[str, str], methods: Sequence[str]) -> str:
    """The README's first results table: every league method's mean ± 95 % CI of the held-out GenEval at each budget
    of the table phase (``rows``: results.csv rows, strings or numbers), best first at the largest budget, with the
    mean training seconds to it and the seeds; then a line naming the ``methods`` that have no table row yet."""
    import report

    rows = [r for r in rows if r["phase"] == "table" and r["method"] in methods]
    data = by_method(rows)
    budgets = sorted({int(float(r["budget"])) for r in rows})
    if not budgets:
        return ""
    top = budgets[-1]
    secs = defaultdict(list)
    for r in rows:
        if int(float(r["budget"])) == top:
            secs[r["method"]].append(float(r["seconds"]))
    mean = {m: report.mean_ci(list(data[m].get(top, {}).values()))[0] for m in data}
    order = sorted(data, key=lambda m: -mean[m] if not math.isnan(mean[m]) else math.inf)
    out = ["| method | " + " | ".join(f"{b:,} NFEs" for b in budgets) + f" | seconds to {top:,} | seeds |",
           "|---|" + "---|" * (len(budgets) + 2)]
    for m in order:
        cells = [fmt(*report.mean_ci(list(data[m].get(b, {}).values()))[:2]) for b in budgets]
        n = max((len(v) for v in data[m].values()), default=0)
        sec = f"{sum(secs[m]) / len(secs[m]):.0f}" if secs[m] else "—"
        out.append(f"| {titles.get(m, m)} (`{m}`) | " + " | ".join(cells) + f" | {sec} | {n} |")
    waiting = [m for m in methods if m not in data]
    if waiting:  # league methods without a table run yet: named, not left out silently
        out.append("\nNot run in the league yet: " + ", ".join(f"{titles.get(m, m)} (`{m}`)" for m in waiting)
                   + " (`make league` runs them).")
    return "\n".join(out)


def update_readme(path: Path, table: str) -> bool:
    """Replace the text between README_BEGIN and README_END in ``path`` by ``table``; False where the markers are
    missing (nothing written)."""
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    path.write_text(f"{head}{README_BEGIN}\n{table}\n{README_END}{tail}")
    return True


def write_report(s, docs: Path, readme: Path | None = None) -> Path:
    import league
    import report

    docs.mkdir(parents=True, exist_ok=True)
    rows = league.collect(s)
    league.write_csv(rows, docs / "results.csv")
    grid_rows = league.collect(s, ("grid",))
    league.write_csv(grid_rows, docs / "lr_grid.csv")
    bases = league.base_scores(s)
    names = {m.name: m for m in (*league.METHODS, *league.CLAIM_ARMS)}
    data = by_method(rows)
    budgets = sorted({int(r["budget"]) for r in rows})
    order = [m for m in (*[x.name for x in league.METHODS], *[x.name for x in league.CLAIM_ARMS]) if m in data]
    league_methods = [m for m in order if m in {x.name for x in league.METHODS}]
    L: list[str] = []
    w = L.append
    w("# The league: every method at equal compute on the embedded world\n")
    w(f"Generated by `python experiments/league.py --report` from the runs under `{_rel(s.out)}` "
      f"({len(rows)} rows in [results.csv](results.csv)). Protocol: every run trains to a budget of "
      f"{int(s.budget):,} forward-equivalent NFEs (`loop.budget`; a backward pass counts 2, CFG doubles; reward-model "
      f"images are counted beside it) and is evaluated on all 285 held-out GenEval prompts (ODE, 10 steps, the EMA "
      f"weights, the same noises for every run) after the iterations that reach "
      f"{', '.join(f'{f:g}' for f in s.fractions)} of it; seeds {', '.join(map(str, s.seeds))} for every method "
      f"(seed s shares its prompt order and first initial noises across methods); each method's lr chosen on "
      f"{{lr/3, lr, 3·lr}} at {s.grid_budget_fraction:g} of the budget with seeds "
      f"{', '.join(map(str, s.grid_seeds))} ([lr_grid.csv](lr_grid.csv)). An evaluation's budget is the fraction its "
      f"iteration reached; the NFEs it actually spent (at most one iteration more) are in the `nfe` column.\n")
    if "base" in bases:
        b = bases["base"]
        w(f"Base model: held-out GenEval **{b['geneval']:.3f}** (" + ", ".join(
            f"{c.replace('_', ' ')} {b[c]:.2f}" for c in league.CATEGORIES) + ")"
          + (f"; at CFG 4.5 {bases['base_cfg45']['geneval']:.3f}" if "base_cfg45" in bases else "") + ".\n")

    done = []
    for ph in ("grid", "table", "claims"):
        runs = league.plan(s, [ph], check_config=False)
        if runs:
            done.append(f"{ph} {sum(r.status == 'finished' for r in runs)} of {len(runs)}")
    if done:
        again = "make league-quick" if s.check else "make league"
        w("Runs finished: " + ", ".join(done) + f" (a rerun of `{again}` resumes what is missing).\n")
    spent = league_cost(s, [*grid_rows, *rows])
    if spent:
        est = sum(v["estimated"] for v in spent.values())
        hours = sum(v["hours"] for v in spent.values())
        w("What the league cost (each run one torch thread; the wall time of each run in `runs.jsonl`): " + "; ".join(
            f"{ph} {v['runs']} runs, {v['hours']:.1f} run-hours" for ph, v in spent.items())
          + f"; in all {hours:.1f} run-hours, {hours / 2:.1f} hours at `--jobs 2` on 2 cores"
          + (f" ({est} runs finished before `runs.jsonl` recorded them: their wall time estimated from their "
             "training seconds times the median ratio of wall to training seconds of the recorded runs)" if est else "")
          + ".\n")

    # ---- main table
    w("## Held-out GenEval, mean ± 95 % confidence interval over seeds\n")
    w("| method | " + " | ".join(f"{b:,} NFEs" for b in budgets) + " | seeds | lr |")
    w("|---|" + "---|" * (len(budgets) + 2))
    lrs = {r["method"]: r["lr"] for r in rows}
    for m in order:
        cells = []
        for b in budgets:
            mean, half, n = report.mean_ci(list(data[m].get(b, {}).values()))
            cells.append(fmt(mean, half))
        nseeds = max((len(v) for v in data[m].values()), default=0)
        w(f"| {m} ({names[m].title}) | " + " | ".join(cells) + f" | {nseeds} | {lrs.get(m, '')} |")
    w("")

    # ---- detectable difference
    sds = []
    for b in budgets:
        for r in comparisons_to_leader(data, b, league_methods):
            if r["n"] >= 2 and r["sd"] > 0:
                sds.append(r["sd"])
    n_seeds = len(s.seeds)
    if sds:
        sd_med = sorted(sds)[len(sds) // 2]
        mdd = detectable_difference(sd_med, n_seeds)
        w(f"**Minimum detectable difference** (paired t-test over {n_seeds} seeds, two-sided α = {ALPHA}, power "
          f"{POWER:.0%}): **{mdd:.3f}** GenEval at the median standard deviation of the paired differences "
          f"({sd_med:.3f}, over every comparison below); a difference smaller than this is one the league cannot be "
          f"expected to see. With Holm's correction over a family of m comparisons the detectable difference is "
          f"larger (α/m for the smallest p).\n")
    else:
        mdd = math.nan
    if s.check:  # said first: what this report is, and what its differences are worth
        L.insert(1, f"**A pipeline check, not a ranking.** `make league-quick` runs {len(order)} methods on "
                    f"{len(s.seeds)} seeds to one budget of {int(s.budget):,} forward-equivalent NFEs, with no lr grid "
                    "and no claims, to show that the league's plan, runs, ledger and report work end to end. "
                    + (f"At {len(s.seeds)} seeds the minimum detectable difference is {mdd:.3f} GenEval: the "
                       "differences below are within noise. " if not math.isnan(mdd) else "")
                    + "`make league` runs the league ([docs/league/report.md](../../../docs/league/report.md)).\n")

    # ---- paired comparisons
    w("## Paired comparisons with the leader at each budget (Holm-adjusted over the methods)\n")
    for b in budgets:
        comp = comparisons_to_leader(data, b, league_methods)
        if not comp:
            continue
        w(f"**{b:,} NFEs** (leader: {comp[0]['leader']})\n")
        w("| method | difference to the leader (95 % CI) | seeds | p | p (Holm) |")
        w("|---|---|---|---|---|")
        for r in comp:
            w(f"| {r['method']} | {fmt(-r['diff'], r['half'])} | {r['n']} | {fmt_p(r['p'])} | {fmt_p(r['p_holm'])} |")
        w("")

    # ---- the lr grid
    if s.grid:
        from stepflow.config import composer

        w(f"## Learning rates (the grid: seeds {', '.join(map(str, s.grid_seeds))}, "
          f"{int(s.grid_budget):,} NFEs, mean of the held-out GenEval at {', '.join(f'{int(f * s.budget):,}' for f in s.fractions if f <= s.grid_budget_fraction + 1e-12)} NFEs)\n")
        w("| method | config's lr | grid (lr: mean held-out GenEval) | chosen |")
        w("|---|---|---|---|")
        with composer() as compose:
            chosen = league.chosen_lrs(s, compose)
            for m in league.METHODS:
                if m.name not in s.methods:
                    continue
                lr0 = league.configured_lr(m, compose)
                scores = league.grid_scores(s, m, league.grid_list(s, m, lr0))
                cells = ", ".join(f"{k}: {'—' if v is None else f'{v:.3f}'}" for k, v in scores.items())
                lr, why = chosen[m.name]
                w(f"| {m.name} | {league.lr_str(lr0)} | {cells} | {lr if why.startswith('grid') else '— (grid unfinished)'} |")
        w("")

    # ---- per category
    if budgets:
        b = budgets[-1]
        w(f"## Per GenEval category at {b:,} NFEs (mean over seeds)\n")
        w("| method | " + " | ".join(c.replace("_", " ") for c in league.CATEGORIES) + " |")
        w("|---|" + "---|" * len(league.CATEGORIES))
        if "base" in bases:
            w("| base | " + " | ".join(f"{bases['base'][c]:.2f}" for c in league.CATEGORIES) + " |")
        for m in order:
            cells = []
            for c in league.CATEGORIES:
                vals = [float(r[c]) for r in rows if r["method"] == m and int(r["budget"]) == b]
                cells.append(f"{sum(vals) / len(vals):.2f}" if vals else "—")
            w(f"| {m} | " + " | ".join(cells) + " |")
        w("")

    # ---- cost table
    cost = cost_table(s, order)
    if cost:
        w("## What an iteration costs (medians over the table's runs)\n")
        w("| method | fwd-equiv NFEs / it. | of them backward passes (NFE) | reward images / it. | s / it. | "
          f"iterations to {int(s.budget):,} NFEs | training s per run |")
        w("|---|---|---|---|---|---|---|")
        for m in order:
            if m in cost:
                c = cost[m]
                w(f"| {m} | {c['nfe']:,.0f} | {c['backward']:,.0f} | {c['images']:,.0f} | {c['s_it']:.2f} | "
                  f"{c['iterations']:.0f} | {c['seconds']:.0f} |")
        w("\nSeconds are those of the 2-core machine running two runs at once (and at times other work): "
          "compare them as ratios, not as absolute times.\n")

    # ---- claims
    if not s.claims:
        w("## The paper's claims\n\nNot tested here (their arms run in `make league`).\n")
    else:
        _claims(w, data, budgets, mdd)


    # ---- figures
    if plot_curves(s, order, docs / "curves.png"):
        w("## Curves\n\n![held-out GenEval against forward-equivalent NFEs, training seconds and iterations, mean over "
          "seeds](curves.png)\n")
    if plot_samples(s, league_methods, docs / "samples.png"):
        w("## Samples\n\nSeed 0 of every method at the end of its budget (the EMA adapter it saved), on the same 12 "
          "held-out prompts (two per GenEval category) with the same initial noises; a green frame: GenEval's rules "
          "pass the image, red: they do not.\n\n![every method's samples on the same held-out prompts](samples.png)\n")
    md = docs / "report.md"
    md.write_text("\n".join(L) + "\n")
    if readme is not None:
        update_readme(readme, readme_table(rows, {m: names[m].title for m in league_methods}, league_methods))
    return md


def league_cost(s, rows: Sequence[dict[str, Any]] = ()) -> dict[str, dict[str, float]]:
    """``{phase: {runs, hours, estimated}}`` of the finished runs: the wall time ``<out>/runs.jsonl`` records (every
    attempt of a run whose last record exited 0) and, for the runs of ``rows`` (results.csv / lr_grid.csv rows) that
    finished before it recorded them, an estimate: their training seconds (the largest ``seconds`` of their rows)
    times the median ratio of wall to training seconds over the runs that have both (``estimated`` counts them)."""
    import statistics

    import league

    f = (s.out if getattr(s, "ledger", None) is None else s.ledger) / "runs.jsonl"
    last: dict[tuple, dict] = {}
    total: dict[tuple, float] = defaultdict(float)
    for r in (league.read_records(f) if f.is_file() else []):  # the lines it cannot read are named and skipped
        try:
            key, wall_s = (r["phase"], r["method"], r["run"]), float(r["wall_s"])
        except (TypeError, ValueError):
            continue
        total[key] += wall_s  # an interrupted and resumed run: every attempt counts
        last[key] = r
    wall = {key: total[key] for key, r in last.items() if r["rc"] == 0}
    train: dict[tuple, float] = defaultdict(float)
    for r in rows:
        key = (r["phase"], r["method"], league.run_name(r["phase"], r["lr"], int(r["seed"])))
        train[key] = max(train[key], float(r["seconds"]))
    ratios = [wall[k] / train[k] for k in wall if train.get(k, 0) > 0]
    ratio = statistics.median(ratios) if ratios else math.nan
    out: dict[str, dict[str, float]] = {}
    phases = ("base", "grid", "table", "claims")
    for key in sorted({*wall, *(train if ratios else ())},
                      key=lambda k: (phases.index(k[0]) if k[0] in phases else len(phases), k)):
        d = out.setdefault(key[0], {"runs": 0, "hours": 0.0, "estimated": 0})
        d["runs"] += 1
        if key in wall:
            d["hours"] += wall[key] / 3600
        else:
            d["hours"] += train[key] * ratio / 3600
            d["estimated"] += 1
    return out


def _claim_budget(c, budgets: Sequence[int]) -> int | None:
    if not budgets:
        return None
    return budgets[0] if c.source == "Fig. 9" else budgets[-1]


def _rel(p: Path) -> str:
    import league

    try:
        return str(Path(p).resolve().relative_to(league.ROOT))
    except ValueError:
        return str(p)


def cost_table(s, methods: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per method, medians over its finished table / claims runs of the per-iteration costs."""
    import statistics

    import league
    import report

    out = {}
    for m in methods:
        per = defaultdict(list)
        for phase in ("table", "claims"):
            for d in sorted((s.out / phase / m).glob("seed=*")):
                if not d.is_dir() or not league.finished(d):
                    continue
                tr = [r for r in report.read_metrics(d / "metrics.csv") if "time/iteration_s" in r]
                if not tr:
                    continue
                per["nfe"].append(statistics.median(r.get("cost/nfe_fwd_equiv", math.nan) for r in tr))
                per["backward"].append(statistics.median(r.get("cost/nfe_backward", 0.0) for r in tr))
                per["images"].append(statistics.median(r.get("cost/reward_images", 0.0) for r in tr))
                per["s_it"].append(statistics.median(r["time/iteration_s"] for r in tr))
                per["iterations"].append(len(tr))
                per["seconds"].append(sum(r["time/iteration_s"] for r in tr))
        if per:
            out[m] = {k: statistics.median(v) for k, v in per.items()}
    del league
    return out


def _curves(s, m: str, rows: Sequence[dict[str, Any]] | None = None) -> dict[int, list[tuple[float, float, float, float]]]:
    """Per seed: [(nfe, seconds, iteration, geneval)] of every evaluation of the method's runs (``rows``:
    :func:`league.collect`'s, read when not given; the ledger's rows of runs measured before the archive count)."""
    import league

    rows = league.collect(s) if rows is None else rows
    out: dict[int, list[tuple[float, float, float, float]]] = defaultdict(list)
    for r in sorted((r for r in rows if r["method"] == m), key=lambda r: (r["seed"], r["fraction"])):
        out[r["seed"]].append((float(r["nfe"]), float(r["seconds"]), float(r["iteration"]), float(r["geneval"])))
    return dict(out)


def plot_curves(s, methods: Sequence[str], path: Path) -> bool:
    import league

    rows = league.collect(s)
    series = {m: _curves(s, m, rows) for m in methods}
    series = {m: v for m, v in series.items() if v}
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    base = league.base_scores(s).get("base", {}).get("geneval")
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5), sharey=True)
    cmap = plt.get_cmap("tab20")
    for i, (m, runs) in enumerate(series.items()):
        style = "-" if m in {x.name for x in league.METHODS} else ":"
        k = min(len(p) for p in runs.values())
        if k == 0:
            continue
        for ax, j in zip(axes, range(3)):
            xs = [sum(p[e][j] for p in runs.values()) / len(runs) for e in range(k)]
            ys = [sum(p[e][3] for p in runs.values()) / len(runs) for e in range(k)]
            if base is not None:
                xs, ys = [0.0, *xs], [base, *ys]
            ax.plot(xs, ys, style, marker="o", ms=3, color=cmap(i % 20), label=m if j == 0 else None)
    for ax, name in zip(axes, ("forward-equivalent NFEs", "training seconds (2 runs per 2 cores)", "iterations")):
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
    # iterations span 6 (the paper's recipe) to 60+ (the default): a log axis from 1, its ticks written out
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    axes[2].set_xscale("symlog", linthresh=1)
    top = max((max(p[-1][2] for p in runs.values() if p) for runs in series.values()), default=1)
    axes[2].xaxis.set_major_locator(FixedLocator([t for t in (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
                                                  if t <= max(top * 1.5, 2)]))
    axes[2].xaxis.set_major_formatter(ScalarFormatter())
    axes[2].xaxis.set_minor_locator(NullLocator())
    axes[0].set_ylabel("held-out GenEval (mean over seeds)")
    axes[2].legend(*axes[0].get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7,
                   frameon=False, title="method")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def sample_rows(s, methods: Sequence[str], seed: int = 0, prompts: int = 12, noise_seed: int = 1234):
    """Per method with a finished table run of ``seed``: its final adapter's ODE samples of the same
    category-balanced ``prompts`` held-out prompts with the same initial noises (``python -m stepflow.evaluate
    lora_path=<run>/lora max_prompts=12 seed=1234``, in process). Returns ``(prompts, [(method, images, strict)])``."""
    from ablations import hydra_value

    from stepflow.config import compose
    from stepflow.core.heldout import evaluate_geneval
    from stepflow.evaluate import load_policy, load_records, settings
    from stepflow.rewards.shapes_geneval import judge_batch

    rows, texts = [], None
    for m in methods:
        run = s.out / "table" / m / f"seed={seed}"
        lora = run / "lora"
        if not (lora / "pytorch_lora_weights.safetensors").is_file():
            continue
        cfg = settings(compose("evaluate", [f"lora_path={hydra_value(str(lora))}", f"max_prompts={prompts}", f"seed={noise_seed}",
                                            "grid.per_category=0"]))
        policy = load_policy(cfg)
        _, images, recs = evaluate_geneval(policy, load_records(cfg), num_steps=cfg.sampler.num_steps, guidance=1.0,
                                           seed=noise_seed, num_per_prompt=1, max_prompts=prompts, batch_size=64)
        texts = [r["prompt"] for r in recs]
        rows.append((m, images, [bool(j.strict) for j in judge_batch(images, texts)]))
    return texts, rows


def plot_samples(s, methods: Sequence[str], path: Path, seed: int = 0) -> bool:
    """One row per method: :func:`sample_rows`, each image framed green when GenEval's rules pass it, red when not."""
    texts, rows = sample_rows(s, methods, seed)
    if not rows:
        return False
    import textwrap

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    n = len(texts)
    fig, axes = plt.subplots(len(rows), n, figsize=(1.25 * n + 1.6, 1.3 * len(rows) + 0.9), squeeze=False)
    for i, (m, images, ok) in enumerate(rows):
        for j in range(n):
            ax = axes[i, j]
            ax.imshow(images[j].float().clamp(0, 1).permute(1, 2, 0).cpu().numpy(), interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            for sp in ax.spines.values():
                sp.set_color("tab:green" if ok[j] else "tab:red")
                sp.set_linewidth(2)
            if i == 0:
                ax.set_title("\n".join(textwrap.wrap(texts[j], 18)[:3]), fontsize=6)
            if j == 0:
                ax.set_ylabel(f"{m}\n{sum(ok)}/{n}", fontsize=7, rotation=0, ha="right", va="center")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _claims(w, data, budgets, mdd: float) -> None:
    """The claims table of the report (every claim of ``league.CLAIMS``; a claim whose arms did not run: not run yet)."""
    import league

    w("## The paper's claims\n")
    w("Each claim is a paired comparison of two arms over the table's seeds at the largest budget "
      "(Fig. 9's 'converges faster' at the smallest); Holm's correction over the claims; a directional claim is "
      "reproduced when significant in its direction, refuted when significant against it; an 'alike' claim is "
      "reproduced when the 95 % CI of the difference lies inside ± the detectable difference and refuted when the "
      "two differ significantly; a 'does not beat' claim is refuted when the variant beats plain gains significantly "
      "and reproduced when the CI's lower end lies above minus the detectable difference (the variant cannot be "
      "better by that much); otherwise it is not decidable at this power.\n")
    w("| source | claim | arms (better − worse) | budget | difference (95 % CI) | seeds | p (Holm) | verdict |")
    w("|---|---|---|---|---|---|---|---|")
    tests = []
    for c in league.CLAIMS:
        b = _claim_budget(c, budgets)
        if b is None or c.better not in data or c.worse not in data:
            tests.append((c, None, math.nan))
            continue
        tests.append((c, paired_test(data[c.better].get(b, {}), data[c.worse].get(b, {})), b))
    adj = holm([t["p"] if t is not None else math.nan for _, t, _ in tests])
    for (c, t, b), p in zip(tests, adj):
        if t is None:
            w(f"| {c.source} | {c.statement} | {c.better} − {c.worse} | — | — | 0 | — | not run yet |")
            continue
        w(f"| {c.source} | {c.statement} | {c.better} − {c.worse} | {b:,} | {fmt(t['diff'], t['half'])} | {t['n']} | "
          f"{fmt_p(p)} | {claim_verdict(t, p, c.kind, mdd)} |")
    w("")
