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

from stepflow.cli import entry_point, instantiate
from stepflow.config import DataConfig, EmaConfig, EvalConfig, LoopConfig, LoraConfig, TrainConfig, to_config
from stepflow.errors import StepflowError


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


def check_train_steps(train: TrainConfig, sampler, num_steps: int, density: bool = True) -> None:
    """One-line errors for ``train.train_steps`` that would train nothing: an index outside ``0..T−1``, or (for a
    stochastic sampler) only steps whose noise std is 0 on the grid, e.g. step 0 under the paper's DDIM schedule.

    Which steps are deterministic does not depend on the grid's shift (σ = 0 only where t = 1 or s = 0, the grid's
    ends), so a shift-1 grid stands in for the model's.
    """
    from stepflow.sde import step_std, time_grid

    steps = train.train_steps
    if steps is None:
        return
    bad = [k for k in steps if not 0 <= k < num_steps]
    if bad:
        raise StepflowError(f"train.train_steps: step {bad[0]!r} is outside 0..{num_steps - 1} (loop.num_steps="
                            f"{num_steps}); use step indices or train.train_steps=null for every stochastic step")
    if sampler.name in ("ode", "dpm2") or not density:
        return  # no density at all, or an objective that needs none (distill, the forward process): nothing to check
    grid = time_grid(num_steps, shift=1.0)
    live = [k for k in steps if float(step_std(sampler, grid[k], grid[k + 1], t_guard=grid[1])) > 0]
    if not live:
        raise StepflowError(f"train.train_steps: steps {list(steps)} carry no noise under sampler={sampler.name}"
                            f"{' (schedule ' + sampler.schedule + ')' if sampler.name == 'ddim_sde' else ''}, so "
                            "nothing would be trained; pick stochastic steps or train.train_steps=null")


def window_union(window, num_steps: int) -> list[int] | None:
    """Every step the SDE ``window`` can hold over a run (None: no window): ``fixed`` its steps, ``sliding`` and
    ``random`` every step from ``start`` on (the sliding window moves up to the last position and holds there),
    ``random_start`` the steps of ``[start, end)``, ``mixgrpo`` the steps before T − 2."""
    if window.kind == "none":
        return None
    if window.kind == "fixed":
        return list(range(window.start, window.start + window.size))
    if window.kind == "mixgrpo":  # MixGRPO's window ends before the grid's last two points (its end is exclusive)
        return list(range(window.start, num_steps - 2))
    if window.kind == "random_start":
        return list(range(window.start, num_steps if window.end is None else min(window.end, num_steps)))
    return list(range(window.start, num_steps))


