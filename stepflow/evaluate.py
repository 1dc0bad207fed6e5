"""``python -m stepflow.evaluate [model=shapes] [key=value ...]``: strict GenEval of a (LoRA-adapted) model.

Samples every prompt of ``prompt_file`` (default: the embedded world's evaluation prompts) ``num_per_prompt`` times
with the deterministic Euler ODE (``sampler.num_steps`` steps, CFG ``sampler.guidance`` (null = the model's ``eval_guidance``), initial noise from
``seed``), scores them with the strict shapes-GenEval judge, prints the per-category table and writes to its Hydra
run dir: ``eval.json`` (``geneval`` + ``geneval_<category>``), ``samples.json`` (per-sample prompt, category and
strict/partial scores, plus the settings) and one PNG grid per category (``samples_<category>.png``).

Examples::

    python -m stepflow.evaluate                                   # the shipped base model
    python -m stepflow.evaluate lora_path=outputs/train/<run>/lora
    python -m stepflow.evaluate ckpt_path=outputs/pretrain/<run>/selected max_prompts=60 sampler.num_steps=20
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from stepflow.cli import check_finite, entry_point
from stepflow.config import EvaluateConfig, to_config
from stepflow.errors import StepflowError

log = logging.getLogger("stepflow.evaluate")


def settings(cfg: DictConfig | EvaluateConfig) -> EvaluateConfig:
    """The composed ``conf/evaluate.yaml`` as its typed :class:`~stepflow.config.EvaluateConfig`, every field
    checked (a one-line StepflowError naming it: ``sampler.num_steps: must be an integer >= 1, got 0``), before the
    model loads (minutes for a large one); inf / nan in any field, ``model.*`` included, are refused first."""
    if isinstance(cfg, EvaluateConfig):
        return cfg
    check_finite(cfg)
    return to_config(cfg, EvaluateConfig)


def load_policy(cfg: DictConfig | EvaluateConfig):
    """The model of ``cfg.model`` (``ckpt_path`` replaces its weights), with the LoRA of ``lora_path`` if given."""
    from stepflow.cli import instantiate

    cfg = settings(cfg)
    mcfg = dict(cfg.model or {})
    ckpt = cfg.ckpt_path
    if ckpt:
        p = Path(str(ckpt)).expanduser()
        if not p.exists():
            raise StepflowError(f"ckpt_path: {p} does not exist")
        if p.is_file() and p.suffix == ".ckpt":
            policy = load_pretrain_checkpoint(p)
        elif p.is_dir():
            if "path" not in mcfg:
                raise StepflowError(f"ckpt_path: model {mcfg.get('_target_')} takes no path; use model.<field>")
            mcfg["path"] = str(p)
            policy = instantiate(mcfg, "model")
        else:
            raise StepflowError(f"ckpt_path: {p} is neither a model directory nor a pretraining .ckpt file")
    else:
        policy = instantiate(mcfg, "model")
    lora = cfg.lora_path
    if lora:
        p = Path(str(lora)).expanduser()
        if not p.exists():
            raise StepflowError(f"lora_path: {p} does not exist")
        try:
            policy.load_lora(p)
        except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise StepflowError(msg if msg.startswith("lora_path") else f"lora_path: {p}: {msg}") from None
        log.info("loaded LoRA %s (%d adapted modules)", p, sum(1 for _ in policy.lora_parameters()) // 2)
    return policy.eval().requires_grad_(False)


def load_pretrain_checkpoint(path: str | Path, ema: bool = True):
    """A :class:`ShapesPolicy` from a ``stepflow.pretrain`` Lightning checkpoint (EMA weights by default)."""
    from stepflow.policies.shapes import ShapesPolicy
    from stepflow.shell.checkpoint import safe_load

    ck = safe_load(path, "ckpt_path")
    hp = ck.get("hyper_parameters", {})
    if "arch" not in hp:
        raise StepflowError(f"ckpt_path: {path} is not a stepflow.pretrain checkpoint (no 'arch' hyper-parameters)")
    policy = ShapesPolicy.build(vocab=hp.get("vocab"), max_length=hp.get("max_length"), **hp["arch"])
    pre = "ema." if ema else "policy."
    policy.load_state_dict({k[len(pre):]: v for k, v in ck["state_dict"].items() if k.startswith(pre)})
    return policy


def load_records(cfg: DictConfig | EvaluateConfig) -> list[dict[str, Any]]:
    """Prompt records of ``prompt_file`` (a .jsonl/.txt path, ``pkg://`` path, or the split names train/eval)."""
    from stepflow.core.data import load_prompt_file
    from stepflow.shapes import load_prompts, parse_prompt

    pf = settings(cfg).prompt_file
    if pf in (None, "", "eval", "train"):
        recs = load_prompts(pf or "eval")
    else:
        recs = load_prompt_file(str(pf), "prompt_file")
    out = []
    for r in recs:
        r = dict(r)
        if "category" not in r:
            try:
                r["category"] = parse_prompt(r["prompt"]).category
            except ValueError as e:
                raise StepflowError(f"prompt_file: {pf}: {e}") from None
        out.append(r)
    return out


def evaluate(cfg: DictConfig | EvaluateConfig, out_dir: str | Path) -> dict[str, float]:
    """Run the evaluation described by ``cfg`` and write its outputs to ``out_dir``; returns the table."""
    from stepflow.core.heldout import evaluate_geneval, format_table, save_category_grids
    from stepflow.rewards.shapes_geneval import judge_batch
    from stepflow.rundir import writable_dir

    cfg = settings(cfg)  # every setting checked before anything is written or loaded
    out = writable_dir(out_dir, "out_dir")
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    s = cfg.sampler
    records = load_records(cfg)
    policy = load_policy(cfg)
    t0 = time.perf_counter()
    guidance = float(s.guidance if s.guidance is not None else getattr(policy, "eval_guidance", 1.0))
    table, images, recs = evaluate_geneval(policy, records, num_steps=s.num_steps, guidance=guidance,
                                           seed=cfg.seed, num_per_prompt=cfg.num_per_prompt,
                                           max_prompts=cfg.max_prompts, batch_size=cfg.batch_size)
    elapsed = time.perf_counter() - t0
    prompts = [r["prompt"] for r in recs]
    results = judge_batch(images, prompts)
    (out / "eval.json").write_text(json.dumps(table, indent=1) + "\n")
    samples = [{"prompt": r["prompt"], "category": r.get("category"), "strict": bool(j.strict),
                "partial": round(float(j.partial), 4)} for r, j in zip(recs, results)]
    (out / "samples.json").write_text(json.dumps({
        "settings": {"model": cfg.model, "ckpt_path": cfg.ckpt_path, "lora_path": cfg.lora_path,
                     "prompt_file": cfg.prompt_file, "num_steps": s.num_steps, "guidance": guidance,
                     "seed": cfg.seed, "num_per_prompt": cfg.num_per_prompt, "num_samples": len(recs),
                     "sampling_and_scoring_s": round(elapsed, 2)},
        "samples": samples}, indent=1) + "\n")
    g = cfg.grid
    if g.per_category > 0:
        save_category_grids(images, recs, out, per_category=g.per_category, ncol=g.ncol,
                            scores=[float(j.strict) for j in results])
    print(f"strict GenEval, {len(recs)} samples, {s.num_steps} ODE steps, guidance {guidance:g}, seed {cfg.seed}:")
    print(format_table(table))
    print(f"wrote {out / 'eval.json'}")
    return table


@entry_point("evaluate")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    s = settings(cfg)
    evaluate(s, s.out_dir or HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
