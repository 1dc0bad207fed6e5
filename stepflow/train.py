"""``python -m stepflow.train``: Hydra entry point of GRPO training (thin: build the parts, fit).

Examples::

    python -m stepflow.train                                  # embedded world, gain credit, DDIM SDE, CPU
    python -m stepflow.train advantage=uniform sampler=flow_sde
    python -m stepflow.train model=sd35_medium reward=pickscore data=pickscore trainer=ddp
    python -m stepflow.train ckpt_path=outputs/train/<run>/checkpoints/last.ckpt   # resume
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from stepflow.cli import entry_point, instantiate, quiet_libraries, to_log_file
from stepflow.config import DataConfig, EmaConfig, EvalConfig, LoopConfig, LoraConfig, TrainConfig, to_config
from stepflow.errors import StepflowError
from stepflow.rundir import resolve_ckpt, resume_command, summary_line, tidied_if_unstarted
from stepflow.shell.processes import check_trainer

__all__ = ["settings", "check_trainer", "Settings", "build_module", "build_trainer", "build_policy", "build_reward", "run", "main",
           "resolve_ckpt", "resume_command", "summary_line"]


def _container(node) -> dict:
    return {} if node is None else OmegaConf.to_container(node, resolve=True)


def build_policy(cfg: DictConfig):
    """Instantiate the model config (``_target_`` + constructor arguments) and add the LoRA adapter of ``cfg.lora``
    (unless the model is fully fine-tuned, ``model.finetune=full``: every transformer weight is trained)."""
    policy = instantiate(_container(cfg.model), "model")
    if getattr(policy, "finetune", "lora") == "full":
        return policy
    lora = to_config(cfg.lora, LoraConfig, "lora")
    policy.add_lora(rank=lora.rank, alpha=float(lora.alpha), targets=tuple(lora.targets), init=lora.init)
    return policy


def build_reward(cfg: DictConfig):
    from stepflow.rewards.registry import build_reward as _build

    return _build(_container(cfg.reward))


@dataclass
class Settings:
    """The typed groups of a training config (each checked by its dataclass) and the built parts (each checked by
    its class): ``sampler`` the rollout's (the objective's own ``rollout_sampler`` when it names one), ``advantage``
    the credit, ``objective`` bound to ``train``, ``window`` (``window=none``: a window that holds every step)."""

    loop: LoopConfig
    train: TrainConfig
    eval: EvalConfig
    ema: EmaConfig
    lora: LoraConfig
    data: DataConfig
    sampler: Any
    advantage: Any
    objective: Any
    window: Any
    strategy: str = "single"  #: the trainer's strategy kind (stepflow.core.dist.strategy_kind_of_config)
    #: the ``_target_`` of the model / reward config, located but not built (its capability flags, e.g.
    #: ``takes_source`` / ``reads_source``, for the requirement rows); None where it cannot be located
    model: Any = None
    reward: Any = None
    model_name: str = "?"  #: ``model.name`` (for messages)


def settings(cfg: DictConfig) -> Settings:
    """Every group of ``cfg`` as its dataclass or part, every float finite and the requirements between them
    checked (:mod:`stepflow.core.requirements`), before anything is loaded (a wrong setting is one line in a second,
    not after minutes of loading a model)."""
    from stepflow.cli import check_finite
    from stepflow.core import requirements
    from stepflow.core.dist import strategy_kind_of_config
    from stepflow.core.parts import build_part, check_fields, from_option

    check_finite(cfg)
    seed = cfg.get("seed", 0)
    if not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
        raise StepflowError(f"seed: must be an integer >= 0, got {seed!r}")
    train = to_config(cfg.train, TrainConfig, "train")
    parts = {g: build_part(g, cfg[g], option=_choice(g)) for g in ("sampler", "advantage", "objective", "window")}
    if cfg.get("reward") is not None:  # built after the model (it may load weights): its fields checked now
        check_fields("reward", cfg.reward, option=_choice("reward"))
    s = Settings(loop=to_config(cfg.loop, LoopConfig, "loop"), train=train, eval=to_config(cfg.eval, EvalConfig, "eval"),
                 ema=to_config(cfg.ema, EmaConfig, "ema"), lora=to_config(cfg.lora, LoraConfig, "lora"),
                 data=to_config(cfg.data, DataConfig, "data"), strategy=strategy_kind_of_config(cfg.get("trainer")),
                 model=_located(cfg.get("model")), reward=_located(cfg.get("reward")),
                 model_name=str((cfg.get("model") or {}).get("name", _choice("model") or "?")), **parts)
    check_trainer(cfg.get("trainer"), s.loop)
    s.objective.bind(train)
    if s.objective.rollout_sampler is not None:  # the objective's own rollout sampler (distill: the ODE)
        try:
            s.sampler = from_option("sampler", s.objective.rollout_sampler)
        except ValueError as e:
            raise StepflowError(f"objective.rollout_sampler: {e}") from None
    if getattr(s.objective, "needs_stepwise_advantages", False) and getattr(s.advantage, "over", "all") != "all":
        import logging

        logging.getLogger("stepflow.train").warning(
            "advantage.over=%s does not apply to objective=%s (it reads every step's gain): its gains are normalised "
            "over all steps", s.advantage.over, s.objective.name)
        s.advantage.over = "all"
    requirements.check(s)
    return s


def _located(node) -> Any:
    """The object a config node's ``_target_`` names (a class, a classmethod, a factory), imported but not called;
    None without one or when it cannot be imported (instantiating it later reports that)."""
    target = node.get("_target_") if isinstance(node, (DictConfig, dict)) else None
    if not isinstance(target, str):
        return None
    try:
        from hydra._internal.utils import _locate

        return _locate(target)
    except Exception:  # noqa: BLE001 - an unknown target fails with its own message when built
        return None


def _choice(group: str) -> str | None:
    """The option chosen for ``group`` under a Hydra entry point (for messages), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get(group)
    except (ImportError, ValueError):
        return None


