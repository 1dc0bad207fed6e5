"""Lightning's DeepSpeed strategy, made to fit stepflow: CPU runs, gradient clipping, one-file checkpoints.

:class:`DeepSpeedStrategy` is :class:`lightning.pytorch.strategies.DeepSpeedStrategy` with four changes:

- **It runs on the CPU too** (``accelerator: cpu``, gloo, ``DS_ACCELERATOR=cpu``), so the ZeRO path can be tested
  without a GPU. Lightning refuses any accelerator but CUDA, checks that the device indices match the local ranks
  (a CPU device has no index) and hands ``deepspeed.initialize`` ``device_rank=root_device.index`` (None on the CPU).
  On the CPU this class skips the first two and passes the local rank; the process group backend is gloo unless
  one is given. On CUDA these steps are Lightning's own.
- **Gradient clipping comes from** ``max_grad_norm`` (DeepSpeed's ``gradient_clipping``). stepflow optimizes
  manually, where Lightning's ``Trainer(gradient_clip_val=...)`` is not allowed. DeepSpeed clips inside its own
  ``step()`` (the same rule as ``torch.nn.utils.clip_grad_norm_``); ``engine.get_global_grad_norm()`` is the norm
  before clipping. ``gradient_accumulation_steps`` stays 1: stepflow marks the last backward pass before a step
  itself (``engine.set_gradient_accumulation_boundary``).
- **Checkpoints are one file written through the Trainer's CheckpointIO** (stepflow's ``AtomicCheckpointIO``:
  atomic writes, ``torch.load(weights_only=True)`` reads), not DeepSpeed's checkpoint directory, whose loader
  unpickles arbitrary objects. The file has Lightning's usual keys. ``state_dict`` is the LightningModule's own
  ``state_dict()`` (parameters are replicated under ZeRO stage 1 and 2). ``optimizer_states[0]`` holds the ZeRO
  optimizer's state of every rank (fp32 master partitions, Adam moments, loss scale), gathered to rank 0 with
  every rank taking part, with DeepSpeed's non-plain objects replaced by plain values (loss scaler -> its
  attributes, ZeroStageEnum -> int, the parameter slice map -> dropped). Loading restores the module weights and
  the optimizer state exactly.
- **ZeRO stage 3 is refused** when the strategy is built (its parameters are sharded; stepflow's FSDP2 strategy,
  ``trainer=fsdp``, covers that case), and so is stage 0 (no ZeRO: that is ``trainer=ddp``).

A checkpoint written on N ranks loads on M ranks (an elastic resume, e.g. ``trainer.devices`` changed between
runs). With the same number of ranks, DeepSpeed's own ``load_state_dict`` restores each rank's partition. With a
different number, the saved partitions are joined and cut again for the new ranks (DeepSpeed's own partitioning
helpers). Both are copies, so the result is exact. The elastic path needs the default parameter layout
(``round_robin_gradients`` and ``parameter_alignment`` off); otherwise it refuses with one line.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.strategy import Strategy

__all__ = ["DeepSpeedStrategy"]

_FORMAT = "stepflow.deepspeed_zero"
_FORMAT_VERSION = 1
_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
_PLAIN_SCALARS = (int, float, bool, str, type(None))


class DeepSpeedStrategy(_LightningDeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` (every constructor argument is passed on) for ZeRO stage 1 and 2 on
    CUDA or the CPU, with one-file checkpoints through the Trainer's CheckpointIO (see the module docstring).

    Args:
        max_grad_norm: clip the global gradient norm to this inside DeepSpeed's step (its ``gradient_clipping``);
            0 = no clipping.
        reduce_every_backward: ``true``: ZeRO-2's own protocol, the gradients reduced into partitions after every
            backward (stepflow marks the last one before a step as the accumulation boundary); ``false``: the
            backward passes of one optimizer step inside ``engine.coalesce_grad_reduction()``, each rank's sum
            reduced once (a whole gradient per rank meanwhile; equal to DDP to the last bit); ``auto`` (default):
            ``true`` for full fine-tuning, ``false`` for LoRA. Read by ``stepflow.core.dist.Dist``.
    """

    def __init__(self, *args: Any, max_grad_norm: float = 0.0, reduce_every_backward: bool | str = "auto",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if reduce_every_backward not in (True, False, "auto"):
            raise ValueError("trainer.strategy.reduce_every_backward: must be true, false or auto, got "
                             f"{reduce_every_backward!r}")
        self.reduce_every_backward = reduce_every_backward
        zero = (self.config or {}).get("zero_optimization") or {}
        stage = int(zero.get("stage", 0) or 0)
        if stage == 3:
            raise ValueError("trainer.strategy.stage: ZeRO stage 3 is not supported by stepflow's DeepSpeed strategy "
                             "yet (use trainer=fsdp for sharded parameters)")
        if stage not in (1, 2):
            raise ValueError(f"trainer.strategy.stage: {stage} (no ZeRO) is not supported by stepflow's DeepSpeed "
                             "strategy (use trainer=ddp; ZeRO stage 1 or 2 here)")
        max_grad_norm = float(max_grad_norm)
        if not max_grad_norm >= 0:
            raise ValueError(f"trainer.strategy.max_grad_norm: must be >= 0 (0 = no clipping), got {max_grad_norm}")
        given = self.config.get("gradient_clipping")
        if given is not None and max_grad_norm > 0 and float(given) != max_grad_norm:
            raise ValueError(f"trainer.strategy.max_grad_norm: {max_grad_norm} differs from gradient_clipping "
                             f"{given} in the DeepSpeed config; set one of them")
        if given is None or max_grad_norm > 0:
            self.config["gradient_clipping"] = max_grad_norm
        self.max_grad_norm = float(self.config["gradient_clipping"])

    # ---------------------------------------------------------------- CPU support

    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def _device_rank(self) -> int | None:
        return self.local_rank if self._on_cpu else self.root_device.index

    def setup_environment(self) -> None:
        if not self._on_cpu:
            return super().setup_environment()  # Lightning's CUDA check, then DDP's environment setup
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
        if name != "cpu":
            raise RuntimeError(f"trainer.accelerator: cpu, but DeepSpeed picked its '{name}' accelerator; set "
                               "DS_ACCELERATOR=cpu before deepspeed is first imported")
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            return super().setup_distributed()
        from lightning.fabric.utilities.seed import reset_seed

        # Lightning's, less _validate_device_index_selection (CPU devices have no index)
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _get_process_group_backend(self) -> str:
        if self._on_cpu:
            return self._process_group_backend or "gloo"
        return super()._get_process_group_backend()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        """Lightning's, with ``device_rank`` the local rank on the CPU."""
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        deepspeed_engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        _norm_as_stepflow(deepspeed_optimizer)
        return deepspeed_engine, deepspeed_optimizer

    def _initialize_deepspeed_inference(self, model) -> None:
        if not self._on_cpu:
            return super()._initialize_deepspeed_inference(model)
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        # Lightning's (stage 3 is refused at construction), with device_rank the local rank
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        remove_module_hooks(model)
        model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()), config=inference_config, model=model,
            optimizer=None, lr_scheduler=None, model_parameters=[], dist_init_required=False)
        self.model = model

    # ---------------------------------------------------------------- checkpoints: save

    def _zero_optimizer(self):
        """The engine's ZeRO stage 1/2 optimizer, or None (no optimizer: validate / predict)."""
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        opt = getattr(self.model, "optimizer", None)
        return opt if isinstance(opt, DeepSpeedZeroOptimizer) else None

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Every rank's ZeRO optimizer state, gathered to rank 0 (a collective: every rank calls it, through
        ``Trainer.save_checkpoint``); other ranks get ``{}``."""
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        zero = self._zero_optimizer()
        if zero is None or opt is not zero:
            raise TypeError(f"stepflow's DeepSpeed strategy cannot save the state of {type(opt).__name__} (the "
                            "engine's ZeRO stage 1/2 optimizer only)")
        local = _plain_zero_state(zero.state_dict())
        world = self.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized() and world > 1:
            gathered: list | None = [None] * world if self.is_global_zero else None
            torch.distributed.gather_object(local, gathered, dst=0)
        else:
            gathered = [local]
        if not self.is_global_zero:
            return {}
        engine = self.deepspeed_engine
        return {
            "format": _FORMAT, "format_version": _FORMAT_VERSION, "world_size": world,
            "zero_stage": int(engine.zero_optimization_stage()),
            "engine": {k: int(getattr(engine, k)) for k in _ENGINE_COUNTERS},
            "partitions": gathered,
        }

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        """One file, written by rank 0 through ``self.checkpoint_io`` (the state was gathered in
        ``optimizer_state``)."""
        filepath = self.broadcast(filepath)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    # ---------------------------------------------------------------- checkpoints: load

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank reads the one file through ``self.checkpoint_io``."""
        if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_dir():
            raise ValueError(f"ckpt_path: {checkpoint_path} is a directory (a DeepSpeed checkpoint?); stepflow's "
                             "DeepSpeed strategy reads the one-file checkpoints it writes")
        return Strategy.load_checkpoint(self, checkpoint_path, weights_only=weights_only)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The module's weights, then DeepSpeed's fp32 master partitions refreshed from them (so a checkpoint
        without optimizer state still trains on from the loaded weights)."""
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        zero = self._zero_optimizer()
        if zero is not None:
            zero.refresh_fp32_params()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        zero = self._zero_optimizer()
        if zero is None:
            raise TypeError("stepflow's DeepSpeed strategy restores the optimizer state of the engine's ZeRO stage 1/2 "
                            "optimizer only")
        if len(states) != 1 or not isinstance(states[0], Mapping) or states[0].get("format") != _FORMAT:
            raise ValueError("ckpt_path: its optimizer state was not written by stepflow's DeepSpeed strategy with "
                             "ZeRO stage 1/2; resume with the strategy that wrote it")
        saved = states[0]
        partitions = [_rebuild_zero_state(sd, zero) for sd in saved["partitions"]]
        dp_world = torch.distributed.get_world_size(zero.dp_process_group) if torch.distributed.is_initialized() else 1
        if len(partitions) == dp_world:
            zero.load_state_dict(partitions, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            _load_elastic(zero, partitions)
        engine = self.deepspeed_engine
        for k, v in (saved.get("engine") or {}).items():
            if k in _ENGINE_COUNTERS:
                setattr(engine, k, int(v))


# -------------------------------------------------------------------- plain state (weights_only=True)


def _plain_zero_state(sd: Mapping[str, Any]) -> dict[str, Any]:
    """A ZeRO stage 1/2 ``state_dict()`` with only tensors (copied to the CPU), containers and plain values."""
    from deepspeed.checkpoint.constants import LOSS_SCALER, PARAM_SLICE_MAPPINGS, ZERO_STAGE

    out: dict[str, Any] = {}
    for key, value in sd.items():
        if key == PARAM_SLICE_MAPPINGS:  # name -> fragment address: for DeepSpeed's universal checkpoints only
            continue
        if key == LOSS_SCALER:
            value = {k: v for k, v in vars(value).items() if type(v) in _PLAIN_SCALARS}
        elif key == ZERO_STAGE:
            value = int(value)
        out[key] = _plain(value, key)
    return out


def _plain(obj: Any, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if type(obj) in _PLAIN_SCALARS or isinstance(obj, (torch.dtype, torch.Size)):
        return obj
    if type(obj) in (dict, OrderedDict):
        return {k: _plain(v, f"{where}.{k}") for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(f"DeepSpeed optimizer state {where}: {type(obj).__name__} cannot be saved for "
                    "torch.load(weights_only=True)")


def _rebuild_zero_state(sd: Mapping[str, Any], zero) -> dict[str, Any]:
    """Undo :func:`_plain_zero_state`: the live loss scaler with the saved attributes, the ZeroStageEnum."""
    from deepspeed.checkpoint.constants import LOSS_SCALER, ZERO_STAGE
    from deepspeed.runtime.zero.config import ZeroStageEnum

    sd = dict(sd)
    scaler = zero.loss_scaler
    for k, v in (sd.get(LOSS_SCALER) or {}).items():
        if hasattr(scaler, k):
            setattr(scaler, k, v)
    sd[LOSS_SCALER] = scaler
    if ZERO_STAGE in sd:
        sd[ZERO_STAGE] = ZeroStageEnum(int(sd[ZERO_STAGE]))
    return sd


def _load_elastic(zero, partitions: list[dict[str, Any]]) -> None:
    """Load N saved partitions onto this run's M ranks: join each saved per-rank tensor (padding stripped),
    cut it for this rank with DeepSpeed's own partitioning, then load it as this rank's rigid state."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        GROUP_PADDINGS,
        PARAM_ALIGNMENT_PADDINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    first = partitions[0]
    layout_ok = (not getattr(zero, "round_robin_gradients", False)
                 and not any(any(p) for p in zero.round_robin_bit16_padding)
                 and all(not any(any(p) for p in sd.get(PARAM_ALIGNMENT_PADDINGS) or []) for sd in partitions)
                 and all(isinstance(sd[BASE_OPTIMIZER_STATE], Mapping) for sd in partitions))
    if not layout_ok:
        raise ValueError(f"ckpt_path: written on {len(partitions)} ranks, and its ZeRO layout (round_robin_gradients "
                         "/ parameter_alignment / elastic_checkpoint) cannot be re-partitioned; resume on "
                         f"{len(partitions)} ranks")
    zero._load_global_state(first)  # loss scaler, overflow, clip_grad, version check
    n_groups = len(zero.optimizer.param_groups)
    saved_groups = first[BASE_OPTIMIZER_STATE]["param_groups"]
    if len(saved_groups) != n_groups or any(len(sd[SINGLE_PARTITION_OF_FP32_GROUPS]) != n_groups for sd in partitions):
        raise ValueError(f"ckpt_path: its optimizer has {len(saved_groups)} parameter groups, this run's has {n_groups}")
    state: dict[int, dict[str, Any]] = {}
    for i in range(n_groups):
        fp32 = [sd[SINGLE_PARTITION_OF_FP32_GROUPS][i] for sd in partitions]  # unpadded already
        per_rank = []
        for sd in partitions:
            base = sd[BASE_OPTIMIZER_STATE]
            pid = base["param_groups"][i]["params"][0]
            pad = sd[GROUP_PADDINGS][i]
            per_rank.append({k: (v[:v.numel() - pad] if torch.is_tensor(v) and v.dim() > 0 else v)
                             for k, v in base["state"].get(pid, {}).items()})
        keys = per_rank[0].keys()
        if any(r.keys() != keys for r in per_rank):
            raise ValueError("ckpt_path: its ranks hold different optimizer state keys (saved before every rank "
                             "stepped?)")
        group_state = {}
        for k in keys:
            values = [r[k] for r in per_rank]
            is_partition = all(torch.is_tensor(v) and v.shape == f.shape for v, f in zip(values, fp32))
            group_state[k] = zero._partition_base_optimizer_state(k, values, i, is_partition_state=is_partition)
            if torch.is_tensor(group_state[k]):
                group_state[k] = group_state[k].clone()
        if group_state:
            state[i] = group_state
    groups = [{**g, "params": [i]} for i, g in enumerate(saved_groups)]
    zero.optimizer.load_state_dict({"state": state, "param_groups": groups})  # torch: device, dtype, hyperparameters
    zero._restore_from_elastic_fp32_weights(partitions)  # the fp32 masters, joined and cut the same way
    zero._link_all_hp_params()