def check_trains_something(train: TrainConfig, sampler, window, num_steps: int, density: bool = True) -> None:
    """One-line errors for combinations of ``window`` × ``train.train_steps`` × ``train.timestep_fraction`` ×
    ``sampler`` × ``loop.num_steps`` under which no step is ever trained (``train/steps_trained=0`` for the whole
    run): a window that does not fit the grid, a window that misses every listed step, a window holding only
    noise-free steps (the last step of a DDIM grid: s = 0), a sampler whose noise is zero everywhere. The ODE
    sampler, which has no density, trains nothing by design (a rollout-only run): a warning says so.

    Which steps are noise-free does not depend on the grid's shift (σ = 0 only at the grid's ends), so a shift-1
    grid stands in for the model's. ``density``: the objective trains the steps' densities (the GRPO objective;
    distillation and the forward-process objectives train any step)."""
    from stepflow.objectives.base import trainable_steps
    from stepflow.sde import step_std, time_grid
    from stepflow.window import window_steps

    if window.kind != "none":
        try:
            window_steps(window, 0, num_steps, 0)
        except ValueError as e:
            raise StepflowError(str(e)) from None
    if sampler.name in ("ode", "dpm2") and density:
        import logging

        logging.getLogger("stepflow.train").warning(
            "sampler=%s has no density: this run rolls out and scores, and trains nothing (train/steps_trained=0); "
            "use a stochastic sampler (ddim_sde, flow_sde, cps) to train, or an objective without log-probs "
            "(objective=nft, awm, advantageflow, distill)", sampler.name)
        return
    union = window_union(window, num_steps)
    if trainable_steps(train, sampler, time_grid(num_steps, shift=1.0), density, union):
        return
    steps = train.train_steps
    chosen = (f"train.train_steps={list(steps)}" if isinstance(steps, list)
              else f"the first int(T·train.timestep_fraction) = {int(num_steps * train.timestep_fraction + 1e-9)} "
                   f"steps" if train.timestep_fraction < 1 else
              "every noisy step")
    if union is not None:
        grid = time_grid(num_steps, shift=1.0)
        quiet = [k for k in range(num_steps) if float(step_std(sampler, grid[k], grid[k + 1], t_guard=grid[1])) == 0]
        raise StepflowError(
            f"window: the SDE window (window={window.kind}, steps {union[0]}..{union[-1]} of 0..{num_steps - 1}) holds "
            f"no step that is trained ({chosen}; steps {quiet} carry no noise under sampler={sampler.name}), so "
            "nothing would be trained; move window.start / window.size over trained noisy steps, or change "
            "train.train_steps")
    if isinstance(steps, list):
        return  # check_train_steps names the listed steps
    field = {"ddim_sde": "sampler.eta", "flow_sde": "sampler.a", "cps": "sampler.eta",
             "dance_sde": "sampler.eta"}.get(sampler.name, "sampler")
    if train.timestep_fraction < 1:
        field = "train.timestep_fraction"
    raise StepflowError(f"{field}: no step of the {num_steps}-step grid carries noise ({chosen} under "
                        f"sampler={sampler.name}), so nothing would be trained; raise {field}")


@dataclass
class Settings:
    """The typed groups of a training config (each checked by its dataclass), with the rollout sampler resolved."""

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


def settings(cfg: DictConfig) -> Settings:
    """Every group of ``cfg`` as its dataclass, every float finite and the field combinations checked, before
    anything is built or loaded (a wrong setting is one line in a second, not after minutes of loading a model)."""
    from stepflow.advantage import AdvantageConfig
    from stepflow.cli import check_finite
    from stepflow.config import ObjectiveConfig
    from stepflow.sde import SamplerConfig
    from stepflow.window import WindowConfig

    check_finite(cfg)
    seed = cfg.get("seed", 0)
    if not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
        raise StepflowError(f"seed: must be an integer >= 0, got {seed!r}")
    loop = to_config(cfg.loop, LoopConfig, "loop")
    train = to_config(cfg.train, TrainConfig, "train")
    s = Settings(loop=loop, train=train, eval=to_config(cfg.eval, EvalConfig, "eval"),
                 ema=to_config(cfg.ema, EmaConfig, "ema"), lora=to_config(cfg.lora, LoraConfig, "lora"),
                 data=to_config(cfg.data, DataConfig, "data"), sampler=to_config(cfg.sampler, SamplerConfig, "sampler"),
                 advantage=to_config(cfg.advantage, AdvantageConfig, "advantage"),
                 objective=to_config(cfg.objective, ObjectiveConfig, "objective"),
                 window=to_config(cfg.window, WindowConfig, "window"))
    if s.objective.rollout_sampler is not None:  # the objective's own rollout sampler (distill: ode), in its config
        s.sampler = SamplerConfig(name=s.objective.rollout_sampler)
    check_objective(s)
    check_train_steps(train, s.sampler, loop.num_steps, s.objective.name == "grpo")
    check_trains_something(train, s.sampler, s.window, loop.num_steps, s.objective.name == "grpo")
    check_step_subset(s)
    check_post_solver(s)
    check_branches(s)
    check_retain(s, cfg)
    return s


