"""``python -m stepflow.train``: Hydra entry point of GRPO training (thin: build parts, fit).

Examples::

    python -m stepflow.train                                  # embedded world, gain credit, DDIM SDE, CPU
    python -m stepflow.train advantage=uniform sampler=flow_sde
    python -m stepflow.train model=sd35_medium reward=pickscore data=pickscore trainer=ddp
    python -m stepflow.train ckpt_path=outputs/train/<run>/checkpoints/last.ckpt   # resume
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from stepflow.cli import StepflowError, entry_point


def _container(node) -> dict:
    return {} if node is None else OmegaConf.to_container(node, resolve=True)


def _instantiate(node: dict, field: str):
    """hydra.utils.instantiate, with the user-facing error of the target (one line) instead of Hydra's wrapper."""
    import hydra.utils
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(node, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, (ValueError, FileNotFoundError, OSError)):
            raise StepflowError(str(cause).strip().splitlines()[0]) from None
        raise StepflowError(f"{field}: {' '.join(str(e).split())[:300]}") from None


#: keys of a model config that are not constructor arguments: its name, its own LoRA block, and training preferences
#: that other config groups read (conf/sampler/ddim_sde.yaml reads ``ddim_schedule``, conf/train.yaml ``train_steps``)
MODEL_META_KEYS = ("name", "lora", "ddim_schedule", "train_steps")


def model_kwargs(node) -> tuple[dict, dict | None]:
    """A model config node as instantiate kwargs (``_target_`` kept, :data:`MODEL_META_KEYS` removed) and its own
    ``lora`` block (None when it has none)."""
    mcfg = _container(node)
    lora = mcfg.get("lora")
    for k in MODEL_META_KEYS:
        mcfg.pop(k, None)
    return mcfg, lora


def build_policy(cfg: DictConfig):
    """Instantiate the model config (``_target_`` + kwargs) and add the LoRA adapter of ``cfg.lora``."""
    mcfg, lora = model_kwargs(cfg.model)
    lora = lora or _container(cfg.get("lora"))
    policy = _instantiate(mcfg, "model")
    if lora and lora.get("rank", 0) > 0:
        policy.add_lora(rank=int(lora["rank"]), alpha=float(lora.get("alpha", lora["rank"])),
                        targets=tuple(lora.get("targets") or ()), init=lora.get("init", "gaussian"))
    return policy


def build_reward(cfg: DictConfig):

    rcfg = _container(cfg.reward)
    try:
        from stepflow.rewards.registry import build_reward as _build  # real-reward registry, when present

        return _build(rcfg)
    except ImportError:
        return _instantiate(rcfg, "reward")


def _make(cls, node, prefix: str):
    """Build a config dataclass from a config node; errors name the full field (``sampler.eta: ...``)."""
    from stepflow.grpo import _check_fields

    values = _check_fields(cls, _container(node), prefix)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StepflowError(msg if msg.startswith(prefix + ".") else f"{prefix}.{msg}") from None


def check_train_steps(optim, sampler, num_steps: int) -> None:
    """One-line errors for ``train.train_steps`` that would train nothing: an index outside ``0..T−1``, or (for a
    stochastic sampler) only steps whose noise std is 0 on the grid, e.g. step 0 under the paper's DDIM schedule.

    Which steps are deterministic does not depend on the grid's shift (σ = 0 only where t = 1 or s = 0, the grid's
    ends), so a shift-1 grid stands in for the model's.
    """
    from stepflow.sde import step_std, time_grid

    steps = optim.train_steps
    if steps is None:
        return
    bad = [k for k in steps if not isinstance(k, int) or not 0 <= k < num_steps]
    if bad:
        raise StepflowError(f"train.train_steps: step {bad[0]!r} is outside 0..{num_steps - 1} (loop.num_steps="
                            f"{num_steps}); use step indices or train.train_steps=null for every stochastic step")
    if not steps:
        raise StepflowError("train.train_steps: empty list trains nothing; use null for every stochastic step")
    if sampler.name == "ode":
        return  # the ODE has no density at all (distill trains its own way); nothing to check
    grid = time_grid(num_steps, shift=1.0)
    live = [k for k in steps if float(step_std(sampler, grid[k], grid[k + 1], t_guard=grid[1])) > 0]
    if not live:
        raise StepflowError(f"train.train_steps: steps {list(steps)} carry no noise under sampler={sampler.name}"
                            f"{' (schedule ' + sampler.schedule + ')' if sampler.name == 'ddim_sde' else ''}, so "
                            "nothing would be trained; pick stochastic steps or train.train_steps=null")


