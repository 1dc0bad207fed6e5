"""Pretrain the embedded world's base model: ``python -m stepflow.pretrain [overrides]`` (config: conf/pretrain.yaml).

Objective: rectified flow. For a rendered image ``x0`` (mapped to [-1, 1]), noise ``x1 ~ N(0, I)`` and
``t ~ logit-normal(m, s)`` (SD3's choice; ``uniform`` also available), ``x_t = (1 - t) x0 + t x1`` and the loss is
``|| v_theta(x_t, t, c) - (x1 - x0) ||^2`` (mean over pixels and batch).

Data: an endless stream rendered on the fly. Each example is a prompt from ``stepflow.shapes.sample_prompt`` (all
six categories in equal proportion by default, a fresh random prompt each time, so the model sees every prompt the
world can produce, including the RL evaluation prompts, just as a real base model has seen the concepts GenEval
asks for; train/eval disjointness is a property of the *RL* prompt sets, not of pretraining) and an image
``render(scene_for_prompt(prompt, rng))``. With probability ``data.empty_prompt_prob`` the prompt is replaced by
``""`` so that classifier-free guidance has an unconditional model.

Training: a Lightning ``LightningModule`` + ``Trainer`` on the CPU, AdamW with warm-up and cosine decay, an EMA copy
of the weights. Every ``eval.every_n_steps`` the EMA model samples ``eval.max_prompts`` evaluation prompts with the
10-step Euler ODE (no CFG) and the strict shapes-GenEval judge scores them; the EMA weights are saved as a
candidate (``checkpoints/ema_step<N>/``). At the end the candidates are re-scored on the full evaluation set and the
one whose overall score is closest to ``select.target`` with every category above ``select.min_category`` and the
overall inside ``[select.low, select.high]`` is chosen (``selected/``; ``export=true`` also writes it, with a model
card, to ``stepflow/assets/shapes_base``). Everything goes to the Hydra run dir.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from stepflow.cli import check_finite, entry_point
from stepflow.config import (
    PretrainConfig,
    PretrainEmaConfig,
    PretrainEvalConfig,
    PretrainObjectiveConfig,
    PretrainOptimConfig,
    to_config,
)

log = logging.getLogger("stepflow.pretrain")


# ------------------------------------------------------------------------------------------------------------ data
class ShapesStream(IterableDataset):
    """Endless batches ``(x0 (B, 3, S, S) in [-1, 1], prompts list[str])`` rendered on the fly.

    ``categories``: the categories to draw from (None = all, round-robin so every batch is balanced);
    ``empty_prompt_prob``: probability of replacing a prompt by ``""`` (the image stays, as in CFG training);
    ``start``: the step a resumed run starts from (part of the seed, so resuming does not replay the data).
    """

    def __init__(self, batch_size: int = 64, seed: int = 0, size: int = 32, categories: list[str] | None = None,
                 empty_prompt_prob: float = 0.1, start: int = 0):
        super().__init__()
        self.batch_size, self.seed, self.size, self.start = int(batch_size), int(seed), int(size), int(start)
        self.categories = list(categories) if categories else None
        self.empty_prompt_prob = float(empty_prompt_prob)

    def __iter__(self) -> Iterator[tuple[Tensor, list[str]]]:
        from stepflow import shapes

        info = torch.utils.data.get_worker_info()
        wid = 0 if info is None else info.id
        rng = np.random.default_rng([self.seed, wid] + ([self.start] if self.start else []))
        cats = self.categories or list(shapes.CATEGORIES)
        k = 0
        while True:
            imgs, prompts = [], []
            for _ in range(self.batch_size):
                rec = shapes.sample_prompt(rng, category=cats[k % len(cats)])
                k += 1
                imgs.append(shapes.render(shapes.scene_for_prompt(rec["prompt"], rng, size=self.size), size=self.size))
                prompts.append("" if rng.random() < self.empty_prompt_prob else rec["prompt"])
            x0 = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() * 2.0 - 1.0
            yield x0.contiguous(), prompts


# ------------------------------------------------------------------------------------------------------------ module
def _t_logit_normal(n: int, mean: float, std: float, generator: torch.Generator | None) -> Tensor:
    """sigmoid(N(mean, std)), SD3's training times."""
    return torch.sigmoid(torch.randn(n, generator=generator) * std + mean)