def check_retain(s: Settings, cfg: DictConfig) -> None:
    """``loop.retain_graph=true`` where the update cannot train from the rollout's graphs
    (:func:`stepflow.retain.why_not`) is one line before anything loads; ``auto`` falls back at run time."""
    from stepflow import retain
    from stepflow.advantage import BRANCH_SCHEMES
    from stepflow.dist import strategy_kind_of_config
    from stepflow.objectives import _CLASSES
    from stepflow.weighting import build_weighting

    if retain.mode(s.loop.retain_graph) != "on":
        return
    per_step = s.train.weighting if build_weighting(s.train.weighting).per_step else None
    why = retain.why_not(updates_per_iter=s.train.updates_per_iter, update_per_step=s.train.update_per_step,
                         forward_process=_CLASSES[s.objective.name].forward_process,
                         branched=s.advantage.scheme if s.advantage.scheme in BRANCH_SCHEMES else None,
                         per_step_weighting=per_step, strategy=strategy_kind_of_config(cfg.get("trainer")))
    if why is not None:
        raise StepflowError(f"loop.retain_graph=true: {why}; set loop.retain_graph=false (or auto)")


def check_branches(s: Settings) -> None:
    """One-line errors for the credits whose rewards come from elsewhere than the rollout's own states:
    ``advantage=tempflow | g2rpo`` (branch rollouts, stepflow.branch_loop) train GRPO on branches of an ODE anchor, so
    no other objective, no SDE window (the anchor is the ODE everywhere and every trained step branches), no
    per-sample step subset (each branch row trains its own step) and no combination of whole per-step gradients;
    the overlapped reward call does not apply (a warning). ``advantage=turning_point`` reads the window 0..n−1
    (TurningPoint-GRPO's ``sde_window_range (0, n)``)."""
    from stepflow.objectives.base import trainable_steps
    from stepflow.sde import time_grid
    from stepflow.window import window_steps

    name = s.advantage.scheme
    if name in ("tempflow", "g2rpo"):
        fix = f"advantage={name} trains GRPO on branches of an ODE anchor at every trained step"
        if s.objective.name != "grpo":
            raise StepflowError(f"objective={s.objective.name}: {fix}; use objective=grpo")
        if s.window.kind != "none":
            raise StepflowError(f"window={s.window.kind}: {fix} (the anchor has no SDE window); use window=none and "
                                "train.train_steps to choose the steps")
        if s.train.step_subset is not None:
            raise StepflowError(f"train.step_subset={s.train.step_subset}: {fix}, each branch row at its own step; set "
                                "train.step_subset=null")
        if s.train.weighting in ("grad_rms", "auto"):
            raise StepflowError(f"train.weighting={s.train.weighting}: {fix}, each branch row at its own step, which "
                                "whole per-step gradients cannot combine; use train.weighting=none or noise")
        if s.sampler.name in ("ode", "dpm2"):
            raise StepflowError(f"sampler={s.sampler.name}: {fix}, drawn by the sampler's SDE; use sampler=flow_sde "
                                "(TempFlow-GRPO, Granular-GRPO) or another SDE")
        if s.loop.overlap_reward:
            import logging

            logging.getLogger("stepflow.train").warning("loop.overlap_reward: does not apply to advantage=%s (one reward "
                                                        "call for every branch image)", name)
    if name == "turning_point" and s.objective.name == "grpo" and s.sampler.name not in ("ode", "dpm2"):
        steps = s.loop.num_steps
        window = None if s.window.kind == "none" else window_steps(s.window, 0, steps, 0)
        cand = trainable_steps(s.train, s.sampler, time_grid(steps, shift=1.0), True, window)
        if cand and cand != list(range(len(cand))):
            raise StepflowError(f"advantage=turning_point: the trained steps must be a window that starts at step 0 "
                                f"(TurningPoint-GRPO's sde_window_range (0, n)), got {cand}; use window=fixed "
                                "window.start=0 or train.train_steps=null")


