"""Per-step gradient coherence of the GRPO policy gradient (which denoising steps carry signal).

    python experiments/grad_coherence.py [--batches 8] [--schemes gain,uniform] [--out DIR] [override ...]

Composes the training config (``conf/train.yaml`` + Hydra overrides, e.g. ``sampler=flow_sde loop.prompts_per_iter=4``),
draws ``--batches`` independent rollout batches with the *initial* weights (iterations 0..N-1 of the group sampler),
and for each credit scheme computes every step's LoRA gradient. Reports, per step, the signal fraction
ρ̂ = mean_{i≠j} g_i·g_j / mean |g_i|² over the batches (``stepflow.coherence``; 0 = pure noise, 1 = every batch points
the same way) and the mean gradient norm; writes ``coherence.json`` and ``coherence.png`` to ``--out``.

What it measured on the shipped shapes base model (why ``conf/recipe/shapes.yaml`` trains only step 0) is in
docs/results.md ("Why only step 0"), with the plot in docs/coherence/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def measure(overrides: list[str], batches: int, schemes: list[str]) -> dict:
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from tqdm.auto import tqdm

    from stepflow.advantage import AdvantageEstimator
    from stepflow.algorithm import trainable_steps
    from stepflow.cli import CONF_DIR
    from stepflow.coherence import signal_fraction, step_gradients
    from stepflow.rollout import estimate_states, rollout, score
    from stepflow.train import build_module

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    module = build_module(cfg, Path("/tmp/stepflow_coherence"))
    lr, lp = module.learner, module.loop
    estimators = {s: AdvantageEstimator(dataclasses.replace(lr.advantage.cfg, scheme=s)) for s in schemes}
    grads: dict[str, list] = {s: [] for s in schemes}
    steps: list[int] = []
    t0 = time.perf_counter()
    for i in tqdm(range(batches), desc="batches"):  # the training loop's phases, on independent batches
        plan = lr.plan.plan(i)
        traj = rollout(lr.policy, plan, lr.sampler, lp.num_steps, lr.guidance)
        x0 = estimate_states(lr.policy, traj, lp.substeps, lr.guidance, lp.adaptive_substeps, lp.estimate_chunk)
        rewards = score(lr.policy, lr.reward, traj, x0, lp.decode_chunk).rewards
        every = dataclasses.replace(lr.train, train_steps=None, timestep_fraction=1.0)
        steps = trainable_steps(every, lr.sampler, traj.times)  # every stochastic step, whatever train_steps says
        for s, est in estimators.items():
            adv = est(rewards, plan.group_ids, lp.num_steps).advantages
            grads[s].append(step_gradients(lr, traj, adv, steps))
    res = {"overrides": overrides, "batches": batches, "samples_per_batch": traj.batch_size, "steps": steps,
           "seconds": time.perf_counter() - t0, "schemes": {}}
    for s, gs in grads.items():
        g = torch.stack(gs)  # (N, S, D)
        res["schemes"][s] = {
            "rho_per_step": [signal_fraction(g[:, j]) for j in range(len(steps))],
            "rho_all_steps": signal_fraction(g.mean(1)),
            "grad_norm_per_step": [float(g[:, j].norm(dim=1).mean()) for j in range(len(steps))],
        }
    return res


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
    ap.add_argument("--out", default="outputs/coherence")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml")
    args = ap.parse_args(argv)
    if args.batches < 2:
        ap.error("--batches: need at least 2 independent batches")
    import torch

    torch.set_num_threads(args.threads)
    res = measure(args.overrides, args.batches, [s.strip() for s in args.schemes.split(",") if s.strip()])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coherence.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "coherence.png")
    for s, r in res["schemes"].items():
        row = " ".join(f"{k}:{v:+.3f}" for k, v in zip(res["steps"], r["rho_per_step"]))
        print(f"{s:8s} rho per step  {row}   (all steps {r['rho_all_steps']:+.3f})")
        print(f"{s:8s} grad norm     " + " ".join(f"{k}:{v:.1e}" for k, v in zip(res["steps"], r["grad_norm_per_step"])))
    print(f"{res['batches']} batches x {res['samples_per_batch']} samples in {res['seconds']:.0f} s -> {out}/coherence.png")
    return res


if __name__ == "__main__":
    main()