def _t_uniform(n: int, mean: float, std: float, generator: torch.Generator | None) -> Tensor:
    """U(0, 1) training times (``mean`` / ``std`` unused)."""
    return torch.rand(n, generator=generator)


#: :func:`sample_t`'s distributions by ``objective.t_sampling`` name (stepflow.config.T_SAMPLINGS)
_T_SAMPLERS = dict(logit_normal=_t_logit_normal, uniform=_t_uniform)


def sample_t(n: int, kind: str = "logit_normal", mean: float = 0.0, std: float = 1.0,
             generator: torch.Generator | None = None) -> Tensor:
    """Training times in (0, 1): ``logit_normal`` = sigmoid(N(mean, std)) (SD3) or ``uniform``."""
    sampler = _T_SAMPLERS.get(kind) if isinstance(kind, str) else None
    if sampler is None:
        raise ValueError(f"objective.t_sampling: unknown {kind!r}; use logit_normal or uniform")
    return sampler(n, mean, std, generator)


def flow_matching_loss(policy, x0: Tensor, prompts: list[str], t: Tensor, noise: Tensor) -> Tensor:
    """Rectified-flow loss: MSE between ``policy.velocity(x_t, t)`` and ``noise - x0`` with ``x_t = (1-t) x0 + t noise``."""
    tt = t.view(-1, 1, 1, 1)
    xt = (1.0 - tt) * x0 + tt * noise
    v = policy.velocity(xt, t, policy.encode(prompts))
    return torch.nn.functional.mse_loss(v, noise - x0)