def check_post_solver(s: Settings) -> None:
    """One-line errors for ``window.post_solver=dpmpp2m`` (MixGRPO-Flash) where it cannot apply. Its rollout leaves
    the grid after the window and keeps only the final latent (stepflow.rollout.Trajectory.absent_states), so it needs
    the GRPO objective (the others read the final latent's re-noisings or every state's estimate) and uniform credit
    (the gain schemes read the rewards of the states after the window). ``window.kind=mixgrpo`` is checked by
    WindowConfig itself."""
    if s.window.post_solver == "euler":
        return
    if s.objective.name != "grpo":
        raise StepflowError(f"window.post_solver={s.window.post_solver}: MixGRPO-Flash trains the rollout's SDE window "
                            f"with GRPO, not objective={s.objective.name}; use objective=grpo or "
                            "window.post_solver=euler")
    if s.advantage.scheme != "uniform":
        raise StepflowError(f"window.post_solver={s.window.post_solver}: the Flash rollout keeps no state between the "
                            f"window and the final image, which advantage={s.advantage.scheme} reads; use "
                            "advantage=uniform or window.post_solver=euler")


def check_step_subset(s: Settings) -> None:
    """One-line errors for ``train.step_subset=random_per_sample`` (DanceGRPO's per-sample subset of the trained
    steps) where it cannot apply: an objective other than grpo (it subsets the rollout's SDE transitions), a step
    weighting that combines whole per-step gradients (grad_rms, auto), and ``train.step_fraction`` so small that
    ``int(S·step_fraction)`` of the S trained steps is 0 (no sample would train a step)."""
    from stepflow.algorithm import steps_per_sample
    from stepflow.objectives.base import trainable_steps
    from stepflow.sde import time_grid
    from stepflow.window import window_steps

    train = s.train
    if train.step_subset is None:
        return
    if s.objective.name != "grpo":
        raise StepflowError(f"train.step_subset={train.step_subset}: draws each sample's trained SDE steps, which "
                            f"objective={s.objective.name} does not train; use objective=grpo or train.step_subset=null")
    if train.weighting in ("grad_rms", "auto"):
        raise StepflowError(f"train.step_subset={train.step_subset}: each sample trains its own steps, which "
                            f"train.weighting={train.weighting} (whole per-step gradients) cannot combine; use "
                            "train.weighting=none (or noise, gain_var, guard)")
    if s.sampler.name in ("ode", "dpm2"):
        return  # nothing is trained anyway (check_trains_something warned)
    steps = s.loop.num_steps
    window = None if s.window.kind == "none" else window_steps(s.window, 0, steps, 0)
    cand = trainable_steps(train, s.sampler, time_grid(steps, shift=1.0), True, window)
    if cand and steps_per_sample(len(cand), train.step_fraction) == 0:
        raise StepflowError(f"train.step_fraction: int({len(cand)} trained steps x {train.step_fraction}) = 0, so no "
                            f"sample would train a step; raise train.step_fraction to at least 1/{len(cand)}")


def check_objective(s: Settings) -> None:
    """One-line errors for settings the chosen objective cannot use: the step weightings (which weigh SDE steps)
    with a forward-process objective, distillation without x̂0 estimates of every state, AWM with listed steps, and
    AdvantageFlow's convexity condition."""
    o, name = s.objective, s.objective.name
    if o.forward_process and s.train.weighting != "none":
        raise StepflowError(f"train.weighting={s.train.weighting}: weighs the rollout's SDE steps, which "
                            f"objective={name} does not train (it trains re-noised final samples); use "
                            "train.weighting=none")
    if name == "distill" and s.advantage.scheme == "uniform":
        raise StepflowError("objective=distill: weights its targets by the gain advantages, which advantage=uniform "
                            "does not compute; use a gain scheme (advantage=gain)")
    if name == "distill" and s.advantage.over == "trained":  # it reads every step's gain and every state's x̂0
        import dataclasses
        import logging

        logging.getLogger("stepflow.train").warning(
            "advantage.over=trained does not apply to objective=distill (it reads every step's gain): its gains are "
            "normalised over all steps")
        s.advantage = dataclasses.replace(s.advantage, over="all")
    if name == "awm" and s.train.train_steps is not None:
        raise StepflowError("train.train_steps: objective=awm draws its own stratified times (objective.num_times, "
                            "objective.times_frac); set train.train_steps=null")
    if name == "awm" and int(s.loop.num_steps * o.times_frac) < 2:
        raise StepflowError(f"objective.times_frac: int(loop.num_steps·times_frac) = "
                            f"{int(s.loop.num_steps * o.times_frac)} leaves no training time in [1, it); raise "
                            "loop.num_steps or objective.times_frac")
    if name == "advantageflow" and not o.gamma + o.lam > 1:
        raise StepflowError(f"objective.gamma: gamma + lam must be > 1 (advantages lie in [-1, 1], so A + gamma + "
                            f"lam > 0 keeps every sample's loss convex), got {o.gamma} + {o.lam}")


