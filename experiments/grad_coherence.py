"""Per-step gradient coherence of the GRPO policy gradient (which denoising steps carry signal).

    python experiments/grad_coherence.py [--batches 8] [--schemes gain,uniform] [--weightings none,noise,...]
                                         [--out DIR] [override ...]

Composes the training config (``conf/train.yaml`` + Hydra overrides, e.g. ``sampler=flow_sde loop.prompts_per_iter=4``),
draws ``--batches`` independent rollout batches with the *initial* weights (iterations 0..N-1 of the group sampler),
and for each credit scheme computes every step's LoRA gradient. Reports, per step, the signal fraction
ρ̂ = mean_{i≠j} g_i·g_j / mean |g_i|² over the batches (``stepflow.math.coherence``; 0 = pure noise, 1 = every batch points
the same way) and the mean gradient norm; writes ``coherence.json`` and ``coherence.png`` to ``--out``.

``--weightings`` (``train.weighting`` values) measures, for the first scheme, the update every-step training would
make under each weighting: the per-step gradients weighted as the training loop weighs them (``noise``: σ_k / mean σ;
``gain_var``: the batch's gain variances; ``grad_rms``: the batch's gradient norms; ``guard``: GRPO-Guard's
normalised ratio inside the loss) and averaged over the steps. It reports ρ̂ of that combined update and each step's
share of its squared norm, E|w_k g_k|² / Σ_j E|w_j g_j|², i.e. how much of the update is step k (docs/allsteps/:
a weighting helps when it moves the share towards the steps whose ρ̂ is high); plot ``weightings.png``.

What it measured on the shipped shapes base model (why ``conf/recipe/shapes.yaml`` trains only step 0) is in
docs/results.md ("Why only step 0"), with the plot in docs/coherence/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def weighted_update(g: Tensor, weighting: str, stds: Tensor, gains: Tensor | None) -> tuple[Tensor, Tensor]:
    """One batch's every-step update under ``train.weighting``: g (S, D) the steps' gradients (for ``guard`` already
    those of the guard loss), stds (S,) their noise stds, gains (B, S) or None. Returns (the combined update
    ``Σ_k w_k g_k / S`` (D,), the weights w (S,)), as :func:`stepflow.core.algorithm.update` combines them."""
    import torch

    from stepflow.math.loss import gain_variance_weights, noise_weights, rms_weights

    if weighting == "noise":
        w = noise_weights(stds)
    elif weighting == "gain_var" and gains is not None:
        w = gain_variance_weights(gains)
    elif weighting == "grad_rms":
        w = rms_weights(g.norm(dim=1))
    else:  # none, guard (its change is inside the loss)
        w = torch.ones(g.shape[0])
    return (w[:, None].to(g.dtype) * g).mean(0), w


def measure(overrides: list[str], batches: int, schemes: list[str], weightings: list[str] = ()) -> dict:
    import torch
    from tqdm.auto import tqdm

    from stepflow.config import compose
    from stepflow.core.algorithm import step_gradients, trainable_steps
    from stepflow.core.rollout import estimate_states, rollout, score
    from stepflow.math.advantage import AdvantageConfig
    from stepflow.math.coherence import signal_fraction
    from stepflow.train import build_module

    cfg = compose("train", overrides)
    module = build_module(cfg, Path("/tmp/stepflow_coherence"))
    learner, lp = module.learner, module.loop
    c = learner.advantage  # each scheme with the run's common credit settings
    common = dict(std_scope=c.std_scope, eps=c.eps, adv_clip=c.adv_clip, unbiased_std=c.unbiased_std)
    estimators = {s: AdvantageConfig(scheme=s, **common) for s in schemes}
    grads: dict[str, list] = {s: [] for s in schemes}
    wgrads: dict[str, list] = {w: [] for w in weightings}  # per batch: (update (D,), per-step weighted grads (S, D))
    steps: list[int] = []
    t0 = time.perf_counter()
    for i in tqdm(range(batches), desc="batches"):  # the training loop's phases, on independent batches
        plan = learner.plan.plan(i)
        traj = rollout(learner.policy, plan, learner.sampler, lp.num_steps, learner.guidance)
        x0 = estimate_states(learner.policy, traj, lp.substeps, learner.guidance, lp.adaptive_substeps, lp.estimate_chunk)
        rewards = score(learner.policy, learner.reward, traj, x0, lp.decode_chunk).rewards
        every = dataclasses.replace(learner.train, train_steps=None, timestep_fraction=1.0)
        steps = trainable_steps(every, learner.sampler, traj.times)  # every stochastic step, whatever train_steps says
        outs = {s: est(rewards, plan.group_ids, lp.num_steps) for s, est in estimators.items()}
        for s, out in outs.items():
            grads[s].append(step_gradients(learner, traj, out.advantages, steps))
        if weightings:  # the first scheme's gradients, weighted as the update weighs them
            from stepflow.math.sde import step_std

            out = outs[schemes[0]]
            stds = step_std(learner.sampler, traj.times[:-1], traj.times[1:], t_guard=traj.times[1])[steps]
            gains = out.gains[:, steps] if out.gains is not None else None
            for w in weightings:
                g = grads[schemes[0]][-1]
                if w == "guard":
                    from stepflow.math.weighting import build_weighting

                    plain = learner.weighting
                    learner.weighting = build_weighting("guard")
                    try:
                        g = step_gradients(learner, traj, out.advantages, steps)
                    finally:
                        learner.weighting = plain
                upd, wk = weighted_update(g, w, stds, gains)
                wgrads[w].append((upd, wk[:, None] * g))
    res = {"overrides": overrides, "batches": batches, "samples_per_batch": traj.batch_size, "steps": steps,
           "seconds": time.perf_counter() - t0, "schemes": {}}
    for s, gs in grads.items():
        g = torch.stack(gs)  # (N, S, D)
        res["schemes"][s] = {
            "rho_per_step": [signal_fraction(g[:, j]) for j in range(len(steps))],
            "rho_all_steps": signal_fraction(g.mean(1)),
            "grad_norm_per_step": [float(g[:, j].norm(dim=1).mean()) for j in range(len(steps))],
        }
    if weightings:
        res["weighting_scheme"], res["weightings"] = schemes[0], {}
    for w, items in wgrads.items():
        upd = torch.stack([u for u, _ in items])  # (N, D)
        per = torch.stack([p for _, p in items])  # (N, S, D)
        sq = per.pow(2).sum(-1).mean(0)  # (S,) E|w_k g_k|²
        res["weightings"][w] = {
            "rho_update": signal_fraction(upd),
            "rho_per_step": [signal_fraction(per[:, j]) for j in range(len(steps))],
            "share_per_step": (sq / sq.sum().clamp(min=1e-300)).tolist(),
        }
    return res


def plot_weightings(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, ws = res["steps"], res["weightings"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 1.3]})
    n = len(ws)
    bw = 0.8 / max(n, 1)
    for i, (w, r) in enumerate(ws.items()):
        a1.bar([k + (i - (n - 1) / 2) * bw for k in steps], r["share_per_step"], width=bw, label=w)
    rho = res["schemes"][res["weighting_scheme"]]["rho_per_step"]
    ax2 = a1.twinx()
    ax2.plot(steps, rho, "k.-", label="ρ̂ of the step (unweighted)")
    ax2.set_ylabel("signal fraction ρ̂ of step k")
    a1.set(xlabel="denoising step k", ylabel="share of the update's |·|²",
           title=f"every-step update of '{res['weighting_scheme']}' under each train.weighting")
    a1.legend(fontsize=8, loc="upper center")
    ax2.legend(fontsize=8, loc="upper right")
    a2.bar(list(ws), [r["rho_update"] for r in ws.values()], color=[f"C{i}" for i in range(n)])
    a2.axhline(0, color="k", lw=0.6)
    a2.set(ylabel="ρ̂ of the combined update", title="signal in the update")
    a2.tick_params(axis="x", rotation=45)
    for a in (a1, a2):
        a.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = res["steps"]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    n = len(res["schemes"])
    w = 0.8 / max(n, 1)
    for i, (s, r) in enumerate(res["schemes"].items()):
        ax.bar([k + (i - (n - 1) / 2) * w for k in steps], r["rho_per_step"], width=w,
               label=f"{s} (all steps: {r['rho_all_steps']:.3f})")
    ax.axhline(0, color="k", lw=0.6)
    ax.set(xlabel="denoising step k", ylabel="signal fraction ρ̂",
           title=f"gradient coherence over {res['batches']} batches of {res['samples_per_batch']} samples")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--schemes", default="gain,uniform")
    ap.add_argument("--weightings", default="", help="comma list of train.weighting values (none,noise,guard,"
                    "grad_rms,gain_var) to measure the combined every-step update under")
    ap.add_argument("--out", default="outputs/coherence")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml")
    args = ap.parse_args(argv)
    if args.batches < 2:
        ap.error("--batches: need at least 2 independent batches")
    import torch

    torch.set_num_threads(args.threads)
    from stepflow.math.loss import WEIGHTINGS

    weightings = [w.strip() for w in args.weightings.split(",") if w.strip()]
    bad = [w for w in weightings if w not in WEIGHTINGS]
    if bad:
        ap.error(f"--weightings: unknown {bad}; choose from {', '.join(WEIGHTINGS)}")
    res = measure(args.overrides, args.batches, [s.strip() for s in args.schemes.split(",") if s.strip()], weightings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coherence.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "coherence.png")
    if weightings:
        plot_weightings(res, out / "weightings.png")
    for s, r in res["schemes"].items():
        row = " ".join(f"{k}:{v:+.3f}" for k, v in zip(res["steps"], r["rho_per_step"]))
        print(f"{s:8s} rho per step  {row}   (all steps {r['rho_all_steps']:+.3f})")
        print(f"{s:8s} grad norm     " + " ".join(f"{k}:{v:.1e}" for k, v in zip(res["steps"], r["grad_norm_per_step"])))
    for w, r in res.get("weightings", {}).items():
        share = " ".join(f"{k}:{v:.2f}" for k, v in zip(res["steps"], r["share_per_step"]))
        print(f"{w:8s} update rho {r['rho_update']:+.3f}  share per step {share}")
    print(f"{res['batches']} batches x {res['samples_per_batch']} samples in {res['seconds']:.0f} s -> {out}/coherence.png")
    return res


if __name__ == "__main__":
    main()