class PretrainModule(pl.LightningModule):
    """Rectified-flow pretraining of a :class:`~stepflow.policies.shapes.ShapesPolicy` with an EMA copy and periodic
    strict-GenEval evaluation of the EMA weights.

    The groups come as plain dicts (``dataclasses.asdict`` of :class:`~stepflow.config.PretrainConfig`'s groups):
    they are the checkpoint's hyper-parameters, which load without unpickling any class; the module reads them as
    their typed, checked configs."""

    def __init__(self, arch: dict[str, Any], optim: dict[str, Any], objective: dict[str, Any], ema: dict[str, Any],
                 evaluation: dict[str, Any], max_steps: int, vocab: list[str] | None = None,
                 max_length: int | None = None, out_dir: str | None = None):
        super().__init__()
        from stepflow.policies.shapes import ShapesPolicy

        self.save_hyperparameters()
        self.policy = ShapesPolicy.build(vocab=vocab, max_length=max_length, prefix="arch.", **arch)
        self.ema = copy.deepcopy(self.policy).requires_grad_(False).eval()
        self.optim_cfg: PretrainOptimConfig = to_config(optim, PretrainOptimConfig, "optim")
        self.objective: PretrainObjectiveConfig = to_config(objective, PretrainObjectiveConfig, "objective")
        self.ema_cfg: PretrainEmaConfig = to_config(ema, PretrainEmaConfig, "ema")
        self.eval_cfg: PretrainEvalConfig = to_config(evaluation, PretrainEvalConfig, "eval")
        self.max_steps_total = int(max_steps)
        self.out_dir = Path(out_dir) if out_dir else None
        self.history: list[dict[str, Any]] = []
        self._t0 = None
        #: training seconds before this process (a resumed run), so ``train_time_s`` is cumulative
        self.time_offset = 0.0
        self._eval_records = None

    # ---------------------------------------------------------------- optimisation
    def configure_optimizers(self):
        o = self.optim_cfg
        decay, no_decay = [], []
        for n, p in self.policy.named_parameters():
            (no_decay if p.ndim < 2 or "embed" in n or n.endswith(".pos") else decay).append(p)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=o.lr, betas=tuple(o.betas))
        warm, total, floor = o.warmup_steps, max(1, self.max_steps_total), o.min_lr_ratio

        def lr_lambda(step: int) -> float:
            if step < warm:
                return (step + 1) / max(1, warm)
            prog = min(1.0, (step - warm) / max(1, total - warm))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * prog))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        x0, prompts = batch
        x0 = x0.to(self.device)
        if self._t0 is None:
            self._t0 = time.perf_counter()
        ob = self.objective
        t = sample_t(x0.shape[0], ob.t_sampling, ob.logit_mean, ob.logit_std).to(x0)
        noise = torch.randn_like(x0)
        loss = flow_matching_loss(self.policy, x0, list(prompts), t, noise)
        self.log("train/loss", loss, prog_bar=True, on_step=True, batch_size=x0.shape[0])
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, batch_size=x0.shape[0])
        return loss

    @torch.no_grad()
    def on_train_batch_end(self, outputs, batch, batch_idx):
        # EMA with warm-up (decay ramps up from 0.1 so the average is not stuck at the random init).
        step = self.global_step
        d = min(self.ema_cfg.decay, (1 + step) / (10 + step))
        for pe, p in zip(self.ema.parameters(), self.policy.parameters()):
            pe.lerp_(p.detach(), 1.0 - d)
        for be, b in zip(self.ema.buffers(), self.policy.buffers()):
            be.copy_(b)
        every = self.eval_cfg.every_n_steps
        if every > 0 and step > 0 and step % every == 0:
            self.run_eval(step)

    def on_train_end(self):
        every = self.eval_cfg.every_n_steps
        if every > 0 and (not self.history or self.history[-1]["step"] != self.global_step):
            self.run_eval(self.global_step)

    # ---------------------------------------------------------------- evaluation
    def eval_records(self) -> list[dict[str, Any]]:
        if self._eval_records is None:
            from stepflow.core.heldout import balanced_subset
            from stepflow.shapes import load_prompts

            recs = load_prompts(self.eval_cfg.split)
            self._eval_records = balanced_subset(recs, self.eval_cfg.max_prompts)
        return self._eval_records

    @torch.no_grad()
    def run_eval(self, step: int) -> dict[str, Any]:
        from stepflow.core.heldout import evaluate_geneval, format_table

        t0 = time.perf_counter()
        self.ema.clear_cache()  # the EMA weights moved since the last evaluation
        e = self.eval_cfg
        table, images, recs = evaluate_geneval(self.ema, self.eval_records(), num_steps=e.num_steps,
                                               guidance=float(e.guidance), seed=e.seed)
        self.ema.clear_cache()
        elapsed = time.perf_counter() - (self._t0 or t0) + self.time_offset
        row = {"step": int(step), "train_time_s": round(elapsed, 1), "eval_time_s": round(time.perf_counter() - t0, 2),
               **{k: round(v, 4) for k, v in table.items()}}
        self.history.append(row)
        for k, v in table.items():
            self.log(f"eval/{k}", v, on_step=True, batch_size=1)
        if self.out_dir is not None:
            ck = self.out_dir / "checkpoints" / f"ema_step{step:06d}"
            self.ema.save_pretrained(ck, meta={"step": int(step), "train_time_s": row["train_time_s"], "eval": table})
            row["path"] = str(ck)
            with open(self.out_dir / "evals.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if e.save_grid:
                from stepflow.core.heldout import save_grid

                idx = _first_per_category(recs, e.grid_per_category)
                save_grid(images[idx], [recs[i]["prompt"] for i in idx], self.out_dir / "grids" / f"step{step:06d}.png",
                          ncol=8, title=f"EMA step {step}: geneval {table['geneval']:.3f}")
        log.info("step %d  (%.0fs)  eval on %d prompts:\n%s", step, elapsed, len(recs), format_table(table))
        return row


def _first_per_category(recs, k: int) -> list[int]:
    seen: dict[str, int] = {}
    idx = []
    for i, r in enumerate(recs):
        c = str(r.get("category", "all"))
        if seen.get(c, 0) < k:
            seen[c] = seen.get(c, 0) + 1
            idx.append(i)
    return idx


# ------------------------------------------------------------------------------------------------------------ select
def select_checkpoint(rows: list[dict[str, Any]], target: float = 0.5, low: float = 0.3, high: float = 0.7,
                      min_category: float = 0.05, tolerance: float | None = None) -> dict[str, Any] | None:
    """The evaluated checkpoint to ship, or None if no row qualifies.

    Qualifying rows have the overall score in ``[low, high]`` and every category above ``min_category``. With a
    ``tolerance``, the *latest* qualifying row within ``target +- tolerance`` wins (the most trained model that still
    leaves room for RL); otherwise (or if none is that close) the row closest to ``target`` (ties: later step)."""
    ok = [r for r in rows if low <= r["geneval"] <= high
          and all(v > min_category for k, v in r.items() if k.startswith("geneval_"))]
    if not ok:
        return None
    if tolerance is not None:
        close = [r for r in ok if abs(r["geneval"] - target) <= float(tolerance)]
        if close:
            return max(close, key=lambda r: r["step"])
    return min(ok, key=lambda r: (abs(r["geneval"] - target), -r["step"]))


def write_card(path: Path, cfg: dict[str, Any], row: dict[str, Any], history: list[dict[str, Any]],
               params: dict[str, int], extra: dict[str, Any]) -> None:
    """The model card ``README.md`` of an exported base model."""
    cats = sorted(k for k in row if k.startswith("geneval_"))
    lines = [
        "# shapes_base: the embedded world's base text-to-image flow model",
        "",
        "A tiny pixel-space rectified-flow model (diffusers `SD3Transformer2DModel`, patch 4 on 3x32x32 pixels, "
        "joint attention with a word-level text encoder over the shapes world's vocabulary), trained by "
        "`python -m stepflow.pretrain`. Load it with `stepflow.policies.shapes.ShapesPolicy.from_pretrained()`.",
        "It is deliberately *not* fully trained: the shipped checkpoint was selected so that the strict GenEval score "
        "leaves room for RL.",
        "",
        "## Config",
        "",
        "```json",
        json.dumps(cfg, indent=1),
        "```",
        "",
        f"Parameters: transformer {params['transformer']:,}, text encoder {params['text_encoder']:,}.",
        "",
        "## Training",
        "",
        *[f"- {k}: {v}" for k, v in extra.items()],
        "",
        f"## Evaluation (strict shapes-GenEval, {row.get('num_prompts', '?')} evaluation prompts, "
        f"{row.get('num_steps', 10)}-step Euler ODE, guidance 1.0, seed {row.get('seed', 0)})",
        "",
        "| metric | score |",
        "| --- | --- |",
        f"| **overall** | **{row['geneval']:.4f}** |",
        *[f"| {k.removeprefix('geneval_')} | {row[k]:.4f} |" for k in cats],
        "",
        "## Checkpoints evaluated during training (EMA weights; periodic evaluation subset)",
        "",
        "| step | train time (s) | overall | " + " | ".join(k.removeprefix("geneval_") for k in cats) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in cats) + " |",
        *[f"| {h['step']} | {h.get('train_time_s', '')} | {h['geneval']:.3f} | "
          + " | ".join(f"{h.get(k, float('nan')):.3f}" for k in cats) + " |" for h in history],
        "",
    ]
    path.write_text("\n".join(lines))


