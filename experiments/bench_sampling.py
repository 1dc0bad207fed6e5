"""Benchmark: sampling 64 images with the 10-step Euler ODE from the shipped shapes base model (CPU).

    python experiments/bench_sampling.py [--n 64] [--steps 10] [--guidance 1.0] [--repeats 7] [--threads N]

Prints the median wall time over ``--repeats`` runs (after one warm-up) and the number of function evaluations
(NFE = steps, x2 with CFG: one batched transformer call per step). Torch threads: torch's default unless --threads.
Run it on an idle machine or with ``--threads 1``: with another busy process, two OpenMP threads per process are
much slower than one. Measured times: the shapes base model's card (stepflow/assets/shapes_base/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--guidance", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--path", default=None, help="model dir (default: the shipped stepflow/assets/shapes_base)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from stepflow.core.heldout import sample_ode
    from stepflow.policies.shapes import ShapesPolicy
    from stepflow.shapes import load_prompts

    policy = ShapesPolicy.from_pretrained(args.path).eval()
    recs = load_prompts("eval")
    prompts = [recs[i % len(recs)]["prompt"] for i in range(args.n)]
    sample_ode(policy, prompts, num_steps=args.steps, guidance=args.guidance, seed=0, batch_size=args.n)  # warm-up
    times = []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        sample_ode(policy, prompts, num_steps=args.steps, guidance=args.guidance, seed=r, batch_size=args.n)
        times.append(time.perf_counter() - t0)
    nfe = args.steps * (2 if args.guidance != 1.0 else 1)
    res = {"images": args.n, "steps": args.steps, "guidance": args.guidance, "nfe": nfe,
           "threads": torch.get_num_threads(), "median_s": statistics.median(times), "min_s": min(times),
           "max_s": max(times)}
    print(f"sampling {args.n} images x {args.steps} steps (guidance {args.guidance:g}, NFE {nfe} batched calls, "
          f"{res['threads']} torch threads): median {res['median_s']:.3f} s over {args.repeats} runs "
          f"(min {res['min_s']:.3f}, max {res['max_s']:.3f}); {res['median_s'] / nfe * 1000:.1f} ms per NFE")
    return res


if __name__ == "__main__":
    main()