def build_module(cfg: DictConfig, run_dir: Path):
    """Everything but the Trainer: policy (+LoRA), reward, credit, sampler, group sampler, eval prompts."""
    from stepflow.credit import CreditConfig
    from stepflow.data import GroupSampler, load_prompt_file
    from stepflow.grpo import EmaConfig, EvalConfig, GRPOModule, LoopConfig, OptimConfig, rollout_sampler
    from stepflow.sde import SamplerConfig

    loop = _make(LoopConfig, cfg.loop, "loop")
    optim = _make(OptimConfig, cfg.train, "train")
    eval_cfg = _make(EvalConfig, cfg.eval, "eval")
    ema = _make(EmaConfig, cfg.ema, "ema")
    sampler = _make(SamplerConfig, cfg.sampler, "sampler")
    credit = _make(CreditConfig, cfg.advantage, "advantage")
    if loop.num_steps < 2:
        raise StepflowError(f"loop.num_steps: must be >= 2, got {loop.num_steps}")
    if loop.substeps < 1:
        raise StepflowError(f"loop.substeps: must be >= 1, got {loop.substeps}")
    check_train_steps(optim, rollout_sampler(sampler, credit), loop.num_steps)
    train_records = load_prompt_file(cfg.data.train_file, "data.train_file")
    eval_records = load_prompt_file(cfg.data.eval_file, "data.eval_file")
    plan = GroupSampler(train_records, loop.prompts_per_iter, loop.group_size, seed=loop.seed,
                        same_latent=loop.same_latent, balance_by=cfg.data.get("balance_by"))
    torch.manual_seed(loop.seed)
    policy = build_policy(cfg)
    reward = build_reward(cfg)
    return GRPOModule(policy, reward, sampler, credit, plan, eval_records, loop, optim, eval_cfg, ema, run_dir,
                      write_csv=bool(cfg.logger.get("csv", True)))


def build_trainer(cfg: DictConfig, run_dir: Path):
    import lightning as L

    from stepflow.checkpoint import AtomicCheckpointIO, checkpoint_callback

    t = _container(cfg.trainer)
    loggers = []
    lg = cfg.logger
    if lg.get("tensorboard"):
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version=""))
    if lg.get("wandb"):
        from lightning.pytorch.loggers import WandbLogger

        offline = not os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") == "offline"
        loggers.append(WandbLogger(project=lg.get("project", "stepflow"), save_dir=str(run_dir), offline=offline))
    return L.Trainer(
        accelerator=t.get("accelerator", "cpu"), devices=t.get("devices", 1), strategy=t.get("strategy", "auto"),
        num_nodes=t.get("num_nodes", 1), precision=t.get("precision", "32-true"), max_epochs=-1,
        logger=loggers or False, callbacks=[checkpoint_callback(run_dir / "checkpoints")],
        plugins=[AtomicCheckpointIO()], enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, log_every_n_steps=1,
        default_root_dir=str(run_dir), deterministic=False,
    )


def run(cfg: DictConfig, run_dir: Path) -> "GRPOModule":  # noqa: F821
    """Build and fit; returns the trained module."""
    from torch.utils.data import DataLoader

    ckpt = cfg.get("ckpt_path")
    if ckpt:
        ckpt = Path(str(ckpt)).expanduser()
        if not ckpt.is_file():
            raise StepflowError(f"ckpt_path: checkpoint not found: {ckpt} (point it at <run dir>/checkpoints/last.ckpt)")
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    threads = cfg.get("torch_threads") or cfg.trainer.get("torch_threads")
    if threads:  # oversubscribed OpenMP threads on a shared CPU are ~10x slower than one thread each
        torch.set_num_threads(int(threads))
    module = build_module(cfg, run_dir)
    trainer = build_trainer(cfg, run_dir)
    ticks = DataLoader(list(range(1)), batch_size=None)  # one "batch" per epoch = one GRPO iteration
    trainer.fit(module, train_dataloaders=ticks, ckpt_path=str(ckpt) if ckpt else None)
    if module.stop_reason:
        raise StepflowError(module.stop_reason)
    return module


def summary_line(history: list[dict], run_dir: Path) -> str:
    """One line for the end of a run: iterations, held-out metrics first -> last, NFEs and where the outputs are."""
    evals = [h for h in history if any(k.startswith("eval/") for k in h)]
    keys = sorted({k for h in evals for k in h if k.startswith("eval/") and not k.startswith("eval/geneval_")})
    parts = []
    for k in keys:
        vals = [h[k] for h in evals if k in h]
        if vals:
            parts.append(f"{k} {vals[0]:.3f} -> {vals[-1]:.3f} ({vals[-1] - vals[0]:+.3f})")
    its = max((int(h["iteration"]) for h in history), default=0)
    nfe = max((h.get("cost/nfe_total", 0) for h in history), default=0)
    secs = sum(h.get("time/iteration_s", 0.0) for h in history)
    head = f"stepflow: {its} iterations, {secs:.0f} s training, {int(nfe):,} NFEs"
    return "; ".join([head, *parts, f"outputs in {run_dir}"])


@entry_point("train")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    ckpt = cfg.get("ckpt_path")
    if ckpt and Path(str(ckpt)).expanduser().parent.name == "checkpoints":
        run_dir = Path(str(ckpt)).expanduser().parent.parent  # continue writing into the resumed run's dir
    module = run(cfg, run_dir)
    if module.global_rank == 0:
        print(summary_line(module.history, run_dir), flush=True)


if __name__ == "__main__":
    main()