def build_module(cfg: DictConfig, run_dir: Path):
    """Everything but the Trainer: policy (+LoRA), reward, the parts, the group sampler, eval prompts."""
    from stepflow.core.data import PromptPlanner, load_prompt_file
    from stepflow.grpo import GRPOModule

    s = settings(cfg)
    loop = s.loop
    same_latent = loop.same_latent if s.objective.same_latent is None else s.objective.same_latent
    train_records = load_prompt_file(s.data.train_file, "data.train_file", s.data.source_key)
    eval_records = load_prompt_file(s.data.eval_file, "data.eval_file", s.data.source_key)
    plan = PromptPlanner(train_records, loop.prompts_per_iter, loop.group_size, seed=loop.seed,
                        same_latent=same_latent, balance_by=s.data.balance_by)
    torch.manual_seed(loop.seed)
    policy = build_policy(cfg)
    _check_edit_data(policy, s)  # a model whose config did not say whether it edits: asked once built
    reward = build_reward(cfg)
    from stepflow.rewards.base import check_modality

    check_modality(getattr(policy, "modality", "image"), reward,
                   f"model={_choice('model') or getattr(policy, 'name', None) or type(policy).__name__}")
    return GRPOModule(policy, reward, s.sampler, s.advantage, plan, eval_records, loop, s.train, s.eval, s.ema,
                      run_dir, window=s.window, objective=s.objective)


def _check_edit_data(policy, s: Settings) -> None:
    """The requirement rows on the data set and the model's ``takes_source``, with the built policy's own flag."""
    from stepflow.core import requirements

    for msg in requirements.edit_failures(s, getattr(policy, "takes_source", False)):
        raise StepflowError(msg)


def build_trainer(cfg: DictConfig, run_dir: Path):
    """The Lightning Trainer of ``cfg.trainer`` with the loggers of ``cfg.logger`` and the callbacks of
    ``cfg.callbacks`` (each a ``_target_`` node; their output goes to ``run_dir``), and what the GRPO loop fixes:
    one epoch per iteration, manual optimization, no validation loop, atomic checkpoint writes."""
    from stepflow.shell.checkpoint import AtomicCheckpointIO

    loggers = [instantiate(node, f"logger.{name}", save_dir=str(run_dir))
               for name, node in _container(cfg.logger).items() if node]
    callbacks = [instantiate(node, f"callbacks.{name}", dirpath=str(run_dir / "checkpoints"))
                 for name, node in _container(cfg.callbacks).items() if node]
    from lightning.pytorch.callbacks import ModelCheckpoint

    quiet_libraries()  # also where a Trainer is built outside the command (tests, notebooks)
    trainer = _container(cfg.trainer)
    # one checkpoint file per run: stepflow's checkpoints/last.ckpt (callbacks.checkpoint); Lightning's own
    # ModelCheckpoint (a second copy under the logger's folder) only where the user configures one
    trainer.setdefault("enable_checkpointing", any(isinstance(c, ModelCheckpoint) for c in callbacks))
    return instantiate(trainer, "trainer", max_epochs=-1, logger=loggers or False,
                       callbacks=callbacks, plugins=[AtomicCheckpointIO()], enable_progress_bar=False,
                       enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                       use_distributed_sampler=False, log_every_n_steps=1, default_root_dir=str(run_dir))


