"""How good are the cheap stepwise rewards? Tweedie / T′-substep gains against ODE-completion gains on the same states.

    python experiments/credit_quality.py [--batches 2] [--substeps 1,2,5,adaptive] [--lora DIR] [--out DIR]
                                         [override ...]

The paper's method rests on one approximation: the reward of a state X_k is estimated from a cheap x̂0 (Tweedie, or
T′ Euler substeps) instead of completing the state to an image. This measures what the approximation costs in credit
quality. For ``--batches`` rollout batches of the composed training config (Hydra overrides; the rollout sampler and
the grid are the config's), every state X_k of every trajectory is

- estimated with each ``--substeps`` T′ (``adaptive``: ⌈T′·t⌉ with T′ = the config's ``loop.substeps``) and scored:
  R̂_k, gains Ĝ_k = R̂_{k+1} − R̂_k;
- completed by the Euler ODE on the rest of the grid (``stepflow.core.branch.complete``) and scored: R^c_k, gains
  G^c_k = R^c_{k+1} − R^c_k (R^c_T = R_T, the final image's reward).

Per step k it reports the within-group Spearman rank correlation of Ĝ_k with G^c_k (the credit GRPO normalises
within the group, so ranks are what matter), averaged over groups whose completion gains are not all equal, with the
fraction of such groups; and the NFEs of each estimate vs the completions. ``--lora``: a trained adapter (a run's
``lora/`` directory) to measure after training. Writes ``credit_quality.json`` and ``credit_quality.png``.

    python experiments/credit_quality.py --curves docs/credit_quality/source

plots the runs trained with each reward source (``<source>_seed<S>.csv``, a run's metrics.csv) against iterations
and against their cumulative forward-equivalent NFEs: ``curves.png`` in that directory.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def spearman(a, b):
    """Spearman's ρ of two 1-d tensors (average ranks for ties); nan when either is constant."""
    import torch

    def ranks(x):
        order = torch.argsort(x, stable=True)
        r = torch.empty_like(x, dtype=torch.float64)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for v in torch.unique(x):  # ties: the mean rank
            m = x == v
            r[m] = r[m].mean()
        return r

    ra, rb = ranks(a.double()), ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else float("nan")


def group_correlations(est, ref, group_ids):
    """Per step (column) the mean over groups of Spearman(est[g, k], ref[g, k]) over the groups where both vary, and
    the fraction of groups counted. est, ref: (B, S); group_ids: (B,). Returns two lists of length S."""
    import math

    import torch

    means, fracs = [], []
    gids = torch.unique(group_ids)
    for k in range(est.shape[1]):
        vals = [spearman(est[group_ids == g, k], ref[group_ids == g, k]) for g in gids]
        ok = [v for v in vals if not math.isnan(v)]
        means.append(sum(ok) / len(ok) if ok else float("nan"))
        fracs.append(len(ok) / len(vals))
    return means, fracs