def build_module(cfg: DictConfig, run_dir: Path):
    """Everything but the Trainer: policy (+LoRA), reward, advantage, sampler, group sampler, eval prompts."""
    from stepflow.data import PromptPlanner, load_prompt_file
    from stepflow.grpo import GRPOModule

    s = settings(cfg)
    loop, train, advantage = s.loop, s.train, s.advantage
    if advantage.over == "trained" and advantage.effective_over == "all" and advantage.scheme != "uniform":
        import logging

        logging.getLogger("stepflow.train").warning(
            "advantage.over=trained does not apply to advantage=%s (it reads every step's gain): its gains are "
            "normalised over all steps", advantage.scheme)
    same_latent = loop.same_latent if s.objective.same_latent is None else s.objective.same_latent
    train_records = load_prompt_file(s.data.train_file, "data.train_file")
    eval_records = load_prompt_file(s.data.eval_file, "data.eval_file")
    plan = PromptPlanner(train_records, loop.prompts_per_iter, loop.group_size, seed=loop.seed,
                        same_latent=same_latent, balance_by=s.data.balance_by)
    torch.manual_seed(loop.seed)
    policy = build_policy(cfg)
    reward = build_reward(cfg)
    return GRPOModule(policy, reward, s.sampler, advantage, plan, eval_records, loop, train, s.eval, s.ema, run_dir,
                      window=None if s.window.kind == "none" else s.window, objective=s.objective)