# -------------------------------------------------------------------- the gradient norm


def _norm_as_stepflow(zero) -> None:
    """Make ZeRO's gradient norm the one ``stepflow.core.dist.clip_grad_norm`` computes: the squares of every partition
    summed in float64, reduced over the ranks in float64, then the square root rounded to fp32. DeepSpeed rounds each
    rank's sum to fp32 before the reduction, so its norm (and the clipping factor made from it) differed from DDP's
    in the last bits, which the training then grows. Only the L2 norm of ZeRO stage 1/2 without CPU offload (the
    path ``scaled_global_norm`` takes) is replaced."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(zero, DeepSpeedZeroOptimizer) or getattr(zero, "_stepflow_norm", False):
        return
    original = zero.get_grad_norm_direct

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or zero.has_moe_layers or zero.model_parallel_world_size > 1:
            return original(gradients, params, norm_type)
        grads = (g for g in gradients if not getattr(g, "_zero_padding", False))
        sq = torch.zeros((), dtype=torch.float64, device=zero.device)
        for g, _ in zip(grads, params):
            sq += torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float64).square()
        torch.distributed.all_reduce(sq, group=zero.dp_process_group)
        total = sq.sqrt().float()
        if not bool(torch.isfinite(total)):
            total = torch.tensor(-1.0, device=zero.device)  # DeepSpeed's invalid-norm sentinel
        return total

    zero.get_grad_norm_direct = get_grad_norm_direct
    zero._stepflow_norm = True
