"""The training configuration: typed dataclasses, registered with Hydra as structured configs (one source of defaults).

``conf/train.yaml`` composes :class:`RunConfig` (stored as ``train_schema``) and only overrides it; every field has its
default and its check here. The defaults are sized for the embedded world on a CPU (60 iterations of 4 prompts × 16
samples, T = 10, T′ = 2, lr 1e-3); ``experiment=paper_base`` sets the paper's protocol. A model's own preferences (the
shapes world trains only step 0 with the ``eta_s`` DDIM schedule) live in ``conf/recipe/<model>.yaml``, which the
default composes for the chosen model.

The other entry points are typed the same way: ``conf/pretrain.yaml`` composes :class:`PretrainConfig`
(``pretrain_schema``), ``conf/evaluate.yaml`` :class:`EvaluateConfig` (``evaluate_schema``) and
``conf/serve_reward.yaml`` :class:`ServeRewardConfig` (``serve_reward_schema``, the request :class:`Limits` plus
host and port); each entry point turns its composed config into that object with :func:`to_config` before anything
is built.

A field error is a :class:`ValueError` whose message starts with the field's name; :func:`to_config` adds the
group (``loop.iterations: must be >= 1, got -1``) and the CLI prints it as one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import re
import typing
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from stepflow.core.budget import parse_budget
from stepflow.errors import StepflowError
from stepflow.math.sde import TIME_GRIDS

__all__ = ["LoopConfig", "TrainConfig", "ObjectiveConfig", "EvalConfig", "EmaConfig", "LoraConfig", "DataConfig", "RunConfig",
           "PretrainArchConfig", "PretrainDataConfig", "PretrainObjectiveConfig", "PretrainOptimConfig",
           "PretrainEmaConfig", "PretrainTrainerConfig", "PretrainEvalConfig", "PretrainSelectConfig", "PretrainConfig",
           "EvaluateSamplerConfig", "EvaluateGridConfig", "EvaluateConfig", "Limits", "ServeRewardConfig",
           "check_limit", "check_port", "check_host", "SCHEMAS", "register_configs", "to_config", "KL_MODES",
           "STEP_SUBSETS"]

KL_MODES = ("exact", "flow_grpo_parity")
#: train.step_subset: None (every trained step, every sample) | DanceGRPO's random subset per sample
STEP_SUBSETS = (None, "random_per_sample")

#: the Hydra config directory, shipped inside the package (found the same way from a wheel or an editable install)
CONF_DIR = Path(str(resources.files("stepflow").joinpath("conf")))


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class LoopConfig:
    """Everything of an iteration that is not the optimizer, the sampler or the credit scheme."""

    iterations: int = 60  #: GRPO iterations (= Lightning epochs)
    prompts_per_iter: int = 4  #: P prompts per iteration (global, over all ranks)
    group_size: int = 16  #: k samples per prompt (the GRPO group)
    num_steps: int = 10  #: denoising steps T
    guidance: float | None = None  #: CFG scale of rollout and update (1 = off; None = the model's ``guidance``, else 1)
    same_latent: bool = True  #: share the initial noise x_T within a group (docs/method.md §4)
    substeps: int = 2  #: T′, Euler substeps of the x̂0 estimate (1 = Tweedie; the paper: 5)
    #: ceil(T′·t) substeps per state (about the same substep size everywhere; measured: docs/results.md, "Why the
    #: defaults"); the paper's fixed T′: false (paper_base, mini_base)
    adaptive_substeps: bool = True
    estimate_chunk: int | None = None  #: max states per estimate call (memory)
    decode_chunk: int | None = None  #: max latents per VAE decode call
    seed: int = 0  #: seed of the prompt plan and every noise draw
    dump_trajectories: bool = False  #: write rewards/advantages of every iteration to <run>/trajectories/ (debug)
    #: samples whose reward is NaN / inf are dropped from their iteration (counted as train/nonfinite_rewards); the
    #: run stops with a clear error when more than this fraction of an iteration's samples are dropped
    max_nonfinite_frac: float = 0.25
    #: when the credit reads no final image (advantage.over=trained), roll out to the end and score it every N
    #: iterations anyway, for train/reward_final (0 = never)
    final_reward_every: int = 10
    #: roll out, estimate and decode in ``overlap_chunks`` chunks of the batch, each chunk's reward call running in
    #: a thread while the next chunk is rolled out (a remote reward's latency hides behind the model; on-policy:
    #: the weights do not change within the iteration)
    overlap_reward: bool = False
    overlap_chunks: int = 4
    #: torch.compile the transformer with this backend (inductor on a GPU; null = eager)
    compile: str | None = None
    #: the rollout's (and so the update's) σ grid: ``model`` = the policy's own ``time_grid`` (diffusers' scheduler:
    #: SD3's double shift with σ_min) | ``fastvideo`` = ``sd3_time_shift(grid_shift, linspace(1, 0, T+1))``, the
    #: grid of DanceGRPO / MixGRPO / G²RPO (one shift, no σ_min, exact 0 at the end; stepflow.math.sde.fastvideo_time_grid).
    #: The held-out evaluation always samples on the model's grid
    time_grid: str = "model"
    #: the shift of ``time_grid=fastvideo`` (null: the policy's ``shift``, 1.0 for the shapes model, 3.0 for SD3.5;
    #: DanceGRPO's FLUX scripts: 3)
    grid_shift: float | None = None
    #: on-policy updates train from the rollout's own forward pass (LeanGRPO's Retain; docs/method.md §14): the
    #: rollout evaluates the trained steps with gradients and keeps their graphs, and the update back-propagates the
    #: loss through them instead of running the transformer again. false | true (refused, one line, where it cannot
    #: apply: several optimizer steps per rollout, the forward-process objectives, branch credits, per-step gradient
    #: weightings, FSDP2 / DeepSpeed, active dropout in the transformer) | auto (on where it applies and the kept
    #: activations, measured as they are kept and projected to every kept step, fit ``retain_max_gib``; else
    #: recomputation; train/retained says which)
    retain_graph: Any = False  # typed loosely: true / false / auto, checked below
    #: retain_graph=auto: the most GiB of kept activations per rank (what autograd saves; on the CPU under glibc's malloc
    #: the process grows by about twice that, docs/method.md §14)
    retain_max_gib: float = 8.0
    #: with the graphs kept on the CPU: freed host memory stays in the process for the next rollout instead of going
    #: back to the OS and returning as fresh zeroed pages (glibc; stepflow.core.retain.keep_freed_memory)
    retain_keep_memory: bool = True
    #: a compute budget (stepflow.core.budget): a number = forward-equivalent NFEs over all ranks (a backward counts 2,
    #: CFG twice; reward images apart), "<N>s" = training seconds; the run stops after the iteration that reaches it
    #: (``iterations`` stays the cap) and evaluates at ``eval.at_fractions`` of it. null = ``iterations`` decides
    budget: Any = None  # typed loosely: a number or "<N>s", checked below

    def __post_init__(self) -> None:
        _need(self.retain_graph in (False, True, "auto") and (isinstance(self.retain_graph, bool)
                                                               or self.retain_graph == "auto"),
              f"retain_graph: must be true, false or auto, got {self.retain_graph!r}")
        _need(isinstance(self.retain_max_gib, (int, float)) and not isinstance(self.retain_max_gib, bool)
              and self.retain_max_gib > 0, f"retain_max_gib: must be a number > 0 (GiB), got {self.retain_max_gib!r}")
        _need(isinstance(self.retain_keep_memory, bool),
              f"retain_keep_memory: must be true or false, got {self.retain_keep_memory!r}")
        parse_budget(self.budget)  # raises "budget: must be ..."
        _need(_is_int(self.seed) and self.seed >= 0, f"seed: must be an integer >= 0, got {self.seed!r}")
        _need(_is_int(self.iterations) and self.iterations >= 1, f"iterations: must be an integer >= 1, got {self.iterations!r}")
        _need(self.prompts_per_iter >= 1, f"prompts_per_iter: must be >= 1, got {self.prompts_per_iter}")
        _need(self.group_size >= 2, f"group_size: must be >= 2 (group statistics need two samples), got {self.group_size}")
        _need(self.num_steps >= 2, f"num_steps: must be >= 2, got {self.num_steps}")
        _need(self.guidance is None or self.guidance >= 1.0, f"guidance: must be >= 1 (1 = no CFG) or null, got {self.guidance}")
        _need(self.substeps >= 1, f"substeps: must be >= 1, got {self.substeps}")
        _need(_is_int(self.final_reward_every) and self.final_reward_every >= 0,
              f"final_reward_every: must be an integer >= 0 (0 = never), got {self.final_reward_every!r}")
        _need(_is_int(self.overlap_chunks) and self.overlap_chunks >= 1, f"overlap_chunks: must be an integer >= 1, got {self.overlap_chunks!r}")
        _need(0.0 <= self.max_nonfinite_frac <= 1.0, f"max_nonfinite_frac: must be in [0, 1], got {self.max_nonfinite_frac}")
        for name in ("estimate_chunk", "decode_chunk"):
            v = getattr(self, name)
            _need(v is None or v >= 1, f"{name}: must be >= 1 or null (no chunking), got {v}")
        _need(self.time_grid in TIME_GRIDS, f"time_grid: must be one of {', '.join(TIME_GRIDS)}, got {self.time_grid!r}")
        _need(self.grid_shift is None or (isinstance(self.grid_shift, (int, float)) and not isinstance(self.grid_shift, bool)
                                          and math.isfinite(self.grid_shift) and self.grid_shift > 0),
              f"grid_shift: must be a float > 0 or null (the policy's shift), got {self.grid_shift!r}")
        _need(self.grid_shift is None or self.time_grid == "fastvideo",
              f"grid_shift: shifts the loop.time_grid=fastvideo grid only (loop.time_grid={self.time_grid} is the "
              "policy's own); set loop.time_grid=fastvideo or loop.grid_shift=null")


@dataclass
class TrainConfig:
    """The policy update: optimizer, clipped GRPO loss and KL, which steps are trained (Flow-GRPO's names)."""

    lr: float = 1e-3  #: AdamW learning rate (the paper: 3e-4)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  #: AdamW betas
    weight_decay: float = 1e-4  #: AdamW weight decay
    adam_eps: float = 1e-8  #: AdamW epsilon
    clip_eps: float = 1e-4  #: PPO clip range ϵ (per-dim-mean log-prob convention)
    beta_kl: float = 0.0  #: β, weight of the KL to the reference policy (LoRA disabled)
    kl_mode: str = "exact"  #: exact | flow_grpo_parity (docs/method.md §2)
    max_grad_norm: float = 1.0  #: gradient clipping (0 = off)
    #: step indices to train (a list); None = every step with noise std > 0 (for the GRPO objectives; the forward-process
    #: objectives draw their training times among these steps' grid times)
    train_steps: Any = None  # typed loosely so a wrong value gets __post_init__'s message, not OmegaConf's
    timestep_fraction: float = 1.0  #: train only the first int(T·fraction) steps (Flow-GRPO: 0.99 → 9 of 10)
    micro_batch_size: int = 32  #: samples per forward/backward
    updates_per_iter: int = 1  #: optimizer steps per rollout batch (1 = on-policy; Flow-GRPO uses 2)
    on_policy: bool = False  #: force one optimizer step per rollout (ratio = 1: the KL-regularised policy gradient)
    drop_zero_adv: bool = True  #: skip samples whose advantages are 0 at every step
    #: how the trained steps' terms are combined (stepflow.math.weighting): none | noise (TempFlow-GRPO, ∝ the step's noise
    #: std) | guard (GRPO-Guard's noise-normalised ratio) | guard_released (GRPO-Guard as released: guard and each
    #: step's policy loss / Δt) | grad_rms (each step's gradient scaled to the RMS of their norms) | gain_var (∝ the
    #: step's gain variance) | auto (∝ each step's measured gradient signal)
    weighting: str = "none"
    #: weighting=auto: every step whose gradient is computed is measured; steps of weight 0 are computed (and
    #: measured again) every N iterations
    auto_every: int = 2
    auto_warmup: int = 3  #: weighting=auto: measurements of every step before the weights leave uniform
    #: which of the trained steps each sample trains: null = all of them | random_per_sample = DanceGRPO's subset:
    #: each sample permutes the trained steps with a generator seeded from its own noise seed (the same on any rank)
    #: and trains the first int(S·step_fraction) of the S; the update's loss is the mean over the (sample, step)
    #: pairs trained, each weighted 1/(N·int(S·step_fraction)) (fastvideo/train_grpo_flux.py L551-603)
    step_subset: str | None = None
    step_fraction: float = 0.6  #: step_subset=random_per_sample: the fraction of the trained steps each sample trains
    #: one optimizer step per trained step (each over the rows that train it), in the steps' order (Granular-GRPO's
    #: per-step optimizer.step()); false: one optimizer step accumulates every trained step's term
    update_per_step: bool = False

    def __post_init__(self) -> None:
        _need(self.kl_mode in KL_MODES, f"kl_mode: must be one of {', '.join(KL_MODES)}, got {self.kl_mode!r}")
        _need(self.lr > 0, f"lr: must be > 0, got {self.lr}")
        _need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"betas: must be two floats in [0, 1), got {list(self.betas)}")
        _need(self.weight_decay >= 0 and self.adam_eps > 0, "weight_decay / adam_eps: must be >= 0 / > 0")
        _need(self.clip_eps > 0, f"clip_eps: must be > 0, got {self.clip_eps}")
        _need(self.beta_kl >= 0, f"beta_kl: must be >= 0, got {self.beta_kl}")
        _need(self.max_grad_norm >= 0, f"max_grad_norm: must be >= 0 (0 = off), got {self.max_grad_norm}")
        _need(0 < self.timestep_fraction <= 1, f"timestep_fraction: must be in (0, 1], got {self.timestep_fraction}")
        _need(self.micro_batch_size >= 1, f"micro_batch_size: must be >= 1, got {self.micro_batch_size}")
        _need(self.updates_per_iter >= 1, f"updates_per_iter: must be >= 1, got {self.updates_per_iter}")
        from stepflow.math.loss import WEIGHTINGS

        _need(self.weighting in WEIGHTINGS, f"weighting: must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        _need(_is_int(self.auto_every) and self.auto_every >= 1, f"auto_every: must be an integer >= 1, got {self.auto_every!r}")
        _need(_is_int(self.auto_warmup) and self.auto_warmup >= 0, f"auto_warmup: must be an integer >= 0, got {self.auto_warmup!r}")
        _need(self.train_steps != "auto", "train_steps: auto is now train.weighting=auto (every noisy step, weighted "
              "by its measured gradient signal); set train.train_steps=null train.weighting=auto")
        if self.train_steps is not None:
            steps = list(self.train_steps) if isinstance(self.train_steps, (list, tuple)) else None
            _need(steps is not None, f"train_steps: must be a list of step indices or null, got {self.train_steps!r}")
            bad = [k for k in steps if not _is_int(k)]
            _need(not bad, f"train_steps: step {bad[0]!r} is not an integer index" if bad else "")
            _need(bool(steps), "train_steps: empty list trains nothing; use null for every stochastic step")
            dup = [k for k in steps if steps.count(k) > 1]
            if dup:
                raise ValueError(f"train_steps: step {dup[0]} is listed {steps.count(dup[0])} times (it would be "
                                 "trained that many times per update); list each step once")
            self.train_steps = steps
        _need(self.step_subset in STEP_SUBSETS,
              f"step_subset: must be null or one of {', '.join(k for k in STEP_SUBSETS if k)}, got {self.step_subset!r}")
        _need(isinstance(self.step_fraction, (int, float)) and not isinstance(self.step_fraction, bool)
              and 0 < self.step_fraction <= 1, f"step_fraction: must be in (0, 1], got {self.step_fraction!r}")
        _need(isinstance(self.update_per_step, bool), f"update_per_step: must be true or false, got {self.update_per_step!r}")
        _need(not (self.update_per_step and self.weighting in ("grad_rms", "auto")),
              f"update_per_step: one optimizer step per trained step, which weighting={self.weighting} (a combination of "
              "every step's whole gradient) cannot take; use weighting=none (or noise, gain_var, guard)")
        self.betas = [float(b) for b in self.betas]
        if self.on_policy:
            self.updates_per_iter = 1


@dataclass
class EvalConfig:
    """Held-out evaluation: deterministic ODE sampling with the EMA weights, scored by the training reward."""

    every: int = 20  #: evaluate every N iterations (and at start and end); 0 = only start and end
    #: evaluate the base model before iteration 1 (false: a suite of runs from one base evaluates it once, e.g. the
    #: league; the run's gain is then not computed)
    at_start: bool = True
    num_steps: int = 10  #: ODE steps
    guidance: float | None = None  #: CFG scale (None = the model's ``eval_guidance``, else 1)
    max_prompts: int | None = None  #: a category-balanced subset of the held-out prompts (None = all)
    seed: int = 1234  #: initial noise of sample i depends only on (seed, i)
    batch_size: int = 128  #: samples per sampling batch
    grid_prompts: int = 24  #: samples in the image grid
    #: with ``loop.budget``: also evaluate after the iterations that reach these fractions of it (and at its end)
    at_fractions: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0])

    def __post_init__(self) -> None:
        _need(_is_int(self.every) and self.every >= 0, f"every: must be an integer >= 0 (0 = start and end), got {self.every!r}")
        _need(self.num_steps >= 1, f"num_steps: must be >= 1, got {self.num_steps}")
        _need(isinstance(self.at_start, bool), f"at_start: must be true or false, got {self.at_start!r}")
        _need(self.guidance is None or self.guidance >= 1.0, f"guidance: must be >= 1 or null, got {self.guidance}")
        _need(self.max_prompts is None or self.max_prompts >= 1, f"max_prompts: must be >= 1 or null (all), got {self.max_prompts}")
        _need(self.batch_size >= 1 and self.grid_prompts >= 0, "batch_size / grid_prompts: must be >= 1 / >= 0")
        fr = self.at_fractions
        _need(isinstance(fr, (list, tuple)) and all(_is_num(f) and 0 < f <= 1 for f in fr),
              f"at_fractions: must be a list of fractions in (0, 1] of loop.budget, got {fr!r}")