def build_trainer(cfg: DictConfig, run_dir: Path):
    """The Lightning Trainer of ``cfg.trainer`` with the loggers of ``cfg.logger`` and the callbacks of
    ``cfg.callbacks`` (each a ``_target_`` node; their output goes to ``run_dir``), and what the GRPO loop fixes:
    one epoch per iteration, manual optimization, no validation loop, atomic checkpoint writes."""
    from stepflow.checkpoint import AtomicCheckpointIO

    loggers = [instantiate(node, f"logger.{name}", save_dir=str(run_dir))
               for name, node in _container(cfg.logger).items() if node]
    callbacks = [instantiate(node, f"callbacks.{name}", dirpath=str(run_dir / "checkpoints"))
                 for name, node in _container(cfg.callbacks).items() if node]
    return instantiate(_container(cfg.trainer), "trainer", max_epochs=-1, logger=loggers or False,
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


def check_strategy(cfg: DictConfig) -> None:
    """One-line errors for what a sharded strategy (FSDP2, DeepSpeed) cannot run, before anything is built: the
    per-step gradient schemes (``train.weighting=grad_rms``, ``train.weighting=auto``) read and rewrite whole
    ``p.grad`` tensors, which FSDP2 shards and DeepSpeed keeps in its own partitions."""
    from stepflow.dist import strategy_kind_of_config

    kind = strategy_kind_of_config(cfg.get("trainer"))
    train = to_config(cfg.train, TrainConfig, "train")
    if kind not in ("fsdp", "deepspeed"):
        return
    if train.weighting in ("grad_rms", "auto"):
        raise StepflowError(f"train.weighting={train.weighting}: combines whole per-step gradients, which "
                            f"trainer={kind} shards; use trainer=ddp (or ddp_cpu) for it, or another train.weighting")


def run(cfg: DictConfig, run_dir: Path):
    """Build and fit; returns the trained :class:`~stepflow.grpo.GRPOModule`.

    The run directory is locked for the run (one run per directory); a resume (``ckpt_path``) must keep the
    original run's settings (:data:`stepflow.rundir.RESUMABLE` may change) and never rewrites its ``config.yaml``.
    SIGINT / SIGTERM stop the run at the next phase boundary with last.ckpt holding the last finished iteration, and
    raise a :class:`StepflowError` whose ``exit_code`` is 128 + the signal (a requeue-friendly failure for SLURM)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from torch.utils.data import DataLoader

    from stepflow import stop
    from stepflow.rundir import check_resume, global_rank, run_lock

    settings(cfg)  # every check that needs no model, before the run dir is touched
    check_strategy(cfg)
    ckpt = resolve_ckpt(cfg.get("ckpt_path"), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
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
        if stop.STOP.is_set() and not module.stop_reason:  # the signal came after the last iteration
            module.stop_reason, module.stop_signal = f"stopped by {stop.reason()} after iteration {module.iteration}", stop.reason()
    if module.stop_reason:
        last = run_dir / "checkpoints" / "last.ckpt"
        where = f"; resume: {resume_command(last)}" if last.is_file() else "; no iteration finished, nothing to resume"
        raise StepflowError(module.stop_reason + where, exit_code=stop.EXIT_CODES.get(module.stop_signal or "", 2))
    return module


def resolve_ckpt(ckpt, run_dir: Path) -> Path | None:
    """``ckpt_path``: a file, or ``auto`` = ``<run dir>/checkpoints/last.ckpt`` when it exists (a requeued job resumes
    itself; a first start begins fresh)."""
    if not ckpt:
        return None
    if str(ckpt) == "auto":
        last = run_dir / "checkpoints" / "last.ckpt"
        return last if last.is_file() else None
    ckpt = Path(str(ckpt)).expanduser()
    if not ckpt.is_file():
        raise StepflowError(f"ckpt_path: checkpoint not found: {ckpt} (point it at <run dir>/checkpoints/last.ckpt)")
    return ckpt


def resume_command(last: Path) -> str:
    """The command line that resumes this run: the original overrides plus ``ckpt_path``."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("ckpt_path=", "hydra."))]
    except (ValueError, ImportError):  # not under a Hydra entry point (tests, notebooks)
        overrides = []
    return " ".join(["python -m stepflow.train", *overrides, f"ckpt_path={last}"])


def summary_line(history: list[dict], run_dir: Path) -> str:
    """One line for the end of a run: iterations, held-out metrics first -> last, NFEs and where the outputs are."""
    evals = [h for h in history if any(k.startswith("eval/") for k in h)]
    keys = sorted({k for h in evals for k in h if k.startswith("eval/") and not k.startswith("eval/geneval_")})
    parts = []
    for k in keys:
        at = [(int(h["iteration"]), h[k]) for h in evals if k in h]
        if at:
            since = f" (from iteration {at[0][0]})" if at[0][0] else ""  # eval.at_start=false: no base evaluation
            parts.append(f"{k} {at[0][1]:.3f} -> {at[-1][1]:.3f} ({at[-1][1] - at[0][1]:+.3f}{since})")
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
    if ckpt and ckpt != "auto" and Path(str(ckpt)).expanduser().parent.name == "checkpoints":
        run_dir = Path(str(ckpt)).expanduser().parent.parent  # continue writing into the resumed run's dir
    module = run(cfg, run_dir)
    if module.global_rank == 0:
        print(summary_line(module.history, run_dir), flush=True)


if __name__ == "__main__":
    main()