# ------------------------------------------------------------------------------------------------------------ main
def settings(cfg) -> PretrainConfig:
    """The composed ``conf/pretrain.yaml`` as its typed :class:`~stepflow.config.PretrainConfig`, every field of every
    group checked (a one-line StepflowError naming it: ``optim.lr: must be a finite number > 0, got 0.0``) before
    anything is built; a PretrainConfig is returned as is."""
    if isinstance(cfg, PretrainConfig):
        return cfg
    check_finite(cfg)
    return to_config(cfg, PretrainConfig)


def run(cfg) -> dict[str, Any]:
    """Train, evaluate, select (and export) as configured; returns a summary dict. ``cfg``: the composed config
    (or its :class:`~stepflow.config.PretrainConfig`)."""
    from dataclasses import asdict

    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    from stepflow.errors import StepflowError
    from stepflow.policies.shapes import world_vocab

    cfg = settings(cfg)
    if not cfg.out_dir:
        raise StepflowError("out_dir: the run's directory is needed (the CLI gives its Hydra run dir); give "
                            "out_dir=<dir>")
    from stepflow.rundir import writable_dir

    out = writable_dir(Path(cfg.out_dir).resolve(), "out_dir")
    if cfg.export:
        writable_dir(Path(cfg.export_dir) if cfg.export_dir else _asset_dir(), "export_dir")
    pl.seed_everything(cfg.seed, workers=True)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    vocab, longest = world_vocab()
    tcfg = cfg.trainer
    module = PretrainModule(arch=asdict(cfg.arch), optim=asdict(cfg.optim), objective=asdict(cfg.objective),
                            ema=asdict(cfg.ema), evaluation=asdict(cfg.eval), max_steps=tcfg.max_steps, vocab=vocab,
                            max_length=longest + 1, out_dir=str(out))
    if cfg.resume:
        _check_resume(cfg.resume, module)
    if cfg.resume and (out / "evals.jsonl").is_file():
        module.time_offset = float(read_history(out, "resume")[-1]["train_time_s"])
    n_params = module.policy.num_parameters()
    log.info("ShapesPolicy: %s parameters; vocab %d words; max_length %d", n_params, len(vocab), longest + 1)
    # a resumed run continues with fresh data (the stream's seed includes the step it resumes from)
    start = 0
    if cfg.resume:
        from stepflow.shell.checkpoint import safe_load

        start = int(safe_load(cfg.resume, "resume").get("global_step", 0))
    d = cfg.data
    data = ShapesStream(batch_size=d.batch_size, seed=cfg.seed, start=start, size=cfg.arch.image_size,
                        categories=d.categories, empty_prompt_prob=d.empty_prompt_prob)
    loader = DataLoader(data, batch_size=None, num_workers=d.num_workers)
    callbacks = [ModelCheckpoint(dirpath=str(out / "checkpoints"), filename="last", save_last=False,
                                 every_n_train_steps=tcfg.checkpoint_every_n_steps, save_top_k=1,
                                 enable_version_counter=False)]
    if tcfg.progress_bar:
        callbacks.append(TQDMProgressBar(refresh_rate=tcfg.progress_refresh))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=tcfg.max_steps, max_time=tcfg.max_time,
                         gradient_clip_val=cfg.optim.grad_clip or None, logger=CSVLogger(str(out), name="logs"),
                         callbacks=callbacks, log_every_n_steps=tcfg.log_every_n_steps,
                         enable_progress_bar=tcfg.progress_bar, enable_model_summary=False,
                         fast_dev_run=tcfg.fast_dev_run, limit_val_batches=0, num_sanity_val_steps=0)
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader, ckpt_path=cfg.resume or None)
    train_time = time.perf_counter() - t0 + module.time_offset
    steps = int(trainer.global_step)
    log.info("trained %d steps in %.0f s", steps, train_time)
    summary: dict[str, Any] = {"steps": steps, "train_time_s": round(train_time, 1), "parameters": n_params,
                               "history": module.history}
    # the complete record (a resumed run appended to the same evals.jsonl)
    history = read_history(out) if (out / "evals.jsonl").is_file() else module.history
    summary.update(finalize(cfg, out, history, steps, train_time, n_params))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


