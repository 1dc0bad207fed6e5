"""The training configuration: typed dataclasses, registered with Hydra as structured configs (one source of defaults).

``conf/train.yaml`` composes :class:`RunConfig` (stored as ``train_schema``) and only overrides it; every field has its
default and its check here. The defaults are sized for the embedded world on a CPU (60 iterations of 4 prompts × 16
samples, T = 10, T′ = 2, lr 1e-3); ``experiment=paper_base`` sets the paper's protocol. A model's own preferences (the
shapes world trains only step 0 with the ``eta_s`` DDIM schedule) live in ``conf/recipe/<model>.yaml``, which the
default composes for the chosen model.

A field error is a :class:`ValueError` whose message starts with the field's name; :func:`to_config` adds the
group (``loop.iterations: must be >= 1, got -1``) and the CLI prints it as one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from stepflow.advantage import AdvantageConfig
from stepflow.sde import SamplerConfig
from stepflow.window import WindowConfig

__all__ = ["LoopConfig", "TrainConfig", "EvalConfig", "EmaConfig", "LoraConfig", "DataConfig", "RunConfig",
           "register_configs", "to_config", "KL_MODES"]

KL_MODES = ("exact", "flow_grpo_parity")


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
    #: ceil(T′·t) substeps per state (about the same substep size everywhere; 3 seeds of the miniature: 0.461 vs
    #: 0.444 held-out GenEval with T′ fixed, at 0.6x its cost); the paper's fixed T′: false (paper_base, mini_base)
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

    def __post_init__(self) -> None:
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
    #: step indices to train (list); None = every step with noise std > 0; ``auto`` = every noisy step, weighted by
    #: an online estimate of its gradient's signal fraction (stepflow.coherence.StepSignal)
    train_steps: Any = None
    timestep_fraction: float = 1.0  #: train only the first int(T·fraction) steps (Flow-GRPO: 0.99 → 9 of 10)
    micro_batch_size: int = 32  #: samples per forward/backward
    updates_per_iter: int = 1  #: optimizer steps per rollout batch (1 = on-policy; Flow-GRPO uses 2)
    on_policy: bool = False  #: force one optimizer step per rollout (ratio = 1: the KL-regularised policy gradient)
    drop_zero_adv: bool = True  #: skip samples whose advantages are 0 at every step
    distill_weight: str = "relu"  #: advantage=distill only: relu | signed | exp
    distill_temperature: float = 1.0  #: advantage=distill, distill_weight=exp only
    #: per-step weighting of the loss: none | noise (TempFlow-GRPO, ∝ the step's noise std) | guard (GRPO-Guard's
    #: noise-normalised ratio) | grad_rms (each step's gradient scaled to the RMS of their norms) | gain_var (∝ the
    #: step's gain variance); stepflow.loss
    weighting: str = "none"
    #: train_steps=auto: every step whose gradient is computed is measured; steps of weight 0 are computed (and
    #: measured again) every N iterations
    auto_every: int = 2
    auto_warmup: int = 3  #: train_steps=auto: measurements of every step before the weights leave uniform

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
        _need(self.distill_weight in ("relu", "signed", "exp"), f"distill_weight: must be relu, signed or exp, got {self.distill_weight!r}")
        _need(self.distill_temperature > 0, f"distill_temperature: must be > 0, got {self.distill_temperature}")
        from stepflow.loss import WEIGHTINGS

        _need(self.weighting in WEIGHTINGS, f"weighting: must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        _need(_is_int(self.auto_every) and self.auto_every >= 1, f"auto_every: must be an integer >= 1, got {self.auto_every!r}")
        _need(_is_int(self.auto_warmup) and self.auto_warmup >= 0, f"auto_warmup: must be an integer >= 0, got {self.auto_warmup!r}")
        if self.train_steps is not None and self.train_steps != "auto":
            steps = list(self.train_steps) if isinstance(self.train_steps, (list, tuple)) else None
            _need(steps is not None, f"train_steps: must be a list of step indices, null or auto, got {self.train_steps!r}")
            bad = [k for k in steps if not _is_int(k)]
            _need(not bad, f"train_steps: step {bad[0]!r} is not an integer index" if bad else "")
            _need(bool(steps), "train_steps: empty list trains nothing; use null for every stochastic step")
            dup = [k for k in steps if steps.count(k) > 1]
            if dup:
                raise ValueError(f"train_steps: step {dup[0]} is listed {steps.count(dup[0])} times (it would be "
                                 "trained that many times per update); list each step once")
            self.train_steps = steps
        self.betas = [float(b) for b in self.betas]
        if self.on_policy:
            self.updates_per_iter = 1


@dataclass
class EvalConfig:
    """Held-out evaluation: deterministic ODE sampling with the EMA weights, scored by the training reward."""

    every: int = 20  #: evaluate every N iterations (and at start and end); 0 = only start and end
    num_steps: int = 10  #: ODE steps
    guidance: float | None = None  #: CFG scale (None = the model's ``eval_guidance``, else 1)
    max_prompts: int | None = None  #: a category-balanced subset of the held-out prompts (None = all)
    seed: int = 1234  #: initial noise of sample i depends only on (seed, i)
    batch_size: int = 128  #: samples per sampling batch
    grid_prompts: int = 24  #: samples in the image grid

    def __post_init__(self) -> None:
        _need(_is_int(self.every) and self.every >= 0, f"every: must be an integer >= 0 (0 = start and end), got {self.every!r}")
        _need(self.num_steps >= 1, f"num_steps: must be >= 1, got {self.num_steps}")
        _need(self.guidance is None or self.guidance >= 1.0, f"guidance: must be >= 1 or null, got {self.guidance}")
        _need(self.max_prompts is None or self.max_prompts >= 1, f"max_prompts: must be >= 1 or null (all), got {self.max_prompts}")
        _need(self.batch_size >= 1 and self.grid_prompts >= 0, "batch_size / grid_prompts: must be >= 1 / >= 0")


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
    # chosen by a config group (the defaults list always picks one): merged into the class defaults
    data: DataConfig = MISSING
    sampler: SamplerConfig = MISSING
    advantage: AdvantageConfig = MISSING
    window: WindowConfig = MISSING
    model: Any = None
    reward: Any = None
    trainer: Any = None
    logger: Any = field(default_factory=dict)
    callbacks: Any = field(default_factory=dict)


def register_configs() -> None:
    """Store :class:`RunConfig` as ``train_schema`` in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=RunConfig)


def to_config(node: DictConfig, cls: type | None = None, prefix: str = ""):
    """A config node as its dataclass (``__post_init__`` checks run); a failed check names ``<prefix>.<field>``."""
    try:
        if cls is not None and not OmegaConf.is_config(node):
            return cls(**node)
        obj = OmegaConf.to_object(node)
        return cls(**obj) if cls is not None and isinstance(obj, dict) else obj
    except (TypeError, ValueError) as e:
        from stepflow.cli import StepflowError

        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StepflowError(msg if not prefix or msg.startswith(prefix + ".") else f"{prefix}.{msg}") from None