def measure(overrides: list[str], batches: int, substeps: list[str], lora: str | None) -> dict:
    import torch
    from tqdm.auto import tqdm

    from stepflow.config import compose
    from stepflow.core.branch import complete
    from stepflow.core.rollout import estimate_states, rollout, score
    from stepflow.train import build_module

    cfg = compose("train", overrides)
    module = build_module(cfg, Path("/tmp/stepflow_credit_quality"))
    lr, lp = module.learner, module.loop
    pol = lr.policy
    if lora:  # the run's adapter into the config's (same lora.rank / alpha as the run that wrote it)
        from stepflow.policies.base import read_lora

        pol.load_lora_state_dict(read_lora(lora)[0])
    t_steps = lp.num_steps
    est_g = {s: [] for s in substeps}
    nfe = {s: 0 for s in substeps}
    comp_g, groups, nfe_comp = [], [], 0
    t0 = time.perf_counter()
    for i in tqdm(range(batches), desc="batches"):
        plan = lr.plan.plan(i)
        traj = rollout(pol, plan, lr.sampler, t_steps, lr.guidance)
        groups.append(plan.group_ids + i * 10_000)
        for s in substeps:
            n0 = pol.nfe
            adaptive = s == "adaptive"
            x0 = estimate_states(pol, traj, lp.substeps if adaptive else int(s), lr.guidance, adaptive,
                                 lp.estimate_chunk)
            nfe[s] += pol.nfe - n0
            r = score(pol, lr.reward, traj, x0, lp.decode_chunk).rewards
            est_g[s].append(r[:, 1:] - r[:, :-1])
        n0 = pol.nfe
        finals = [complete(pol, traj.latents[:, k], traj.times[k], traj.times[k + 1:], traj.cond, lr.guidance)
                  for k in range(t_steps)]
        nfe_comp += pol.nfe - n0
        finals.append(traj.latents[:, -1])
        x0c = torch.stack(finals, 1)  # (B, T+1, ...): the completion of every state; X_T itself last
        rc = score(pol, lr.reward, traj, x0c, lp.decode_chunk).rewards
        comp_g.append(rc[:, 1:] - rc[:, :-1])
    comp = torch.cat(comp_g)
    gid = torch.cat(groups)
    res = {"overrides": overrides, "batches": batches, "samples": len(gid), "num_steps": t_steps,
           "lora": lora, "seconds": time.perf_counter() - t0, "nfe_completion": nfe_comp,
           "completion_gain_abs_per_step": comp.abs().mean(0).tolist(), "estimates": {}}
    for s in substeps:
        g = torch.cat(est_g[s])
        rho, frac = group_correlations(g, comp, gid)
        res["estimates"][s] = {"spearman_per_step": rho, "groups_counted_per_step": frac, "nfe": nfe[s],
                               "gain_abs_per_step": g.abs().mean(0).tolist()}
    return res


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for s, r in res["estimates"].items():
        ax.plot(range(res["num_steps"]), r["spearman_per_step"], marker="o",
                label=f"T′={s if s != 'adaptive' else '⌈T′t⌉'} ({r['nfe'] / max(1, res['nfe_completion']):.2f}× the completions' NFEs)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("step k")
    ax.set_ylabel("within-group Spearman ρ\n(estimate gain vs completion gain)")
    ax.set_ylim(-0.2, 1.0)
    ax.set_title("Credit quality of the x̂0-estimate gains" + (" (trained)" if res.get("lora") else " (base model)"))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_curves(directory: Path) -> dict[str, list[list[tuple[float, float, float]]]]:
    """``<source>_seed<S>.csv`` → {source: [per seed: [(iteration, cumulative forward-equivalent NFEs, held-out
    GenEval) at each evaluation]]}; the NFEs up to an evaluation at iteration i are those of iterations 1..i."""
    import csv

    out: dict[str, list] = {}
    for f in sorted(Path(directory).glob("*_seed*.csv")):
        source = f.stem.rsplit("_seed", 1)[0]
        nfe, pts = 0.0, []
        for r in csv.DictReader(f.open()):
            if r.get("cost/nfe_fwd_equiv") not in (None, ""):
                nfe += float(r["cost/nfe_fwd_equiv"])
            if r.get("eval/geneval") not in (None, ""):
                pts.append((float(r["iteration"]), nfe, float(r["eval/geneval"])))
        if pts:
            out.setdefault(source, []).append(pts)
    return out


def plot_curves(directory: Path) -> Path:
    """Held-out GenEval per seed (thin) and its mean over seeds (thick) against iterations and NFEs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = read_curves(directory)
    if not curves:
        raise SystemExit(f"credit_quality: error: --curves: no <source>_seed<S>.csv with eval/geneval in {directory}")
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6), sharey=True)
    for i, (source, runs) in enumerate(sorted(curves.items())):
        c = f"C{i}"  # matplotlib's colour cycle: every source plotted
        for run in runs:
            for ax, x in zip(axes, (0, 1)):
                ax.plot([p[x] for p in run], [p[2] for p in run], color=c, lw=0.6, alpha=0.5)
        n = min(len(r) for r in runs)  # the evaluations every seed reached
        mean = [sum(r[j][2] for r in runs) / len(runs) for j in range(n)]
        label = {"tweedie": "x̂0 estimates", "completion": "ODE completions"}.get(source, source)
        for ax, x in zip(axes, (0, 1)):
            xs = [sum(r[j][x] for r in runs) / len(runs) for j in range(n)]
            ax.plot(xs, mean, color=c, lw=2, marker="o", label=f"{label} ({len(runs)} seeds)")
    axes[0].set_xlabel("iteration")
    axes[1].set_xlabel("forward-equivalent NFEs (a backward counts 2)")
    axes[0].set_ylabel("held-out GenEval")
    axes[1].ticklabel_format(axis="x", style="sci", scilimits=(3, 3))
    axes[0].legend(fontsize=8)
    fig.suptitle("Stepwise rewards from x̂0 estimates vs ODE completions", fontsize=10)
    fig.tight_layout()
    path = Path(directory) / "curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--substeps", default="1,2,5,adaptive")
    ap.add_argument("--lora", default=None, help="a trained adapter directory (a run's lora/) to load")
    ap.add_argument("--out", default="outputs/credit_quality")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--curves", default=None, help="a directory of <source>_seed<S>.csv runs: plot them, nothing else")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml")
    args = ap.parse_args(argv)
    if args.curves:
        print(plot_curves(Path(args.curves)))
        return {}
    subs = [s.strip() for s in args.substeps.split(",") if s.strip()]
    bad = [s for s in subs if s != "adaptive" and not (s.isdigit() and int(s) >= 1)]
    if bad:
        ap.error(f"--substeps: {bad[0]!r} is neither a positive integer nor 'adaptive'")
    if args.batches < 1:
        ap.error("--batches: must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    res = measure(args.overrides, args.batches, subs, args.lora)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "credit_quality.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "credit_quality.png")
    for s, r in res["estimates"].items():
        row = " ".join(f"{k}:{v:+.2f}" for k, v in enumerate(r["spearman_per_step"]))
        print(f"T'={s:8s} rho per step {row}  (NFEs {r['nfe']} vs completions {res['nfe_completion']})")
    return res


if __name__ == "__main__":
    main()