#: what every record of ``evals.jsonl`` holds (what selection, export and a resume read)
HISTORY_KEYS = ("step", "geneval", "path", "train_time_s")


def read_history(run_dir: str | Path, field: str = "finalize_only") -> list[dict[str, Any]]:
    """The periodic evaluations of a pretraining run (``evals.jsonl``), read as far as they go: a line that is no
    complete record (a crash during the append leaves a half-written last one) is named (file and line) and skipped;
    a file without any record is one line naming ``field``."""
    from stepflow.errors import StepflowError

    f = Path(run_dir) / "evals.jsonl"
    if not f.is_file():
        raise StepflowError(f"{field}: {f} not found (not a stepflow.pretrain run dir?); give the run dir of a "
                            "pretraining run that evaluated (eval.every_n_steps > 0)")
    rows, bad = [], []
    for i, line in enumerate(f.read_bytes().decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if isinstance(r, dict) and all(k in r for k in HISTORY_KEYS):
            rows.append(r)
        else:
            bad.append(i)
    if bad:
        log.warning("%s: line%s %s %s no complete evaluation record (%s); skipped", f, "s" if len(bad) > 1 else "",
                    ", ".join(map(str, bad[:8])), "are" if len(bad) > 1 else "is", ", ".join(HISTORY_KEYS))
    if not rows:
        what = "is empty" if not f.read_text(errors="replace").strip() else "holds no complete evaluation record"
        raise StepflowError(f"{field}: {f} {what} (the run evaluated nothing, or stopped while writing it); give the "
                            "run dir of a pretraining run that evaluated (eval.every_n_steps > 0)")
    return rows


def _asset_dir() -> Path:
    from stepflow.policies.shapes import default_asset_dir

    return Path(default_asset_dir())


def _check_resume(path: str, module) -> None:
    """``resume`` is a checkpoint of this pretraining run's model (not a stepflow.train run's, not another
    architecture's), checked before Lightning loads it (one line naming ``resume``)."""
    from stepflow.errors import StepflowError
    from stepflow.shell.checkpoint import check_compatible, safe_load

    ck = safe_load(path, "resume", fix="point it at <pretrain run dir>/checkpoints/last.ckpt")
    if isinstance(ck, dict) and "stepflow" in ck:
        raise StepflowError(f"resume: {path} is a stepflow.train checkpoint (a GRPO run's), not a stepflow.pretrain "
                            "one; give <pretrain run dir>/checkpoints/last.ckpt (a GRPO run resumes with "
                            "python -m stepflow.train ckpt_path=...)")
    check_compatible(ck, module.state_dict(), path, field="resume")


def finalize(cfg, out: Path, history: list[dict[str, Any]], steps: int, train_time: float,
             n_params: dict[str, int]) -> dict[str, Any]:
    """Re-score candidate EMA checkpoints on the (full) evaluation set, select one (:func:`select_checkpoint`), write
    ``selected/`` with a model card and, with ``export=true``, copy it to the package assets."""
    from dataclasses import asdict

    from stepflow.core.heldout import balanced_subset, evaluate_geneval, format_table
    from stepflow.policies.shapes import ShapesPolicy, default_asset_dir
    from stepflow.shapes import load_prompts

    cfg = settings(cfg)
    s, e = cfg.select, cfg.eval
    summary: dict[str, Any] = {}
    if not history or not s.enabled:
        if cfg.export:
            log.warning("export=true: nothing was exported (%s)", "select.enabled=false selects no checkpoint"
                        if not s.enabled else "the run has no evaluation to select from")
        return summary
    recs = balanced_subset(load_prompts(e.split), s.rescore_max_prompts)
    margin = s.rescore_margin
    near = [h for h in history if s.low - margin <= h["geneval"] <= s.high + margin]
    cands = sorted(near, key=lambda r: r["step"])[-s.rescore_top_k:]
    rows = []
    for h in cands:
        pol = ShapesPolicy.from_pretrained(h["path"])
        table, _, _ = evaluate_geneval(pol, recs, num_steps=e.num_steps, guidance=float(e.guidance), seed=e.seed)
        rows.append({"step": h["step"], "path": h["path"], "train_time_s": h["train_time_s"],
                     "num_prompts": len(recs), "num_steps": e.num_steps, "seed": e.seed, "shift": pol.shift, **table})
        log.info("full eval of step %d: %s", h["step"], json.dumps({k: round(v, 4) for k, v in table.items()}))
    (out / "full_evals.json").write_text(json.dumps(rows, indent=1))
    summary["full_evals"] = rows
    best = select_checkpoint(rows, s.target, s.low, s.high, s.min_category, tolerance=s.tolerance)
    if best is None:
        log.warning("no checkpoint satisfies the selection window %s; nothing selected%s", asdict(s),
                    ", so export=true exported nothing" if cfg.export else "")
        return summary
    sel = out / "selected"
    if sel.exists():
        shutil.rmtree(sel)
    shutil.copytree(best["path"], sel)
    summary["selected"] = best
    log.info("selected step %d:\n%s", best["step"], format_table({k: v for k, v in best.items()
                                                                  if k.startswith("geneval")}))
    extra = {"seed": cfg.seed, "selected step": best["step"], "steps trained": steps,
             "training time to the selected step (s)": best["train_time_s"],
             "total training time (s)": round(train_time, 1), "batch size": cfg.data.batch_size,
             "optimizer": json.dumps(asdict(cfg.optim)),
             "objective": json.dumps(asdict(cfg.objective)),
             "EMA decay": cfg.ema.decay, "prompt dropout": cfg.data.empty_prompt_prob,
             "data": "fresh `sample_prompt` prompts of all six categories (round-robin), rendered on the fly",
             "selection": json.dumps(asdict(s)),
             "machine": f"shared 2-core CPU, {cfg.torch_threads or 'default'} torch thread(s)",
             "command": "python -m stepflow.pretrain export=true"}
    cfg_json = json.loads((sel / "config.json").read_text())
    cfg_json["meta"] = {**cfg_json.get("meta", {}), "eval_full": {k: v for k, v in best.items()
                                                                 if k.startswith("geneval")}, **extra}
    (sel / "config.json").write_text(json.dumps(cfg_json, indent=1) + "\n")
    card_cfg = {k: v for k, v in cfg_json.items() if k not in ("vocab", "meta")}
    card_cfg["vocab_size"] = len(cfg_json["vocab"])
    write_card(sel / "README.md", card_cfg, best, history, n_params, extra)
    if cfg.export:
        from stepflow.rundir import writable_dir

        dest = writable_dir(Path(cfg.export_dir) if cfg.export_dir else default_asset_dir(), "export_dir")
        for f in ("config.json", "model.safetensors", "README.md"):
            shutil.copy2(sel / f, dest / f)
        summary["exported_to"] = str(dest)
        log.info("exported to %s", dest)
    return summary


def finalize_run_dir(cfg, run_dir: str | Path) -> dict[str, Any]:
    """Selection/export only, from an existing run dir (``finalize_only=<run dir>``): no training."""
    from stepflow.policies.shapes import ShapesPolicy

    run_dir = Path(run_dir).resolve()
    history = read_history(run_dir)
    last = history[-1]
    n_params = ShapesPolicy.from_pretrained(last["path"]).num_parameters()
    summary = finalize(cfg, run_dir, history, int(last["step"]), float(last["train_time_s"]), n_params)
    (run_dir / "finalize_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


#: what ``finalize_only`` reads: the selection, its evaluations, the export (the rest configures training)
FINALIZE_READS = ("finalize_only", "select", "eval", "export", "export_dir", "seed", "torch_threads", "out_dir")


def inert_under_finalize(overrides) -> None:
    """``finalize_only=<run dir>`` trains nothing: a command-line setting of training (``trainer.*``, ``optim.*``,
    ``data.*``, ...) would be ignored, so it is refused in one line naming it."""
    from stepflow.errors import StepflowError

    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key.split(".", 1)[0] not in FINALIZE_READS and not key.startswith("hydra"):
            raise StepflowError(f"{key}: finalize_only only re-scores, selects and exports a finished run's checkpoints "
                                f"(it reads {', '.join(FINALIZE_READS[1:])}), so {key} would be ignored; drop it, or "
                                "train with it (without finalize_only)")


@entry_point("pretrain")
def main(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    s = settings(cfg)  # every field checked before anything is built
    if s.finalize_only:
        inert_under_finalize(HydraConfig.get().overrides.task)
    if not s.out_dir:
        s.out_dir = HydraConfig.get().runtime.output_dir
    log.info("config:\n%s", OmegaConf.to_yaml(OmegaConf.structured(s)))
    if s.finalize_only:
        finalize_run_dir(s, s.finalize_only)
    else:
        run(s)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