@dataclass
class EmaConfig:
    """EMA of the trained weights (used for evaluation and the saved adapter), with Flow-GRPO's warm-up."""

    enabled: bool = True  #: keep an EMA
    decay: float = 0.9  #: decay d (warm-up: d_n = min((1+n)/(10+n), d))
    update_every: int = 1  #: optimizer steps between EMA updates (Flow-GRPO: 8 with many steps per epoch)

    def __post_init__(self) -> None:
        _need(0.0 <= self.decay < 1.0, f"decay: must be in [0, 1), got {self.decay}")
        _need(_is_int(self.update_every) and self.update_every >= 1, f"update_every: must be an integer >= 1, got {self.update_every!r}")


@dataclass
class LoraConfig:
    """The LoRA adapter added to the transformer (Flow-GRPO's SD3.5 setting: r 32, alpha 64, attention projections)."""

    rank: int = 32  #: r (> 0)
    alpha: float = 64.0  #: scale alpha / r
    init: str = "gaussian"  #: peft's init_lora_weights (gaussian: A ~ N, B = 0)
    targets: list[str] = field(default_factory=lambda: ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                                                        "attn.to_add_out"])  #: module-name suffixes to adapt

    def __post_init__(self) -> None:
        _need(_is_int(self.rank) and self.rank >= 1, f"rank: must be an integer >= 1, got {self.rank!r}")
        _need(self.alpha > 0, f"alpha: must be > 0, got {self.alpha}")
        _need(bool(self.targets), "targets: empty list adapts nothing; name attention projections")


