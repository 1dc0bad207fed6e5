"""The league's report: ``docs/league/`` from the runs of experiments/league.py.

    python experiments/league.py --report        # rewrite docs/league/ from outputs/league/

Writes ``results.csv`` (one row per method, seed and budget point), ``lr_grid.csv``, ``report.md`` (tables of mean
± 95 % CI per method and budget and per GenEval category, paired comparisons with Holm's correction, the minimum
detectable difference at 80 % power, the cost table and the claims table) and the figures ``curves.png`` (held-out
GenEval against NFEs, seconds and iterations; ``curves_by_method.png`` one panel per method with its exact scenes
and extra objects) and ``samples.png`` (every method's final samples of seed 0 on the
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


def seeds_for(sd: float, target: float = 0.04, alpha: float = ALPHA, power: float = POWER,
              n_max: int = 500) -> int | None:
    """The fewest seeds n >= 2 whose :func:`detectable_difference` at paired standard deviation ``sd`` is at most
    ``target``; None beyond ``n_max`` or without a positive ``sd``."""
    if not sd > 0 or not target > 0:
        return None
    lo, hi = 2, 2
    while detectable_difference(sd, hi, alpha, power) > target:  # grow, then bisect (it falls with n)
        lo, hi = hi + 1, hi * 2
        if hi > n_max:
            return None if detectable_difference(sd, n_max, alpha, power) > target else _bisect(sd, lo, n_max, target,
                                                                                                alpha, power)
    return _bisect(sd, lo, hi, target, alpha, power)


def _bisect(sd, lo, hi, target, alpha, power) -> int:
    while lo < hi:
        mid = (lo + hi) // 2
        if detectable_difference(sd, mid, alpha, power) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def mean_curve(per_budget: dict[int, dict[int, float]]) -> list[tuple[int, float]]:
    """``[(budget point, mean over seeds)]`` in budget order (NaN values left out; a point without a value too)."""
    out = []
    for b in sorted(per_budget):
        vals = [float(v) for v in per_budget[b].values() if not math.isnan(float(v))]
        if vals:
            out.append((int(b), sum(vals) / len(vals)))
    return out


def peak_budget(per_budget: dict[int, dict[int, float]]) -> int | None:
    """The budget point of the largest mean over seeds (:func:`mean_curve`); of equal means the earliest. The same
    rule picks the lr on the grid (league.grid_scores). The mean at a point picked as the largest of several is
    biased upwards (by about the noise of the means): the report shows the end value and the drop beside it."""
    curve = mean_curve(per_budget)
    if not curve:
        return None
    top = max(v for _, v in curve)
    return next(b for b, v in curve if v == top)


def peak_and_end(per_budget: dict[int, dict[int, float]]) -> dict[str, Any]:
    """A method's peak and end: ``{peak_budget, peak: (mean, half, n), end_budget, end: (mean, half, n), drop:
    paired_test(peak − end)}`` over the seeds (95 % CIs, t-distribution); the drop is paired over the seeds that
    have both points (0 with no CI when the peak is the end)."""
    import report

    b = peak_budget(per_budget)
    if b is None:
        nan3 = (math.nan, math.nan, 0)
        return {"peak_budget": None, "peak": nan3, "end_budget": None, "end": nan3, "drop": paired_test({}, {})}
    end = max(k for k, v in per_budget.items() if v)
    return {"peak_budget": b, "peak": report.mean_ci(list(per_budget[b].values())), "end_budget": end,
            "end": report.mean_ci(list(per_budget[end].values())), "drop": paired_test(per_budget[b], per_budget[end])}


def gains_from_extras(gain_geneval: float, gain_exact: float, more_extras: float) -> bool:
    """A method's GenEval gain over the base model comes from extra objects when the gain is positive, the
    exact-scene score gained less than half of it and the mean number of objects not asked for rose."""
    if any(math.isnan(x) for x in (gain_geneval, gain_exact, more_extras)):
        return False
    return gain_geneval > 0 and gain_exact < 0.5 * gain_geneval and more_extras > 0


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


def at_peaks(data: dict[str, dict[int, dict[int, float]]], methods: Sequence[str]) -> dict[str, dict[int, float]]:
    """``{method: {seed: value at the method's own peak}}`` (:func:`peak_budget`)."""
    out = {}
    for m in methods:
        b = peak_budget(data.get(m, {}))
        if b is not None:
            out[m] = data[m][b]
    return out


def comparisons_at_peak(data: dict[str, dict[int, dict[int, float]]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """Every method at its peak against the method of the highest peak at its own (paired over seeds), Holm-adjusted
    over the family."""
    return comparisons_to_leader({m: {0: v} for m, v in at_peaks(data, methods).items()}, 0, methods)


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


def select_protocol(rows: Sequence[dict[str, Any]], budget_of) -> tuple[list[dict[str, Any]], set[str]]:
    """Per method, the rows of runs to its planned budget (``budget_of(method)``; the ``run_budget`` column); a
    method with none keeps the rows of its largest earlier budget and is named in the returned set (measured under
    an earlier protocol: the report marks it †), so that the league stays readable while its runs are redone."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["method"]].append(r)
    out, legacy = [], set()
    for m, rs in by.items():
        want = float(budget_of(m))
        cur = [r for r in rs if abs(_run_budget(r) - want) <= 0.5]
        if not cur:
            top = max(_run_budget(r) for r in rs)
            cur = [r for r in rs if _run_budget(r) == top]
            legacy.add(m)
        out += cur
    return out, legacy


def _run_budget(r: dict[str, Any]) -> float:
    v = r.get("run_budget")
    if v not in (None, "") and not (isinstance(v, float) and math.isnan(v)):
        return float(v)
    return round(float(r["budget"]) / float(r["fraction"]))


def _mean_at(rows: Sequence[dict[str, Any]], m: str, b: int | None, key: str) -> float:
    vals = [float(r[key]) for r in rows if r["method"] == m and b is not None and int(float(r["budget"])) == b
            and r.get(key) not in (None, "") and not math.isnan(float(r[key]))]
    return sum(vals) / len(vals) if vals else math.nan


def _num(v: float, digits: int = 0) -> str:
    return "—" if math.isnan(v) else f"{v:,.{digits}f}"


def peak_rows(rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """Per method (best peak first): its peak and end (:func:`peak_and_end`), the NFEs, training seconds and
    reward-model images actually spent at both (means over seeds), the exact-scene score and objects not asked for
    at both."""
    data = by_method(rows)
    scene = {k: by_method([r for r in rows if r.get(k) not in (None, "") and not math.isnan(float(r[k]))], k)
             for k in ("exact_scene", "extra_objects")}
    out = []
    for m in methods:
        if m not in data:
            continue
        pe = peak_and_end(data[m])
        row = {"method": m, **pe}
        for where in ("peak", "end"):
            b = pe[f"{where}_budget"]
            for k in ("nfe", "seconds", "reward_images"):
                row[f"{where}_{k}"] = _mean_at(rows, m, b, k)
            for k in ("exact_scene", "extra_objects"):
                row[f"{where}_{k}"] = report_mean(scene[k].get(m, {}).get(b, {}))
        row["seeds"] = max((len(v) for v in data[m].values()), default=0)
        out.append(row)
    return sorted(out, key=lambda r: -r["peak"][0] if not math.isnan(r["peak"][0]) else math.inf)


#: ``make train``'s limit and what its run spends outside training (an idle 2-core machine, the default measured to
#: 7,500 NFEs: about 13 s of start-up, about 17 s per held-out evaluation at batch 64), with ``make train``'s four
#: evaluations (before training and at 1/4, 1/2 and all of its budget)
TRAIN_LIMIT_S, TRAIN_START_S, TRAIN_EVAL_S, TRAIN_EVALS = 420.0, 13.0, 17.0, 4


def train_recipes(rows: Sequence[dict[str, Any]], methods: Sequence[str], limit_s: float = TRAIN_LIMIT_S,
                  most: int = 5) -> list[dict[str, Any]]:
    """Candidates for ``make train`` (item 6): every (method, budget point) whose mean training seconds in the league
    (one torch thread, two runs on 2 cores) plus ``make train``'s start-up and evaluations fit in ``limit_s``, best
    mean held-out GenEval first (of equal means the cheaper), at most ``most`` and one per method: ``{method, budget,
    geneval: (mean, half, n), seconds, wall, end, drop}`` where ``drop`` is the paired test of this point minus the
    method's end (what training on to the end of its league budget loses)."""
    import report

    data = by_method(rows)
    best: dict[str, dict[str, Any]] = {}
    for m in methods:
        for b, per_seed in sorted(data.get(m, {}).items()):
            vals = [float(v) for v in per_seed.values() if not math.isnan(float(v))]
            sec = _mean_at(rows, m, b, "seconds")
            if not vals or math.isnan(sec):
                continue
            wall = sec + TRAIN_START_S + TRAIN_EVALS * TRAIN_EVAL_S
            mean = sum(vals) / len(vals)
            if wall > limit_s or (m in best and (best[m]["geneval"][0], -best[m]["wall"]) >= (mean, -wall)):
                continue
            end = max(k for k, v in data[m].items() if v)
            best[m] = {"method": m, "budget": int(b), "geneval": report.mean_ci(vals), "seconds": sec, "wall": wall,
                       "end_budget": end, "end": report.mean_ci(list(data[m][end].values())),
                       "drop": paired_test(per_seed, data[m][end])}
    return sorted(best.values(), key=lambda r: (-r["geneval"][0], r["wall"]))[:most]


def _train_recipe(w, rows, order, dag) -> None:
    w(f"## `make train`'s recipe: the best held-out GenEval within {TRAIN_LIMIT_S / 60:.0f} minutes\n")
    w(f"Each method's best budget point whose training seconds in the league plus `make train`'s start-up "
      f"({TRAIN_START_S:.0f} s) and {TRAIN_EVALS} held-out evaluations ({TRAIN_EVAL_S:.0f} s each, measured on the "
      f"idle 2-core machine) fit in {TRAIN_LIMIT_S:.0f} s; the league's seconds are one torch thread per run with two "
      "runs sharing the 2 cores, so the estimate is for `make train` on 2 idle cores at one thread. The drop is what "
      "training on to the end of the method's league budget loses (paired over seeds). `make train` "
      "(`experiment=league_best`) is the first row, re-measured on the idle machine (docs/results.md).\n")
    cands = train_recipes(rows, order)
    if not cands:
        w("No budget point fits yet.\n")
        return
    w("| method | budget | held-out GenEval | training seconds | estimated wall | end of its budget | drop to the end | "
      "seeds |")
    w("|---|---|---|---|---|---|---|---|")
    for c in cands:
        d = c["drop"]
        drop = "—" if c["budget"] == c["end_budget"] else fmt(d["diff"], d["half"])
        w(f"| {dag(c['method'])} | {c['budget']:,} | {fmt(*c['geneval'][:2])} | {c['seconds']:.0f} | {c['wall']:.0f} | "
          f"{fmt(*c['end'][:2])} at {c['end_budget']:,} | {drop} | {c['geneval'][2]} |")
    w("")


def _drop(p: dict[str, Any]) -> str:
    """The drop from peak to end with its paired CI; "peak at the end" when they are one point."""
    if p["peak_budget"] is not None and p["peak_budget"] == p["end_budget"]:
        return "peak at the end"
    return fmt(p["drop"]["diff"], p["drop"]["half"])


def report_mean(d: dict[int, float]) -> float:
    vals = [float(v) for v in d.values() if not math.isnan(float(v))]
    return sum(vals) / len(vals) if vals else math.nan


def readme_table(rows: Sequence[dict[str, Any]], titles: dict[str, str], methods: Sequence[str],
                 budget_of=None) -> str:
    """The README's first results table, "peak and end": every league method's peak held-out GenEval (mean ± 95 %
    CI over seeds) with the NFEs, training seconds and reward-model images spent to it, its value at the end and the
    drop (paired 95 % CI), and the exact-scene score and extra objects at the peak, best peak first (``rows``:
    results.csv rows, strings or numbers, of the runs to ``budget_of(method)`` where a method has them, else of its
    earlier protocol, marked †: :func:`select_protocol`); then a line naming the ``methods`` without a row."""
    rows = [r for r in rows if r["phase"] == "table" and r["method"] in methods]
    rows, legacy = select_protocol(rows, budget_of) if budget_of is not None else (rows, set())
    if not rows:
        return ""
    out = ["| method | peak GenEval | at NFEs | seconds | reward images | end GenEval | at NFEs | drop peak → end | "
           "exact scene at peak | extra objects at peak | seeds |",
           "|---|" + "---|" * 10]
    for p in peak_rows(rows, methods):
        m = p["method"]
        mark = " †" if m in legacy else ""
        out.append(f"| {titles.get(m, m)} (`{m}`){mark} | {fmt(*p['peak'][:2])} | {_num(p['peak_nfe'])} | "
                   f"{_num(p['peak_seconds'])} | {_num(p['peak_reward_images'])} | {fmt(*p['end'][:2])} | "
                   f"{_num(p['end_nfe'])} | {_drop(p)} | {_num(p['peak_exact_scene'], 3)} | "
                   f"{_num(p['peak_extra_objects'], 2)} | {p['seeds']} |")
    if legacy & {r["method"] for r in rows}:
        budgets = sorted({int(_run_budget(r)) for r in rows if r["method"] in legacy})
        out.append(f"\n† measured under the earlier protocol (runs to {', '.join(f'{b:,}' for b in budgets)} NFEs, lr "
                   "chosen by the early-speed criterion, no exact-scene count): the peak is over its budget points "
                   "only; `make league` redoes these runs to 120,000 NFEs and beyond.")
    waiting = [m for m in methods if m not in {r["method"] for r in rows}]
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
    league.forget_configs()
    all_rows = league.collect(s)
    league.write_csv(all_rows, docs / "results.csv")
    grid_rows = league.collect(s, ("grid",))
    league.write_csv(grid_rows, docs / "lr_grid.csv")
    rows, legacy = select_protocol(all_rows, lambda m: league.method_budget(s, m))
    bases = league.base_scores(s)
    names = {m.name: m for m in (*league.METHODS, *league.CLAIM_ARMS)}
    data = by_method(rows)
    budgets = sorted({int(r["budget"]) for r in rows})
    order = [m for m in (*[x.name for x in league.METHODS], *[x.name for x in league.CLAIM_ARMS]) if m in data]
    league_methods = [m for m in order if m in {x.name for x in league.METHODS}]
    dag = lambda m: f"{m} †" if m in legacy else m  # noqa: E731
    points = ", ".join(f"{f * s.budget:,.0f}" for f in s.fractions)
    L: list[str] = []
    w = L.append
    w("# The league: every method at equal compute on the embedded world\n")
    w(f"Generated by `python experiments/league.py --report` from the runs under `{_rel(s.out)}` "
      f"({len(all_rows)} rows in [results.csv](results.csv)). Protocol: every run trains to a budget of "
      f"{int(s.budget):,} forward-equivalent NFEs (`loop.budget`; a backward pass counts 2, CFG doubles; reward-model "
      f"images are counted beside it) and is evaluated on all 285 held-out GenEval prompts (ODE, 10 steps, the EMA "
      f"weights, the same noises for every run) after the first iteration past each budget point ({points} NFEs); "
      f"the NFEs, training seconds and reward-model images it had actually spent there (at most one iteration more) "
      f"are the `nfe`, `seconds` and `reward_images` columns, and the curves are drawn at them. Every evaluation also "
      f"counts exact scenes (GenEval's rules pass the image and it holds no object the prompt does not ask for) and "
      f"the objects not asked for, per category (`exact_scene*`, `extra_objects*`; not part of GenEval's score nor "
      f"of any training reward). League runs add `{' '.join(league.LEAGUE_OVERRIDES)}`: no final-image rollouts that "
      f"only fed the training-reward log (they spent 11.7 % of the default's 30,000-NFE budget), no evaluation grids "
      f"and evaluation batches of 64 (the same images as 128, in 0.75–0.81× the time on this CPU). Seeds "
      f"{', '.join(map(str, s.seeds))} for every method (the central claim's arms more: see its section); each method's lr chosen on {{lr/3, lr, 3·lr}} to "
      f"{s.grid_budget_fraction:g} of the budget with seeds {', '.join(map(str, s.grid_seeds))} by its *peak* (the "
      f"largest mean held-out GenEval over the grid seeds at one budget point, the criterion of the table below), "
      f"the grid extended by ×3 or ÷3 while the best lr is at an edge, up to {s.grid_extend} times "
      f"([lr_grid.csv](lr_grid.csv)).\n")
    w(f"**Where methods end.** A method's peak is its budget point of largest mean held-out GenEval over seeds (of "
      f"equal means the earliest); its end is its last point; the drop is peak − end, paired over seeds. A method is "
      f"*still rising* when its peak is its last point and the last interval gained at least {s.rise_tol:g}; `make "
      f"league` then doubles its budget (evaluations added at 1.5× and 2× the old budget; each finished run is "
      f"continued from its last checkpoint, the same run as one made to the new budget in one go), at most "
      f"{s.max_extend} times, keeping the decision in `{league.BUDGETS_FILE}` beside this report (`--budget-for name=NFEs` sets one "
      f"by hand). The peak is the largest of several noisy means, so it is biased upwards by about their noise; the "
      f"drop and its CI say whether a method really falls.\n")
    ext = league.extended_budgets(s)
    if ext:
        w("Extended budgets: " + ", ".join(f"{k} {v:,.0f} NFEs" for k, v in sorted(ext.items())) + ".\n")
    if legacy:
        w(f"† {', '.join(sorted(legacy))}: no run of the current protocol yet; shown from the runs of an earlier "
          "protocol (their own budget points and lr; no exact-scene count) until `make league` redoes them.\n")
    if "base" in bases:
        b = bases["base"]
        w(f"Base model: held-out GenEval **{b['geneval']:.3f}** (" + ", ".join(
            f"{c.replace('_', ' ')} {b[c]:.2f}" for c in league.CATEGORIES) + ")"
          + (f"; exact scenes {b['exact_scene']:.3f}, objects not asked for {b['extra_objects']:.2f} per image"
             if not math.isnan(b.get("exact_scene", math.nan)) else "")
          + (f"; at CFG 4.5 {bases['base_cfg45']['geneval']:.3f}" if "base_cfg45" in bases else "") + ".\n")

    done = []
    for ph in ("grid", "table", "claims"):
        runs = league.plan(s, [ph], check_config=False)
        if runs:
            done.append(f"{ph} {sum(r.status == 'finished' for r in runs)} of {len(runs)}")
    if done:
        again = "make league-quick" if s.check else "make league"
        w("Runs finished: " + ", ".join(done) + f" (a rerun of `{again}` resumes what is missing).\n")
    spent = league_cost(s, [*grid_rows, *all_rows])
    if spent:
        est = sum(v["estimated"] for v in spent.values())
        hours = sum(v["hours"] for v in spent.values())
        w("What the league cost (each run one torch thread; the wall time of each run in `runs.jsonl`): " + "; ".join(
            f"{ph} {v['runs']} runs, {v['hours']:.1f} run-hours" for ph, v in spent.items())
          + f"; in all {hours:.1f} run-hours, {hours / 2:.1f} hours at `--jobs 2` on 2 cores"
          + (f" ({est} runs finished before `runs.jsonl` recorded them: their wall time estimated from their "
             "training seconds times the median ratio of wall to training seconds of the recorded runs)" if est else "")
          + ".\n")
    plan_cost = planned_cost(s, all_rows)
    if plan_cost:
        tot = sum(v["hours"] for v in plan_cost.values())
        left = sum(v["left_hours"] for v in plan_cost.values())
        w("What the whole league costs at this protocol (every planned run: its budget times its method's measured "
          "training seconds per NFE, the median over its finished runs (else the 2-core table in experiments/league.py), "
          f"plus the start-up and each held-out evaluation, {league.START_NFE:,.0f} and {league.EVAL_NFE:,.0f} NFEs "
          "of the default's training, as measured in one short run): " + "; ".join(f"{ph} {v['runs']} runs, {v['hours']:.0f} run-hours" for ph, v in plan_cost.items())
          + f"; in all {tot:.0f} run-hours ({tot / 2:.0f} hours at `--jobs 2` on 2 cores), of which {left:.0f} "
          "run-hours are still to run.\n")
    w("Where a run's time goes (the default to 7,500 NFEs with evaluations at 3,750 and 7,500, alone on the idle 2-core "
      "machine: 92 s of wall time): 40 s of training, about 13 s of start-up (imports, the model, the judge) and about "
      "17 s for each held-out evaluation (285 prompts at batch 64); at 120,000 NFEs the start-up and six evaluations "
      "are about 15 % of a run. `torch.compile` of the transformer (`loop.compile=inductor`) made the same run's "
      "training 5.4x slower on the CPU (40 -> 214 s: rollouts, estimates, the update and the evaluation each call the "
      "model at other batch shapes, and each new shape compiles again), so league runs stay eager.\n")

    # ---- peak and end
    w("## Peak and end: held-out GenEval, mean ± 95 % confidence interval over seeds\n")
    w("| method | peak | at NFEs | seconds | reward images | end | at NFEs | seconds | reward images | drop peak → end | "
      "exact scene (peak → end) | extra objects (peak → end) | seeds | lr |")
    w("|---|" + "---|" * 13)
    lrs = {r["method"]: r["lr"] for r in rows}
    for p in peak_rows(rows, order):
        m = p["method"]
        w(f"| {dag(m)} | {fmt(*p['peak'][:2])} | {_num(p['peak_nfe'])} | {_num(p['peak_seconds'])} | "
          f"{_num(p['peak_reward_images'])} | {fmt(*p['end'][:2])} | {_num(p['end_nfe'])} | {_num(p['end_seconds'])} | "
          f"{_num(p['end_reward_images'])} | {_drop(p)} | {_num(p['peak_exact_scene'], 3)} → "
          f"{_num(p['end_exact_scene'], 3)} | {_num(p['peak_extra_objects'], 2)} → {_num(p['end_extra_objects'], 2)} | "
          f"{p['seeds']} | {lrs.get(m, '')} |")
    w("\nNFEs, seconds (training, 2 runs on 2 cores) and reward-model images are the means over seeds of what the "
      "runs had spent at the evaluation.\n")

    _train_recipe(w, rows, league_methods, dag)

    # ---- every budget point
    w("## Held-out GenEval at each budget point, mean ± 95 % CI over seeds\n")
    w("| method | " + " | ".join(f"{b:,} NFEs" for b in budgets) + " | NFEs at the end | seconds | reward images "
      "| seeds | lr |")
    w("|---|" + "---|" * (len(budgets) + 5))
    for m in order:
        cells = [fmt(*report.mean_ci(list(data[m].get(b, {}).values()))[:2]) for b in budgets]
        end = max(k for k, v in data[m].items() if v)
        nseeds = max((len(v) for v in data[m].values()), default=0)
        w(f"| {dag(m)} ({names[m].title}) | " + " | ".join(cells) + f" | {_num(_mean_at(rows, m, end, 'nfe'))} | "
          f"{_num(_mean_at(rows, m, end, 'seconds'))} | {_num(_mean_at(rows, m, end, 'reward_images'))} | {nseeds} | "
          f"{lrs.get(m, '')} |")
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
        need = seeds_for(sd_med, 0.04)
        w(f"**Minimum detectable difference** (paired t-test over {n_seeds} seeds, two-sided α = {ALPHA}, power "
          f"{POWER:.0%}): **{mdd:.3f}** GenEval at the median standard deviation of the paired differences "
          f"({sd_med:.3f}, over every comparison below); a difference smaller than this is one the league cannot be "
          f"expected to see; {need if need else 'more than 500'} seeds would bring it to 0.04. With Holm's correction "
          f"over a family of m comparisons the detectable difference is larger (α/m for the smallest p).\n")
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
    w("## Paired comparisons with the leader, at each method's peak and at each budget (Holm-adjusted over the "
      "methods)\n")
    comp = comparisons_at_peak(data, league_methods)
    if comp:
        peaks = {m: peak_budget(data[m]) for m in league_methods if m in data}
        w(f"**At each method's peak** (leader: {comp[0]['leader']}, peak at {peaks[comp[0]['leader']]:,} NFEs)\n")
        w("| method | its peak at | difference to the leader (95 % CI) | seeds | p | p (Holm) |")
        w("|---|---|---|---|---|---|")
        for r in comp:
            w(f"| {dag(r['method'])} | {peaks[r['method']]:,} | {fmt(-r['diff'], r['half'])} | {r['n']} | "
              f"{fmt_p(r['p'])} | {fmt_p(r['p_holm'])} |")
        w("")
    for b in budgets:
        comp = comparisons_to_leader(data, b, league_methods)
        if not comp:
            continue
        w(f"**{b:,} NFEs** (leader: {comp[0]['leader']})\n")
        w("| method | difference to the leader (95 % CI) | seeds | p | p (Holm) |")
        w("|---|---|---|---|---|")
        for r in comp:
            w(f"| {dag(r['method'])} | {fmt(-r['diff'], r['half'])} | {r['n']} | {fmt_p(r['p'])} | "
              f"{fmt_p(r['p_holm'])} |")
        w("")

    # ---- reward hacking
    _hacking(w, rows, order, bases, legacy)

    # ---- the lr grid
    if s.grid:
        from stepflow.config import composer

        w(f"## Learning rates (the grid: seeds {', '.join(map(str, s.grid_seeds))}, {int(s.grid_budget):,} NFEs; "
          "each lr's peak: the largest mean held-out GenEval over the grid seeds at one budget point)\n")
        w("| method | config's lr | grid (lr: peak held-out GenEval) | chosen |")
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
                pick = (lr + (" (edge)" if "edge" in why else "")) if why.startswith("grid") else "— (grid unfinished)"
                w(f"| {m.name} | {league.lr_str(lr0)} | {cells} | {pick} |")
        w("\nAn lr chosen at the grid's edge after every extension is marked (edge): the grid did not find an "
          "interior best there (e.g. a method whose every lr stays at the base model's score).\n")

    # ---- per category
    if budgets:
        w("## Per GenEval category at each method's peak (mean over seeds)\n")
        w("| method | " + " | ".join(c.replace("_", " ") for c in league.CATEGORIES) + " |")
        w("|---|" + "---|" * len(league.CATEGORIES))
        if "base" in bases:
            w("| base | " + " | ".join(f"{bases['base'][c]:.2f}" for c in league.CATEGORIES) + " |")
        for m in order:
            b = peak_budget(data[m])
            w(f"| {dag(m)} | " + " | ".join(_num(_mean_at(rows, m, b, c), 2) for c in league.CATEGORIES) + " |")
        w("")

    # ---- cost table
    cost = cost_table(s, order)
    if cost:
        w("## What an iteration costs (medians over the table's runs)\n")
        w("| method | fwd-equiv NFEs / it. | of them backward passes (NFE) | reward images / it. | s / it. | "
          "iterations to the end | training s per run |")
        w("|---|---|---|---|---|---|---|")
        for m in order:
            if m in cost:
                c = cost[m]
                w(f"| {m} | {c['nfe']:,.0f} | {c['backward']:,.0f} | {c['images']:,.0f} | {c['s_it']:.2f} | "
                  f"{c['iterations']:.0f} | {c['seconds']:.0f} |")
        w("\nSeconds are those of the 2-core machine running two runs at once (and at times other work): "
          "compare them as ratios, not as absolute times.\n")

    # ---- fairness: seed pairing, the paper's recipe decomposed
    _fairness(w, s, rows, data, order)

    # ---- claims
    if not s.claims:
        w("## The paper's claims\n\nNot tested here (their arms run in `make league`).\n")
    else:
        _central(w, s, data, n_seeds)
        _claims(w, data, budgets, mdd)

    # ---- figures
    if plot_curves(s, order, docs / "curves.png", rows):
        w("## Curves\n\n![held-out GenEval, exact scenes and objects not asked for against forward-equivalent NFEs and "
          "training seconds: mean over seeds with a 95 % band](curves.png)\n")
    if plot_methods(s, order, docs / "curves_by_method.png", rows):
        w("Each method alone: GenEval beside the exact-scene score and the objects not asked for, so that a gain made "
          "of extra objects shows as GenEval rising while exact scenes fall.\n\n![one panel per method: held-out "
          "GenEval, exact scenes and objects not asked for against NFEs](curves_by_method.png)\n")
    if plot_samples(s, league_methods, docs / "samples.png"):
        w("## Samples\n\nSeed 0 of every method at the end of its budget (the EMA adapter it saved), on the same 12 "
          "held-out prompts (two per GenEval category) with the same initial noises; a green frame: GenEval's rules "
          "pass the image, red: they do not.\n\n![every method's samples on the same held-out prompts](samples.png)\n")
    md = docs / "report.md"
    md.write_text("\n".join(L) + "\n")
    if readme is not None:
        every = [m.name for m in league.METHODS]
        update_readme(readme, readme_table(all_rows, {m: names[m].title for m in every}, every,
                                           lambda m: league.method_budget(s, m)))
    return md


def _hacking(w, rows, order, bases, legacy) -> None:
    """Reward hacking made visible: per method at its peak and end, GenEval beside exact scenes and extra objects,
    the gains over the base model, and whether the GenEval gain comes from extras (:func:`gains_from_extras`)."""
    scene = [r for r in rows if not math.isnan(float(r.get("exact_scene", math.nan) or math.nan))]
    if not scene:
        w("## Reward hacking: exact scenes and objects not asked for\n\nNo evaluation with exact-scene counts yet "
          "(the runs of the current protocol record them).\n")
        return
    base = bases.get("base", {})
    b_g, b_x, b_e = (base.get(k, math.nan) for k in ("geneval", "exact_scene", "extra_objects"))
    w("## Reward hacking: exact scenes and objects not asked for\n")
    w("GenEval's single-object, two-object, colour and position rules accept objects beyond the asked ones (only "
      "counting excludes them). An *exact scene* passes GenEval's rules and holds no other object; *extra objects* "
      "is the mean number of detections beyond the asked counts. A method's gain over the base model **comes from "
      "extras** when its exact-scene score gained less than half of its GenEval gain while its extra objects rose. "
      + (f"Base model: GenEval {b_g:.3f}, exact scenes {b_x:.3f}, extra objects {b_e:.2f}." if not math.isnan(b_x)
         else "The base model's exact-scene count is not measured yet (its run predates it).") + "\n")
    w("| method | GenEval peak → end | exact scene peak → end | extra objects peak → end | GenEval gain at peak | "
      "exact-scene gain | gains from extras? |")
    w("|---|---|---|---|---|---|---|")
    from_extras = []
    for p in peak_rows(rows, order):
        m = p["method"]
        if math.isnan(p["peak_exact_scene"]):
            continue
        gg, gx, ge = p["peak"][0] - b_g, p["peak_exact_scene"] - b_x, p["peak_extra_objects"] - b_e
        verdict = "—" if math.isnan(gx) else ("**yes**" if gains_from_extras(gg, gx, ge) else "no")
        if verdict == "**yes**":
            from_extras.append(m)
        w(f"| {m}{' †' if m in legacy else ''} | {p['peak'][0]:.3f} → {p['end'][0]:.3f} | "
          f"{p['peak_exact_scene']:.3f} → {p['end_exact_scene']:.3f} | {p['peak_extra_objects']:.2f} → "
          f"{p['end_extra_objects']:.2f} | {_num(gg, 3)} | {_num(gx, 3)} | {verdict} |")
    w("\nMethods whose gains come from extras: " + (", ".join(from_extras) if from_extras else "none") + ".\n")
    w("Per category at each method's peak: extra objects per image (mean over seeds)\n")
    w("| method | " + " | ".join(c.replace("_", " ") for c in _cats()) + " |")
    w("|---|" + "---|" * len(_cats()))
    data = by_method(rows)
    for m in order:
        b = peak_budget(data.get(m, {}))
        vals = [_mean_at(scene, m, b, f"extra_objects_{c}") for c in _cats()]
        if all(math.isnan(v) for v in vals):
            continue
        w(f"| {m} | " + " | ".join(_num(v, 2) for v in vals) + " |")
    w("")


def _cats():
    import league

    return league.CATEGORIES


def _fairness(w, s, rows, data, order) -> None:
    """What the protocol does not equalise: the seed pairing's exceptions and the paper's recipe against the
    default, setting by setting, with its one-change arms at their peaks."""
    import league

    from stepflow.config import composer

    w("## Fairness: what seed s shares, and the paper's recipe decomposed\n")
    with composer() as compose:
        exc = league.pairing_exceptions(compose, [m for m in (*s.methods, *[a.name for a in league.CLAIM_ARMS])
                                                  if m in {x.name for x in (*league.METHODS, *league.CLAIM_ARMS)}])
        diff = league.config_differences(compose, league.method("default"), league.method("paper"))
    w("Seed s gives every method the same prompt order and the same first initial noises, and every evaluation the "
      "same held-out prompts and noises, except where a recipe says otherwise:\n")
    for m, why in exc.items():
        w(f"- `{m}`: " + "; ".join(why))
    w("\nThe paired tests pair these methods with the others by seed all the same: for them the pairing removes "
      "less of the seed's noise, which widens their CIs and does not bias them.\n")
    w("The paper's recipe (`experiment=league/paper`) differs from the default (`python -m stepflow.train`) in:\n")
    w("| setting | default | paper |")
    w("|---|---|---|")
    for k, a, b in diff:
        if "—" not in (a, b):
            w(f"| `{k}` | {a} | {b} |")
    only = [k for k, a, b in diff if "—" in (a, b)]
    if only:
        w("\nSet in one recipe's config only (parameters of components the other does not have, e.g. the credit "
          "variants' or Flow-GRPO's SDE's): " + ", ".join(f"`{k}`" for k in only) + ".")
    w("\nOne-change arms (each with its parent's lr; the difference at each one's peak, paired over seeds):\n")
    w("| arm | parent | the one change | arm − parent at their peaks (95 % CI) | seeds | p |")
    w("|---|---|---|---|---|---|")
    peaks = at_peaks(data, order)
    for c in league.DECOMPOSITION:
        if c.arm in peaks and c.parent in peaks:
            t = paired_test(peaks[c.arm], peaks[c.parent])
            w(f"| {c.arm} | {c.parent} | {c.what} | {fmt(t['diff'], t['half'])} | {t['n']} | {fmt_p(t['p'])} |")
        else:
            w(f"| {c.arm} | {c.parent} | {c.what} | not run yet | 0 | — |")
    w("")


#: the paper's central claim, at each method's peak: gains against uniform credit at matched recipes, and against
#: Flow-GRPO (better, worse, what is matched)
CENTRAL = (
    ("allsteps", "uniform_guard", "gains vs uniform credit, every step (same DDIM SDE, same guard weighting)"),
    ("default", "default_uniform", "gains vs uniform credit, step 0 (same DDIM SDE)"),
    ("paper", "flow_grpo", "the paper's recipe vs Flow-GRPO"),
    ("allsteps", "flow_grpo", "gains at every step vs Flow-GRPO"),
    ("default", "flow_grpo", "gains at step 0 vs Flow-GRPO"),
)


def _central(w, s, data, n_seeds: int, target: float = 0.04) -> None:
    """The central claim with its power: each comparison of :data:`CENTRAL` at both methods' peaks, the minimum
    detectable difference at the seeds measured (from the measured paired sd) and the seeds that bring it to
    ``target``; Holm over the family."""
    import league

    w("## The central claim at each method's peak, with its power\n")
    more = league.power_seeds(s)
    w(f"The arms of these comparisons get more seeds than the table's {n_seeds} until the detectable difference at "
      f"their measured paired sd is at most {target} (at most {s.max_seeds} seeds; `make league` decides it once both "
      f"arms have finished, runs the seeds and measures again, keeping the counts in `{league.SEEDS_FILE}` beside "
      "this report): " + (", ".join(f"{k} {v} seeds" for k, v in sorted(more.items())) if more else
                          "none given more yet") + ". The seed count is chosen from the spread of the differences, never from their mean (an internal-pilot "
      "design), so the t-test's level holds up to a small excess at pilots of 5 seeds.\n")
    w(f"Each row pairs the two methods' values at their own peaks over the seeds both have; the detectable "
      f"difference is that of a paired t-test (α = {ALPHA}, power {POWER:.0%}) at the measured sd of the paired "
      f"differences and the seeds measured; 'seeds for ≤ {target}' is the count that would bring it to {target}. "
      "Verdict: reproduced (Holm-adjusted p < α, in the claimed direction), refuted (significant against it), or not "
      "decidable, with the seeds that would decide it.\n")
    w(f"| claim | better − worse | peaks at | difference (95 % CI) | seeds | paired sd | detectable difference | "
      f"seeds for ≤ {target} | p (Holm) | verdict |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    tests = []
    for a, b, what in CENTRAL:
        pa, pb = peak_budget(data.get(a, {})), peak_budget(data.get(b, {}))
        t = paired_test(data[a][pa], data[b][pb]) if pa is not None and pb is not None else None
        tests.append((a, b, what, pa, pb, t))
    adj = holm([t["p"] if t is not None else math.nan for *_, t in tests])
    for (a, b, what, pa, pb, t), p in zip(tests, adj):
        if t is None:
            w(f"| {what} | {a} − {b} | — | — | 0 | — | — | — | — | not run yet |")
            continue
        sd = t.get("sd", math.nan)
        mdd = detectable_difference(sd, t["n"]) if t["n"] >= 2 and sd > 0 else math.nan
        need = seeds_for(sd, target) if sd > 0 else None
        verdict = claim_verdict(t, p, "better", mdd)
        if verdict.startswith("not decidable") and need and need > t["n"]:
            verdict += f" ({need} seeds would bring the detectable difference to {target})"
        elif verdict.startswith("not decidable") and need:
            verdict = (f"not significant, at 80 % power for a difference of {mdd:.3f} (<= {target}): no gain that "
                       "large is supported")
        w(f"| {what} | {a} − {b} | {pa:,} / {pb:,} | {fmt(t['diff'], t['half'])} | {t['n']} | {_num(sd, 3)} | "
          f"{_num(mdd, 3)} | {need if need else '—'} | {fmt_p(p)} | {verdict} |")
    w("")


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


def planned_cost(s, rows: Sequence[dict[str, Any]] = ()) -> dict[str, dict[str, float]]:
    """``{phase: {runs, hours, left_hours}}`` of every run the league plans at this protocol (the grid as far as it
    is extended now): a run's seconds are its budget times its method's training seconds per NFE (the median over
    ``rows`` of ``seconds / nfe`` at each run's last point; else :data:`league.MS_PER_NFE`), plus
    :data:`league.START_NFE` and :data:`league.EVAL_NFE` per evaluation at the default's seconds per NFE."""
    import statistics

    import league

    rate: dict[str, list[float]] = defaultdict(list)
    last: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (r["phase"], r["method"], r["seed"], r["lr"])
        if key not in last or float(r["nfe"]) > float(last[key]["nfe"]):
            last[key] = r
    for r in last.values():
        if float(r["nfe"]) > 0 and float(r["seconds"]) > 0:
            rate[r["method"]].append(float(r["seconds"]) / float(r["nfe"]))
    ref = statistics.median(rate["default"]) if rate.get("default") else league.MS_PER_NFE_DEFAULT / 1000.0
    out: dict[str, dict[str, float]] = {}
    for ph in ("base", "grid", "table", "claims"):
        try:
            runs = league.plan(s, [ph], check_config=False)
        except Exception:  # noqa: BLE001 - a recipe that does not compose: no estimate for its phase
            continue
        for r in runs:
            budget = next((float(o.split("=", 1)[1]) for o in r.overrides if o.startswith("loop.budget=")), 0.0)
            n_eval = len(league.planned_fractions(r.overrides)) if budget else 1
            per = statistics.median(rate[r.method.name]) if rate.get(r.method.name) else \
                league.MS_PER_NFE.get(r.method.name, 4.5) / 1000.0
            sec = budget * per + (league.START_NFE + n_eval * league.EVAL_NFE) * ref
            d = out.setdefault(ph, {"runs": 0, "hours": 0.0, "left_hours": 0.0})
            d["runs"] += 1
            d["hours"] += sec / 3600
            if r.status != "finished":
                d["left_hours"] += sec / 3600
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


def _curves(s, m: str, rows: Sequence[dict[str, Any]] | None = None,
            key: str = "geneval") -> dict[int, list[tuple[float, float, float, float]]]:
    """Per seed: [(nfe, seconds, iteration, value of ``key``)] of every evaluation of the method's runs (``rows``:
    :func:`league.collect`'s, read when not given; the ledger's rows of runs measured before the archive count)."""
    import league

    rows = league.collect(s) if rows is None else rows
    out: dict[int, list[tuple[float, float, float, float]]] = defaultdict(list)
    for r in sorted((r for r in rows if r["method"] == m), key=lambda r: (r["seed"], r["fraction"])):
        out[r["seed"]].append((float(r["nfe"]), float(r["seconds"]), float(r["iteration"]),
                               float(r.get(key, math.nan) if r.get(key) not in (None, "") else math.nan)))
    return dict(out)


def band(runs: dict[int, list[tuple[float, ...]]], x: int, y: int = 3) -> list[tuple[float, float, float]]:
    """``[(mean x, mean y, 95 % CI half-width of y)]`` over seeds at each evaluation index that every seed reached
    (x: the NFEs or seconds actually spent there, so the curve sits where the evaluations ran)."""
    import report

    k = min((len(p) for p in runs.values()), default=0)
    out = []
    for e in range(k):
        xs = [p[e][x] for p in runs.values()]
        m, h, _ = report.mean_ci([p[e][y] for p in runs.values()])
        if not math.isnan(m):
            out.append((sum(xs) / len(xs), m, 0.0 if math.isnan(h) else h))
    return out


def plot_curves(s, methods: Sequence[str], path: Path, rows: Sequence[dict[str, Any]] | None = None) -> bool:
    """Held-out GenEval against the NFEs and the training seconds spent, and the exact-scene score and objects not
    asked for against NFEs: per method the mean over seeds with a 95 % band."""
    import league

    rows = league.collect(s) if rows is None else rows
    panels = (("geneval", 0, "held-out GenEval"), ("geneval", 1, "held-out GenEval"),
              ("exact_scene", 0, "exact scenes (GenEval passes, nothing extra)"),
              ("extra_objects", 0, "objects not asked for, per image"))
    series = {m: {k: _curves(s, m, rows, k) for k in ("geneval", "exact_scene", "extra_objects")} for m in methods}
    series = {m: v for m, v in series.items() if v["geneval"]}
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    base = league.base_scores(s).get("base", {})
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    cmap = plt.get_cmap("tab20")
    table = {x.name for x in league.METHODS}
    for i, (m, by_key) in enumerate(series.items()):
        style = "-" if m in table else ":"
        for ax, (key, x, _) in zip(axes.flat, panels):
            pts = band(by_key[key], x)
            if not pts:
                continue
            b0 = base.get(key, math.nan)
            xs, ys, hs = [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]
            if not math.isnan(b0):
                xs, ys, hs = [0.0, *xs], [b0, *ys], [0.0, *hs]
            ax.plot(xs, ys, style, marker="o", ms=3, color=cmap(i % 20), label=m if ax is axes.flat[0] else None)
            ax.fill_between(xs, [y - h for y, h in zip(ys, hs)], [y + h for y, h in zip(ys, hs)], color=cmap(i % 20),
                            alpha=0.12, linewidth=0)
    for ax, (_, x, name) in zip(axes.flat, panels):
        ax.set_xlabel(("forward-equivalent NFEs spent", "training seconds (2 runs on 2 cores)")[x])
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7,
               frameon=False, title="method (dotted: claims arms)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_methods(s, methods: Sequence[str], path: Path, rows: Sequence[dict[str, Any]] | None = None,
                 cols: int = 5) -> bool:
    """One panel per method (the overlay of every method in :func:`plot_curves` is hard to read): held-out GenEval
    (mean over seeds, 95 % band) and the exact-scene score against the NFEs spent, the objects not asked for on the
    right axis, the base model's values as thin lines and the peak marked: where a method's GenEval rises while its
    exact scenes fall and its extras climb, its gain comes from extra objects."""
    import league

    rows = league.collect(s) if rows is None else rows
    series = {m: {k: band(_curves(s, m, rows, k), 0) for k in ("geneval", "exact_scene", "extra_objects")}
              for m in methods}
    series = {m: v for m, v in series.items() if v["geneval"]}
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    base = league.base_scores(s).get("base", {})
    top = max((p[1] for v in series.values() for p in v["extra_objects"]), default=1.0)
    top = max(top, base.get("extra_objects", 0.0) if not math.isnan(base.get("extra_objects", math.nan)) else 0.0)
    hi = min(1.0, max(0.8, *(p[1] + p[2] + 0.02 for v in series.values() for k in ("geneval", "exact_scene")
                             for p in v[k])))  # GenEval and exact scenes share the left axis
    n = len(series)
    rows_n = -(-n // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 2.5 * rows_n), sharex=True, squeeze=False)
    table = {x.name for x in league.METHODS}
    for i, (ax, (m, by)) in enumerate(zip(axes.flat, series.items())):
        for key, colour, style in (("geneval", "tab:blue", "-"), ("exact_scene", "tab:green", "--")):
            pts = by[key]
            if not pts:
                continue
            xs, ys, hs = [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]
            ax.plot(xs, ys, style, marker="o", ms=2.5, color=colour, lw=1.2)
            ax.fill_between(xs, [y - h for y, h in zip(ys, hs)], [y + h for y, h in zip(ys, hs)], color=colour,
                            alpha=0.15, linewidth=0)
            if key in base and not math.isnan(base[key]):
                ax.axhline(base[key], color=colour, lw=0.6, alpha=0.5)
        g = by["geneval"]
        top_at = max(range(len(g)), key=lambda j: g[j][1])
        ax.plot([g[top_at][0]], [g[top_at][1]], "*", color="black", ms=8)
        ax.set_ylim(0, hi)
        ax.set_title(m + ("" if m in table else " (claims arm)"), fontsize=9)
        ax.grid(alpha=0.3)
        tw = ax.twinx()
        ex = by["extra_objects"]
        if ex:
            tw.plot([p[0] for p in ex], [p[1] for p in ex], ":", marker="s", ms=2, color="tab:red", lw=1.2)
        if not math.isnan(base.get("extra_objects", math.nan)):
            tw.axhline(base["extra_objects"], color="tab:red", lw=0.6, alpha=0.5)
        tw.set_ylim(0, 1.1 * top + 1e-9)  # the same scales in every panel: left labels in the first column, right
        tw.tick_params(labelsize=7, colors="tab:red", labelright=i % cols == cols - 1 or i == n - 1)  # in the last
        ax.tick_params(labelsize=7, labelleft=i % cols == 0)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("forward-equivalent NFEs", fontsize=8)
    fig.suptitle("held-out GenEval (blue, band: 95 % over seeds; star: peak), exact scenes (green, dashed) and objects "
                 "not asked for per image (red, dotted, right axis); thin lines: the base model", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
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
    w("Each claim is a paired comparison of two arms over the table's seeds, each arm at its own peak "
      "(Fig. 9's 'converges faster' at the smallest budget); Holm's correction over the claims; a directional claim is "
      "reproduced when significant in its direction, refuted when significant against it; an 'alike' claim is "
      "reproduced when the 95 % CI of the difference lies inside ± the detectable difference and refuted when the "
      "two differ significantly; a 'does not beat' claim is refuted when the variant beats plain gains significantly "
      "and reproduced when the CI's lower end lies above minus the detectable difference (the variant cannot be "
      "better by that much); otherwise it is not decidable at this power.\n")
    w("| source | claim | arms (better − worse) | at NFEs | difference (95 % CI) | seeds | p (Holm) | verdict |")
    w("|---|---|---|---|---|---|---|---|")
    tests = []
    for c in league.CLAIMS:
        b = _claim_budget(c, budgets)
        if b is None or c.better not in data or c.worse not in data:
            tests.append((c, None, math.nan))
            continue
        if c.source != "Fig. 9":  # at each arm's peak
            pa, pb = peak_budget(data[c.better]), peak_budget(data[c.worse])
            tests.append((c, paired_test(data[c.better][pa], data[c.worse][pb]), f"{pa:,} / {pb:,}"))
            continue
        tests.append((c, paired_test(data[c.better].get(b, {}), data[c.worse].get(b, {})), f"{b:,}"))
    adj = holm([t["p"] if t is not None else math.nan for _, t, _ in tests])
    for (c, t, b), p in zip(tests, adj):
        if t is None:
            w(f"| {c.source} | {c.statement} | {c.better} − {c.worse} | — | — | 0 | — | not run yet |")
            continue
        w(f"| {c.source} | {c.statement} | {c.better} − {c.worse} | {b} | {fmt(t['diff'], t['half'])} | {t['n']} | "
          f"{fmt_p(p)} | {claim_verdict(t, p, c.kind, mdd)} |")
    w("")
