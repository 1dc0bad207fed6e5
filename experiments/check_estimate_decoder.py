#!/usr/bin/env python
"""How well a cheap decoder for the x̂0 estimates (``model.estimate_vae``, a diffusers AutoencoderTiny such as TAESD3
or TAEF1) preserves what the credit reads: the order of the rewards and of the gains within each group.

    python experiments/check_estimate_decoder.py --tiny                  # sd3_tiny with a tiny random AutoencoderTiny
    python experiments/check_estimate_decoder.py model=sd35_medium model.estimate_vae=madebyollin/taesd3 \
        reward=pickscore data=pickscore trainer=gpu --batches 4          # the real check, where the weights are

For ``--batches`` rollouts of the training config, estimates x̂0 at every state, decodes and scores each with the full
VAE and with the estimate decoder, and reports per state k the mean within-group Spearman correlation of R_k (full vs
cheap), per step the same for the gains G_k, the correlation of the resulting advantages, and the seconds each
decoder took. With random tiny weights (``--tiny``) the correlations say nothing about TAESD's quality; the check is
there to run on the real models.

Bad input (an unknown override, a model without an estimate decoder, ``--batches 0``, a failing load) ends in one
line ``stepflow: error: <field>: <what>; <fix>`` and exit status 2, as the entry points (``HYDRA_FULL_ERROR=1``
shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def spearman(a, b) -> float:
    """Spearman's rank correlation of two 1-d tensors (average ranks for ties); nan when either is constant."""
    import torch

    def ranks(x):
        order = torch.argsort(x)
        r = torch.empty_like(x, dtype=torch.float64)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for v in torch.unique(x):  # ties: average rank
            m = x == v
            r[m] = r[m].mean()
        return r

    ra, rb = ranks(a.double()), ranks(b.double())
    if float(ra.std()) == 0 or float(rb.std()) == 0:
        return float("nan")
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def within_group(x, y, groups) -> float:
    """Mean over groups of the Spearman correlation of x and y inside the group (constant groups left out)."""
    import math

    vals = [spearman(x[groups == g], y[groups == g]) for g in groups.unique()]
    vals = [v for v in vals if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def compose_train(overrides: list[str]):
    """The training config with ``overrides``; a bad override is one line (:func:`stepflow.cli.compose_error`)."""
    from stepflow.cli import compose_error
    from stepflow.config import compose
    from stepflow.errors import StepflowError

    try:
        return compose("train", overrides)
    except Exception as e:  # noqa: BLE001 - ConfigCompositionException, OverrideParseException, ...
        raise StepflowError(compose_error(e)) from None


def _takes_estimate_vae(cfg) -> None:
    from stepflow.errors import StepflowError

    if "estimate_vae" not in cfg.model:
        name = cfg.model.get("name") or cfg.model.get("_target_")
        raise StepflowError(f"model.estimate_vae: model {name} takes no estimate decoder (SD3 / SD3.5 and FLUX.1 "
                            "do); pick one of those models")


def training_config(overrides: list[str]):
    """The composed training config, checked before anything loads: the model takes an estimate decoder (asked
    first without the ``model.estimate_vae`` overrides, so that a model without one says so) and one is set."""
    from stepflow.errors import StepflowError

    est = [o for o in overrides if o.lstrip("+~").startswith("model.estimate_vae=")]
    if est:
        _takes_estimate_vae(compose_train([o for o in overrides if o not in est]))
    cfg = compose_train(overrides)
    _takes_estimate_vae(cfg)
    if not cfg.model.estimate_vae:
        raise StepflowError("model.estimate_vae: not set; set model.estimate_vae=<AutoencoderTiny Hub id or folder> "
                            "(e.g. madebyollin/taesd3), or pass --tiny")
    return cfg


def measure(overrides: list[str], batches: int) -> dict:
    import torch

    from stepflow.core.rollout import estimate_states, rollout, score
    from stepflow.errors import StepflowError
    from stepflow.math.advantage import AdvantageConfig, AdvantageEstimator
    from stepflow.train import build_module

    if batches < 1:
        raise StepflowError(f"--batches: must be >= 1, got {batches}")
    cfg = training_config(overrides)
    module = build_module(cfg, Path("/tmp/stepflow_estimate_decoder"))
    learner, lp, pol = module.learner, module.loop, module.policy
    tiny = pol.estimate_vae
    est = AdvantageEstimator(AdvantageConfig(scheme="gain"))
    rows = {"full": [], "cheap": [], "groups": []}
    secs = {"full": 0.0, "cheap": 0.0}
    for i in range(batches):
        plan = learner.plan.plan(i)
        traj = rollout(pol, plan, learner.sampler, lp.num_steps, learner.guidance)
        x0 = estimate_states(pol, traj, lp.substeps, learner.guidance, lp.adaptive_substeps, lp.estimate_chunk)
        for name in ("full", "cheap"):
            pol.estimate_vae = tiny if name == "cheap" else None
            t0 = time.perf_counter()
            rows[name].append(score(pol, learner.reward, traj, x0, lp.decode_chunk).rewards)
            secs[name] += time.perf_counter() - t0
        pol.estimate_vae = tiny
        rows["groups"].append(plan.group_ids + 1000 * i)
    full, cheap, groups = torch.cat(rows["full"]), torch.cat(rows["cheap"]), torch.cat(rows["groups"])
    t = full.shape[1] - 1
    g_full, g_cheap = full[:, 1:] - full[:, :-1], cheap[:, 1:] - cheap[:, :-1]
    a_full, a_cheap = est(full, groups, t).advantages, est(cheap, groups, t).advantages
    return {"overrides": overrides, "batches": batches, "samples": len(full),
            "reward_rank_corr": [within_group(full[:, k], cheap[:, k], groups) for k in range(t + 1)],
            "gain_rank_corr": [within_group(g_full[:, k], g_cheap[:, k], groups) for k in range(t)],
            "advantage_rank_corr": [within_group(a_full[:, k], a_cheap[:, k], groups) for k in range(t)],
            "decode_and_score_s": secs}


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one :class:`~stepflow.errors.StepflowError` line (not usage + message)."""

    def error(self, message: str):
        from stepflow.errors import StepflowError

        raise StepflowError(f"{message}; see --help")


def main(argv=None) -> dict:
    ap = _Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="sd3_tiny + pickscore_tiny + a tiny random AutoencoderTiny")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    overrides = list(args.overrides)
    if args.tiny:
        from stepflow.testing.tiny_policies import tiny_taesd_dir

        overrides = ["model=sd3_tiny", "reward=pickscore_tiny", f"model.estimate_vae={tiny_taesd_dir()}", *overrides]
    res = measure(overrides, args.batches)
    fmt = lambda xs: " ".join(f"{x:+.2f}" for x in xs)  # noqa: E731
    print(f"within-group Spearman, full VAE vs estimate decoder, {res['samples']} samples:")
    print(f"  rewards R_0..R_T   {fmt(res['reward_rank_corr'])}  (R_T: both decode with the full VAE)")
    print(f"  gains G_0..G_T-1   {fmt(res['gain_rank_corr'])}")
    print(f"  advantages         {fmt(res['advantage_rank_corr'])}")
    print(f"  decode + score: full {res['decode_and_score_s']['full']:.2f} s, cheap {res['decode_and_score_s']['cheap']:.2f} s")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
    return res


def cli(argv=None) -> None:
    """:func:`main` with the entry points' one-line errors (``HYDRA_FULL_ERROR=1``: the traceback)."""
    from stepflow.cli import debugging, report

    try:
        main(argv)
    except Exception as e:  # noqa: BLE001 - every error is one line unless debugging
        if debugging():
            raise
        report(e)


if __name__ == "__main__":
    cli()