@dataclass
class DataConfig:
    """Prompt files (``.jsonl`` with a ``prompt`` field, or ``.txt``; ``pkg://stepflow/...`` inside the package)."""

    name: str = MISSING  #: a label
    train_file: str = MISSING  #: training prompts
    eval_file: str = MISSING  #: held-out prompts
    balance_by: str | None = None  #: draw prompts balanced over this record key (e.g. category)
    #: an edit data set: the record field with each prompt's source image path (flow_grpo's counting_edit: image);
    #: null: text-to-image prompts (stepflow.core.data.load_prompt_file)
    source_key: str | None = None


def ObjectiveConfig(name: str = "grpo", **fields):  # noqa: N802 - the name code and tests build objectives by
    """The objective of option ``name`` of the ``objective`` group (conf/objective/<name>.yaml's ``_target_``, its
    fields updated by ``fields``; :mod:`stepflow.objectives`), not yet bound to a run's ``train`` settings
    (``Objective.bind``): code and tests that build an objective by its option name."""
    from stepflow.core.parts import CONF_DIR as conf
    from stepflow.core.parts import from_option

    return from_option("objective", name, [conf], key="name", **fields)


@dataclass
class RunConfig:
    """The whole ``python -m stepflow.train`` configuration. ``model``, ``reward``, ``trainer``, ``logger`` and
    ``callbacks`` are ``_target_`` nodes (their classes check their own arguments)."""

    seed: int = 0  #: seed of the run (loop.seed follows it)
    ckpt_path: str | None = None  #: resume from <run dir>/checkpoints/last.ckpt
    torch_threads: int | None = None  #: torch CPU threads (null = torch's default; trainer=cpu sets 1)
    experiment_name: str | None = None  #: set by experiment files
    loop: LoopConfig = field(default_factory=LoopConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # chosen by a config group (the defaults list always picks one): data is merged into its class defaults; the
    # parts (sampler, advantage, objective, window; model, reward) are ``_target_`` nodes whose classes check their
    # own fields (stepflow.core.parts.build_part)
    data: DataConfig = MISSING
    sampler: Any = MISSING
    advantage: Any = MISSING
    objective: Any = MISSING
    window: Any = MISSING
    model: Any = None
    reward: Any = None
    trainer: Any = None
    logger: Any = field(default_factory=dict)
    callbacks: Any = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------------------------
# the other entry points: python -m stepflow.pretrain / evaluate / serve_reward (conf/<name>.yaml composes
# <name>_schema and only overrides it). Their schemas live here, not in their modules: register_configs runs when
# stepflow.cli is imported (every composition), and the entry modules import stepflow.cli (a cycle) and, for
# pretrain, Lightning (seconds that composing a serve_reward or evaluate config should not pay).
# ------------------------------------------------------------------------------------------------------------------
def _is_num(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _whole(name: str, v: Any, lo: int, null_ok: bool = False, what: str = "") -> None:
    """``v`` an integer >= ``lo`` (or None when ``null_ok``), else ``<name>: must be an integer >= lo, got v``."""
    if v is None and null_ok:
        return
    _need(_is_int(v) and v >= lo, f"{name}: must be an integer >= {lo}{' or null' if null_ok else ''}{what}, got {v!r}")


def _real(name: str, v: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
          lt: float | None = None, null_ok: bool = False, what: str = "") -> None:
    """``v`` a finite number within the bounds (``math.isfinite``: inf passes a one-sided bound), or None when
    ``null_ok``; booleans and strings are no numbers."""
    if v is None and null_ok:
        return
    lower = f"[{ge:g}" if ge is not None else f"({gt:g}" if gt is not None else None
    upper = f"{le:g}]" if le is not None else f"{lt:g})" if lt is not None else None
    if lower and upper:
        desc = f" in {lower}, {upper}"
    elif lower:
        desc = f" {'>=' if ge is not None else '>'} {lower[1:]}"
    elif upper:
        desc = f" {'<=' if le is not None else '<'} {upper[:-1]}"
    else:
        desc = ""
    ok = (_is_num(v) and math.isfinite(v) and (ge is None or v >= ge) and (gt is None or v > gt)
          and (le is None or v <= le) and (lt is None or v < lt))
    _need(ok, f"{name}: must be a finite number{desc}{' or null' if null_ok else ''}{what}, got {v!r}")


def _flag(name: str, v: Any) -> None:
    _need(isinstance(v, bool), f"{name}: must be true or false, got {v!r}")


def _choice(name: str, v: Any, choices: tuple, what: str = "") -> None:
    names = ", ".join("null" if c is None else str(c) for c in choices)
    _need(v in choices and not isinstance(v, bool), f"{name}: must be one of {names}{what}, got {v!r}")


def _path(name: str, v: Any, what: str = "") -> None:
    _need(v is None or isinstance(v, str), f"{name}: must be a path or null{what}, got {v!r}")


# ------------------------------------------------------------------------------------------------ pretrain
#: the qk_norm kinds diffusers' joint attention (SD3Transformer2DModel, both streams) builds
QK_NORMS = (None, "rms_norm", "layer_norm", "fp32_layer_norm")
#: the training-time distributions of stepflow.pretrain.sample_t
T_SAMPLINGS = ("logit_normal", "uniform")
_DURATION = re.compile(r"[0-9]+:[0-9]{1,2}:[0-9]{1,2}:[0-9]{1,2}")


@dataclass
class PretrainArchConfig:
    """The base model's architecture: the :class:`~stepflow.policies.shapes.ShapesConfig` fields that
    ``ShapesPolicy.build`` takes, except ``vocab`` / ``max_length`` (they come from the world). Checked by
    ``ShapesConfig.check`` itself (its rules stay its own; errors name ``arch.<field>``), plus ``qk_norm``."""

    image_size: int = 32  #: pixels per side
    patch_size: int = 4  #: 64 image tokens
    num_layers: int = 4  #: transformer blocks
    num_attention_heads: int = 4
    attention_head_dim: int = 32  #: hidden 128
    qk_norm: str | None = "rms_norm"  #: query/key normalisation of the attention (null = none)
    text_dim: int = 64  #: width of the word-level text encoder
    text_layers: int = 2
    text_heads: int = 4
    pooled_dim: int = 64  #: pooled text embedding
    shift: float = 1.0  #: sampling time-grid shift (3.0 measured worse at 10 steps for this model)
    prediction: str = "x"  #: the transformer predicts x0; velocity() returns (x_t - x0) / max(t, t_eps) (JiT)
    t_eps: float = 0.05  #: the floor on t in the x-prediction velocity
    init: str = "dit"  #: adaLN-Zero init (dit | default)

    def __post_init__(self) -> None:
        from stepflow.policies.shapes import ShapesConfig

        _choice("arch.qk_norm", self.qk_norm, QK_NORMS)
        ShapesConfig(**asdict(self)).check(prefix="arch.")


@dataclass
class PretrainDataConfig:
    """The endless stream of rendered prompts (``stepflow.pretrain.ShapesStream``)."""

    batch_size: int = 16  #: small batches learn much faster per CPU-second here than 64
    categories: list[str] | None = None  #: prompt categories to draw from (null = all six, round-robin)
    empty_prompt_prob: float = 0.1  #: prompt dropout, for classifier-free guidance
    num_workers: int = 0  #: DataLoader worker processes (0 = render in the training process)

    def __post_init__(self) -> None:
        _whole("batch_size", self.batch_size, 1)
        if self.categories is not None:
            from stepflow.shapes.prompts import CATEGORIES

            cats = list(self.categories) if isinstance(self.categories, (list, tuple)) else None
            _need(cats is not None, f"categories: must be a list of categories or null (all), got {self.categories!r}")
            _need(bool(cats), "categories: empty list draws nothing; use null for all six")
            bad = [c for c in cats if c not in CATEGORIES]
            _need(not bad, f"categories: unknown {bad[0]!r}; use some of {', '.join(CATEGORIES)}" if bad else "")
            self.categories = cats
        _real("empty_prompt_prob", self.empty_prompt_prob, ge=0.0, le=1.0)
        _whole("num_workers", self.num_workers, 0)


@dataclass
class PretrainObjectiveConfig:
    """The rectified-flow objective's training times t."""

    t_sampling: str = "logit_normal"  #: logit_normal (sigmoid of N(logit_mean, logit_std), SD3) | uniform
    logit_mean: float = 0.0  #: logit_normal only
    logit_std: float = 1.0  #: logit_normal only

    def __post_init__(self) -> None:
        _choice("t_sampling", self.t_sampling, T_SAMPLINGS)
        _real("logit_mean", self.logit_mean)
        _real("logit_std", self.logit_std, gt=0.0)


@dataclass
class PretrainOptimConfig:
    """AdamW with linear warm-up and cosine decay to ``min_lr_ratio`` · lr."""

    lr: float = 1.0e-3  #: peak learning rate
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  #: AdamW betas
    weight_decay: float = 0.01  #: of the weight matrices (embeddings, norms and biases: none)
    warmup_steps: int = 200  #: linear warm-up steps
    min_lr_ratio: float = 0.1  #: the cosine decays to this fraction of lr
    grad_clip: float = 1.0  #: gradient-norm clipping (0 = off)

    def __post_init__(self) -> None:
        _real("lr", self.lr, gt=0.0)
        betas = list(self.betas) if isinstance(self.betas, (list, tuple)) else None
        _need(betas is not None and len(betas) == 2 and all(_is_num(b) and 0 <= b < 1 for b in betas),
              f"betas: must be two floats in [0, 1), got {self.betas!r}")
        self.betas = [float(b) for b in betas]
        _real("weight_decay", self.weight_decay, ge=0.0)
        _whole("warmup_steps", self.warmup_steps, 0)
        _real("min_lr_ratio", self.min_lr_ratio, ge=0.0, le=1.0)
        _real("grad_clip", self.grad_clip, ge=0.0, what=" (0 = off)")


@dataclass
class PretrainEmaConfig:
    """The EMA of the weights that is evaluated and saved (warm-up: d_n = min(decay, (1+n)/(10+n)))."""

    decay: float = 0.999  #: decay d

    def __post_init__(self) -> None:
        _real("decay", self.decay, ge=0.0, lt=1.0)


@dataclass
class PretrainTrainerConfig:
    """The Lightning Trainer (on the CPU, one device)."""

    max_steps: int = 14000  #: optimizer steps (also the cosine schedule's length)
    max_time: str | None = "00:00:42:00"  #: DD:HH:MM:SS wall-clock cap (null = none)
    log_every_n_steps: int = 50
    checkpoint_every_n_steps: int = 1000  #: checkpoints/last.ckpt every N steps (resume=<it> continues)
    progress_bar: bool = True
    progress_refresh: int = 100  #: steps between progress-bar updates
    fast_dev_run: bool = False  #: Lightning's one-batch smoke run

    def __post_init__(self) -> None:
        _whole("max_steps", self.max_steps, 1)
        _need(self.max_time is None or (isinstance(self.max_time, str) and bool(_DURATION.fullmatch(self.max_time))),
              f"max_time: must be DD:HH:MM:SS (e.g. 00:12:00:00) or null (no cap), got {self.max_time!r}")
        _whole("log_every_n_steps", self.log_every_n_steps, 1)
        _whole("checkpoint_every_n_steps", self.checkpoint_every_n_steps, 1)
        _flag("progress_bar", self.progress_bar)
        _whole("progress_refresh", self.progress_refresh, 1)
        _flag("fast_dev_run", self.fast_dev_run)


@dataclass
class PretrainEvalConfig:
    """Periodic strict-GenEval evaluation of the EMA weights (10-step Euler ODE); each is saved as a candidate."""

    every_n_steps: int = 1000  #: evaluate (and save a candidate) every N steps and at the end (0 = never)
    split: str = "eval"  #: the world's prompt file to evaluate on (eval | train)
    max_prompts: int | None = 192  #: balanced subset of the eval prompts for the periodic evaluation (null = all)
    num_steps: int = 10  #: ODE steps
    guidance: float = 1.0  #: CFG scale (1 = off)
    seed: int = 0  #: initial noise of sample i depends only on (seed, i)
    save_grid: bool = True  #: an image grid per evaluation (grids/step<N>.png)
    grid_per_category: int = 4  #: samples of each category in that grid

    def __post_init__(self) -> None:
        _whole("every_n_steps", self.every_n_steps, 0, what=" (0 = never)")
        _choice("split", self.split, ("eval", "train"))
        _whole("max_prompts", self.max_prompts, 1, null_ok=True, what=" (null = all)")
        _whole("num_steps", self.num_steps, 1)
        _real("guidance", self.guidance, ge=1.0, what=" (1 = no CFG)")
        _whole("seed", self.seed, 0)
        _flag("save_grid", self.save_grid)
        _whole("grid_per_category", self.grid_per_category, 1)


@dataclass
class PretrainSelectConfig:
    """Which candidate to ship (``stepflow.pretrain.select_checkpoint``): re-scored on the full evaluation set, the
    one closest to ``target`` with the overall in [low, high] and every category above ``min_category``."""

    enabled: bool = True  #: re-score, select (and export) at the end
    target: float = 0.5  #: the overall strict-GenEval score to aim for (room left for RL)
    low: float = 0.3  #: lowest overall score that qualifies
    high: float = 0.7  #: highest overall score that qualifies
    min_category: float = 0.05  #: every category must score above this (< 0: no floor)
    #: prefer the latest checkpoint within target +- tolerance (null: the closest to target)
    tolerance: float | None = 0.1
    rescore_top_k: int = 8  #: the latest k checkpoints scoring within [low, high] +- rescore_margin on the subset ...
    rescore_margin: float = 0.1
    rescore_max_prompts: int | None = None  #: ... are re-scored on the full eval set (null = all prompts)

    def __post_init__(self) -> None:
        _flag("enabled", self.enabled)
        for name in ("target", "low", "high"):
            _real(name, getattr(self, name), ge=0.0, le=1.0, what=" (a strict-GenEval score)")
        _need(self.low <= self.high, f"low: must be <= select.high={self.high:g}, got {self.low!r}")
        _real("min_category", self.min_category, lt=1.0, what=" (every category must score above it)")
        _real("tolerance", self.tolerance, ge=0.0, null_ok=True, what=" (null = the closest to target)")
        _whole("rescore_top_k", self.rescore_top_k, 1)
        _real("rescore_margin", self.rescore_margin, ge=0.0)
        _whole("rescore_max_prompts", self.rescore_max_prompts, 1, null_ok=True, what=" (null = all)")


@dataclass
class PretrainConfig:
    """The whole ``python -m stepflow.pretrain`` configuration (``conf/pretrain.yaml``)."""

    seed: int = 0  #: seed of the weights' init, the data stream and the evaluations' noise
    out_dir: str | None = None  #: null = the Hydra run dir
    torch_threads: int | None = 1  #: torch CPU threads (one per process: docs/results.md, "Why the defaults")
    finalize_only: str | None = None  #: a finished run dir: only re-score, select (and export) its checkpoints
    resume: str | None = None  #: a Lightning checkpoint (<run dir>/checkpoints/last.ckpt) to continue from
    export: bool = False  #: write the selected checkpoint (+ model card) to export_dir
    export_dir: str | None = None  #: null = stepflow/assets/shapes_base
    arch: PretrainArchConfig = field(default_factory=PretrainArchConfig)
    data: PretrainDataConfig = field(default_factory=PretrainDataConfig)
    objective: PretrainObjectiveConfig = field(default_factory=PretrainObjectiveConfig)
    optim: PretrainOptimConfig = field(default_factory=PretrainOptimConfig)
    ema: PretrainEmaConfig = field(default_factory=PretrainEmaConfig)
    trainer: PretrainTrainerConfig = field(default_factory=PretrainTrainerConfig)
    eval: PretrainEvalConfig = field(default_factory=PretrainEvalConfig)
    select: PretrainSelectConfig = field(default_factory=PretrainSelectConfig)

    def __post_init__(self) -> None:
        _whole("seed", self.seed, 0)
        _whole("torch_threads", self.torch_threads, 1, null_ok=True, what=" (null = torch's default)")
        for name in ("out_dir", "finalize_only", "resume", "export_dir"):
            _path(name, getattr(self, name))
        _flag("export", self.export)
        _need(not (self.export and isinstance(self.select, PretrainSelectConfig) and not self.select.enabled),
              "export: exports the checkpoint the selection picks, and select.enabled=false picks none; set "
              "select.enabled=true or export=false")
        _need(not (self.finalize_only and self.resume), "finalize_only: only re-scores and selects a finished run's "
              "checkpoints, so resume would be ignored; give one of finalize_only / resume")


# ------------------------------------------------------------------------------------------------ evaluate
@dataclass
class EvaluateSamplerConfig:
    """The deterministic Euler ODE that ``python -m stepflow.evaluate`` samples with."""

    num_steps: int = 10  #: Euler ODE steps on the policy's time grid
    guidance: float | None = None  #: classifier-free guidance scale (1 = off; null = the model's eval_guidance, else 1)

    def __post_init__(self) -> None:
        _whole("num_steps", self.num_steps, 1)
        _real("guidance", self.guidance, ge=1.0, null_ok=True, what=" (1 = no CFG; null = the model's eval_guidance)")


@dataclass
class EvaluateGridConfig:
    """The PNG grids, one per category (``samples_<category>.png``)."""

    per_category: int = 16  #: samples per category PNG (0 = no grids)
    ncol: int = 8  #: images per row

    def __post_init__(self) -> None:
        _whole("per_category", self.per_category, 0, what=" (0 = no grids)")
        _whole("ncol", self.ncol, 1)


@dataclass
class EvaluateConfig:
    """The whole ``python -m stepflow.evaluate`` configuration (``conf/evaluate.yaml``). ``model`` is a
    ``_target_`` node (its class checks its own arguments)."""

    #: a model directory (ShapesPolicy.save_pretrained) or a stepflow.pretrain .ckpt (EMA weights)
    ckpt_path: str | None = None
    lora_path: str | None = None  #: a LoRA: diffusers save_lora_weights dir, peft adapter dir, or a .safetensors file
    #: null/eval/train = the world's prompt files; or a .jsonl (records with "prompt") / .txt path
    prompt_file: str | None = None
    sampler: EvaluateSamplerConfig = field(default_factory=EvaluateSamplerConfig)
    seed: int = 0  #: initial noise of sample i depends only on (seed, i)
    num_per_prompt: int = 1  #: samples per prompt
    max_prompts: int | None = None  #: a category-balanced subset of N prompt lines (null = all)
    batch_size: int = 64  #: samples per sampling batch
    torch_threads: int | None = None  #: null = torch's default
    out_dir: str | None = None  #: null = the Hydra run dir
    grid: EvaluateGridConfig = field(default_factory=EvaluateGridConfig)
    model: Any = None  #: chosen by the model group (model=shapes)

    def __post_init__(self) -> None:
        for name in ("ckpt_path", "lora_path", "prompt_file", "out_dir"):
            _path(name, getattr(self, name))
        _whole("seed", self.seed, 0)
        _whole("num_per_prompt", self.num_per_prompt, 1)
        _whole("max_prompts", self.max_prompts, 1, null_ok=True, what=" (null = all)")
        _whole("batch_size", self.batch_size, 1)
        _whole("torch_threads", self.torch_threads, 1, null_ok=True, what=" (null = torch's default)")


# ------------------------------------------------------------------------------------------------ serve_reward
@dataclass
class Limits:
    """What one request may make the reward server read and decode (``python -m stepflow.serve_reward``); every
    field is checked by :func:`check_limit` when the limits are made (a limit of 0, -1, inf or nan is a
    StepflowError naming it). The counts are integers (an integral float, ``max_images=4.0``, is taken as one)."""

    max_body_mb: float = 256.0  #: request body (base64 JSON), from Content-Length, checked before the body is read
    max_images: int | float = 256  #: images per request (clients split batches by reward.request_batch_size, 64)
    #: width x height of one image (2048^2), read from its PNG/JPEG header before decoding. The reward lock is held
    #: while a request is scored, which grows with its pixels; this bounds one image's share (docs/results.md,
    #: "Why the defaults")
    max_image_pixels: int | float = 2048 * 2048
    #: all images of one request (64 x 1024^2; 768 MB once decoded to float32); also bounds how long one request
    #: holds the reward lock
    max_request_pixels: int | float = 64 * 1024**2
    decode_workers: int | float = 2  #: requests decoded at the same time (the reward lock is never held while decoding)
    max_inflight: int | float = 16  #: requests handled at the same time; more answer 503 (clients retry)
    read_timeout_s: float = 60.0  #: seconds: a connection that sends nothing for this long is closed (408)

    def __post_init__(self) -> None:
        for f in fields(Limits):
            setattr(self, f.name, check_limit(f.name, getattr(self, f.name)))
        if self.max_request_pixels < self.max_image_pixels:
            raise StepflowError(f"max_request_pixels: must be >= max_image_pixels={self.max_image_pixels} (one image's "
                                f"limit), got {self.max_request_pixels}: a request of one image the server takes "
                                "would be refused; raise max_request_pixels or lower max_image_pixels")

    @property
    def max_body(self) -> int:
        return int(self.max_body_mb * 2**20)


#: what each limit bounds, for the fix of its error message
_LIMIT_WHAT = {
    "max_body_mb": "MB of request body", "max_images": "images per request",
    "max_image_pixels": "pixels per image, e.g. 4194304 for 2048^2", "max_request_pixels": "pixels per request",
    "decode_workers": "requests decoded at once", "max_inflight": "requests handled at once",
    "read_timeout_s": "seconds a connection may stay silent",
}


def check_limit(name: str, value: Any) -> int | float:
    """A limit of :class:`Limits` as its type: an integer >= 1 for counts (an integral float is accepted), a finite
    number > 0 for ``max_body_mb`` / ``read_timeout_s``. A limit that refuses every request (``max_images=0``,
    ``max_image_pixels=-1``), drops every connection (``read_timeout_s=-1``) or is no number (inf, nan, a string,
    a bool) raises a one-line :class:`StepflowError` naming ``name`` and its default."""
    default = Limits.__dataclass_fields__[name].default
    integer = isinstance(default, int)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if integer:
        ok = ok and float(value).is_integer() and value >= 1
    else:
        ok = ok and value > 0
    if not ok:
        what = "an integer >= 1" if integer else "a finite number > 0"
        raise StepflowError(f"{name}: must be {what}, got {value!r}; give {name}=<{_LIMIT_WHAT[name]}> "
                            f"(default {default if integer else f'{default:g}'})")
    return int(value) if integer else float(value)


def check_port(port: Any) -> int:
    """``port`` as an int in 0..65535 (0: the OS picks a free one); a one-line StepflowError otherwise."""
    if isinstance(port, bool) or not isinstance(port, numbers.Integral) or not 0 <= port <= 65535:
        raise StepflowError(f"port: must be an integer in 0..65535, got {port!r}; give port=18085 (or any free port "
                            f"number), or port=0 for a free one")
    return int(port)


def check_host(host: Any) -> str:
    """``host`` as a non-empty string (whether it resolves and can be bound: ``stepflow.serve_reward.check_bind``,
    at start); a one-line StepflowError otherwise."""
    if not isinstance(host, str) or not host.strip():
        raise StepflowError(f"host: must be a host name or IP address, got {host!r}; give host=127.0.0.1 (this "
                            f"machine only) or host=0.0.0.0 (every interface)")
    return host


@dataclass
class ServeRewardConfig(Limits):
    """The whole ``python -m stepflow.serve_reward`` configuration (``conf/serve_reward.yaml``): the request
    :class:`Limits` (flat: ``max_images=...``), where to serve, and the ``reward`` (a ``_target_`` node, chosen by
    ``reward=<name>``; its class checks its own arguments)."""

    host: str = "127.0.0.1"  #: 0.0.0.0 to accept other machines (no authentication: trusted networks only)
    port: int = 18085  #: 0 = a free one
    reward: Any = None  #: chosen by the reward group (reward=<name>, required)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.host = check_host(self.host)
        self.port = check_port(self.port)

    @property
    def limits(self) -> Limits:
        """The request limits alone."""
        return Limits(**{f.name: getattr(self, f.name) for f in fields(Limits)})


#: the schema each entry point's conf/<name>.yaml composes first (stored as ``<name>_schema``)
SCHEMAS = {"train": RunConfig, "pretrain": PretrainConfig, "evaluate": EvaluateConfig,
           "serve_reward": ServeRewardConfig}


def register_configs() -> None:
    """Store each entry point's schema (:data:`SCHEMAS`: ``train_schema`` = :class:`RunConfig`,
    ``pretrain_schema``, ``evaluate_schema``, ``serve_reward_schema``) in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    for name, schema in SCHEMAS.items():
        ConfigStore.instance().store(name=f"{name}_schema", node=schema)


@contextlib.contextmanager
def composer(conf_dir: str | Path = CONF_DIR):
    """Hydra's compose API on the package's ``conf/`` for a block of compositions (initialised once): yields
    ``compose(config_name, overrides=(), **kwargs)``. The one place stepflow composes a config outside an entry point
    (the CLI's up-front checks, reward names, experiments, tests: :func:`compose`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            yield lambda config_name, overrides=(), **kw: hydra_compose(config_name=config_name,
                                                                        overrides=list(overrides), **kw)
    finally:
        GlobalHydra.instance().clear()


def compose(config_name: str | None, overrides=(), conf_dir: str | Path = CONF_DIR, **kwargs):
    """``conf/<config_name>.yaml`` composed with ``overrides``, as the entry point composes it (minus the run;
    ``return_hydra_config=True`` keeps the ``hydra`` node)."""
    with composer(conf_dir) as c:
        return c(config_name, overrides, **kwargs)


def _groups(cls: type) -> dict[str, type]:
    """The fields of dataclass ``cls`` that are dataclasses themselves (its nested groups: ``optim``, ``sampler``)."""
    if not dataclasses.is_dataclass(cls):
        return {}
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)
            if isinstance(hints.get(f.name), type) and dataclasses.is_dataclass(hints[f.name])}


def to_config(node: DictConfig, cls: type | None = None, prefix: str = ""):
    """A config node as its dataclass (``__post_init__`` checks run); a failed check names ``<prefix>.<field>``.

    A dataclass with nested groups (:class:`PretrainConfig`'s ``optim``, ...) is built group by group, so that a
    nested field's error is named in full (``optim.lr: must be ...``); an instance of ``cls`` is returned as is."""
    try:
        if cls is not None and isinstance(node, cls):
            return node
        groups = _groups(cls) if cls is not None else {}
        if groups:
            kwargs = {}
            for key in node:
                value = node[key]
                if key in groups and value is not None:
                    kwargs[key] = to_config(value, groups[key], f"{prefix}.{key}" if prefix else str(key))
                else:
                    kwargs[key] = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value
            return cls(**kwargs)
        if cls is not None and not OmegaConf.is_config(node):
            return cls(**node)
        obj = OmegaConf.to_object(node)
        return cls(**obj) if cls is not None and isinstance(obj, dict) else obj
    except (TypeError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StepflowError(msg if not prefix or msg.startswith(prefix + ".") else f"{prefix}.{msg}") from None