def _deepspeed_env(cfg: DictConfig) -> None:
    """DeepSpeed picks its accelerator when first imported: on the CPU (``trainer.accelerator=cpu``) it must be told."""
    import os

    t = cfg.get("trainer") or {}
    strategy = t.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(strategy or "")
    if "deepspeed" in target.lower() and t.get("accelerator") == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def run(cfg: DictConfig, run_dir: Path, record: Path | None = None):
    """Build and fit; returns the trained :class:`~stepflow.grpo.GRPOModule`.

    The run directory is locked for the run (one run per directory); a resume (``ckpt_path``) must keep the
    original run's settings (:data:`stepflow.rundir.RESUMABLE` may change) and never rewrites its ``config.yaml``.
    SIGINT / SIGTERM stop the run at the next phase boundary with last.ckpt holding the last finished iteration, and
    raise a :class:`StepflowError` whose ``exit_code`` is 128 + the signal (a requeue-friendly failure for SLURM)."""
    settings(cfg)  # every check that needs no model, before the run dir is touched
    ckpt = resolve_ckpt(cfg.get("ckpt_path"), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with tidied_if_unstarted(run_dir, fresh=ckpt is None, record=record):
        return _fit(cfg, run_dir, ckpt)


def _fit(cfg: DictConfig, run_dir: Path, ckpt: Path | None):
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from torch.utils.data import DataLoader

    from stepflow.core import stop
    from stepflow.rundir import check_resume, global_rank, run_lock

    with run_lock(run_dir), stop.signals_handled(announce=lambda m: print(f"stepflow: {m}", flush=True)):
        if ckpt is not None:
            check_resume(cfg, run_dir)
        elif global_rank() == 0:
            OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        if cfg.get("torch_threads"):  # oversubscribed OpenMP threads on a shared CPU are ~10x slower than one each
            torch.set_num_threads(int(cfg.torch_threads))
        _deepspeed_env(cfg)
        module = build_module(cfg, run_dir)
        trainer = build_trainer(cfg, run_dir)
        ticks = DataLoader(list(range(1)), batch_size=None)  # one "batch" per epoch = one GRPO iteration
        try:
            trainer.fit(module, train_dataloaders=ticks, ckpt_path=str(ckpt) if ckpt else None)
        except SIGTERMException:  # Lightning's own SIGTERM exit, after the epoch (and its checkpoint) finished
            module.stop_reason = module.stop_reason or f"stopped by SIGTERM after iteration {module.iteration}"
            module.stop_signal = module.stop_signal or "SIGTERM"
        finally:  # a run that raised: its progress bar ends its line, so the one-line error gets a line of its own
            if getattr(module, "_pbar", None) is not None:
                module._pbar.close()
                module._pbar = None
        if stop.STOP.is_set() and not module.stop_reason:  # the signal came after the last iteration
            module.stop_reason, module.stop_signal = f"stopped by {stop.reason()} after iteration {module.iteration}", stop.reason()
    if module.stop_reason:
        code = stop.EXIT_CODES.get(module.stop_signal or "", 2)
        if module.stop_signal and module.global_rank > 0:  # the ranks stopped together: rank 0 says it, once
            raise SystemExit(code)
        last = run_dir / "checkpoints" / "last.ckpt"
        where = f"; resume: {resume_command(last)}" if last.is_file() else "; no iteration finished, nothing to resume"
        raise StepflowError(module.stop_reason + where, exit_code=code)
    return module


@entry_point("train", resumes=True)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    record = run_dir / hc.output_subdir if hc.output_subdir and str(hc.output_subdir).startswith(".hydra/resume_") else None
    ckpt = cfg.get("ckpt_path")
    if ckpt and ckpt != "auto" and Path(str(ckpt)).expanduser().parent.name == "checkpoints":
        run_dir = Path(str(ckpt)).expanduser().parent.parent  # continue writing into the resumed run's dir
    module = run(cfg, run_dir, record)
    if module.global_rank == 0:
        line = summary_line(module.history, run_dir)
        print(line, flush=True)
        to_log_file(line)


if __name__ == "__main__":
    main()
