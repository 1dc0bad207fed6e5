"""FSDP2 for the policy's transformer: the strategy (``trainer=fsdp`` / ``fsdp_cpu``) and the sharding it applies.

:class:`FSDP2Strategy` is Lightning's ``ModelParallelStrategy`` with a data-parallel mesh over every rank (no tensor
parallelism) and the sharding options of stepflow's configs; ``GRPOModule.configure_model`` calls
:func:`shard_transformer` on the trained transformer (and on the frozen full-fine-tuning reference). The frozen
text encoders, VAE and reward models are not sharded: they only run forward, replicated on every rank as under DDP.

Per-block ``fully_shard`` (each entry of the transformer's ``*blocks`` lists, then the transformer itself, as
torchtitan does): a block's parameters are all-gathered for its forward and freed after it, gradients are
reduce-scattered, so a rank holds ``1/world`` of the weights, gradients and AdamW state. The same code runs on GPUs
(NCCL) and on the CPU (gloo). Checkpoints hold full state dicts by default (one file, loadable onto any world size);
``save_distributed_checkpoint=true`` writes torch's distributed checkpoint directory instead.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

from stepflow.core.dist import full_tensor, local_shard_of  # noqa: F401  (re-exported: the tensors of shards)

__all__ = ["FSDP2Strategy", "shard_transformer", "blocks_of", "full_trained_state", "is_sharded", "same_graph_as_fsdp"]

def _dtype(name: str | None, field: str) -> torch.dtype | None:
    """``None`` (the parameters' own dtype) or :func:`stepflow.policies.pipeline.resolve_dtype`'s dtype, errors named by
    ``field``."""
    if name is None:
        return None
    from stepflow.policies.pipeline import resolve_dtype

    try:
        return resolve_dtype(name)
    except ValueError:
        raise ValueError(f"{field}: must be one of bfloat16, float16, float32 (or null), got {name!r}") from None


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all ranks (``num_nodes × devices``), the transformer sharded per block.

    Args:
        param_dtype / reduce_dtype: FSDP2's ``MixedPrecisionPolicy`` (null: the parameters' own dtype); e.g.
            ``bfloat16`` / ``float32`` computes in bf16 and reduce-scatters gradients in fp32.
        reshard_after_forward: free a block's gathered parameters after its forward (``ZeRO-3``-like; ``false``
            keeps them until the backward, ``ZeRO-2``-like, more memory and less communication).
        reduce_every_backward: ``true``: reduce-scatter the gradients after every backward pass (only the shard
            is kept: the memory FSDP2 is for); ``false``: each rank accumulates its gradients unsharded and they are
            reduce-scattered once per optimizer step (a whole gradient per rank, which LoRA's is small enough for; the
            result equals DDP's to the last bit, and the reduction runs once instead of once per micro-batch and
            step); ``auto`` (default): ``true`` for full fine-tuning, ``false`` for LoRA.
        save_distributed_checkpoint: ``false`` (default): one full-state checkpoint file written by rank 0;
            ``true``: a torch distributed-checkpoint directory, each rank writing its shards.
        process_group_backend / timeout: as Lightning's (``gloo`` on the CPU, ``nccl`` on GPUs by default).
    """

    def __init__(self, param_dtype: str | None = None, reduce_dtype: str | None = None,
                 reshard_after_forward: bool = True, reduce_every_backward: bool | str = "auto",
                 save_distributed_checkpoint: bool = False,
                 process_group_backend: str | None = None, timeout: Any = None, **kwargs: Any):
        from datetime import timedelta

        extra = {"timeout": timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))} \
            if timeout is not None else {}
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, **extra, **kwargs)
        self.param_dtype = _dtype(param_dtype, "trainer.strategy.param_dtype")
        self.reduce_dtype = _dtype(reduce_dtype, "trainer.strategy.reduce_dtype")
        self.reshard_after_forward = bool(reshard_after_forward)
        if reduce_every_backward not in (True, False, "auto"):
            raise ValueError("trainer.strategy.reduce_every_backward: must be true, false or auto, got "
                             f"{reduce_every_backward!r}")
        self.reduce_every_backward = reduce_every_backward

    def setup_environment(self) -> None:
        # a data-parallel mesh over every rank: Lightning's "auto" would make it num_nodes and tensor-parallel inside
        # the node; stepflow shards data only
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    @property
    def mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def shard(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` (a transformer) per block over the data-parallel mesh."""
        return shard_transformer(module, self.device_mesh["data_parallel"], self.mp_policy, self.reshard_after_forward)


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one: the entries of every ``nn.ModuleList`` child whose name ends in
    ``blocks`` (SD3's ``transformer_blocks``, FLUX's and its ``single_transformer_blocks``, Qwen-Image's), searched one
    level down as well (a compiled or wrapped model)."""
    found = []
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList) and name.endswith("blocks"):
            found.extend(child)
    if not found:
        for child in module.children():
            if not isinstance(child, nn.ModuleList):
                found.extend(b for n, c in child.named_children() if isinstance(c, nn.ModuleList) and n.endswith("blocks")
                             for b in c)
    return found


def shard_transformer(module: nn.Module, mesh, mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` each block of ``module`` (:func:`blocks_of`), then ``module`` itself (the embeddings and the
    output layers; the root keeps its last group's parameters gathered after the forward as FSDP2 does). In place;
    parameter names do not change (LoRA and checkpoint keys stay those of the unwrapped model)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in blocks_of(module):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return module


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds FSDP2 (DTensor) parameters."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def shard_module(module, strategy) -> None:
    """FSDP2 (``trainer=fsdp``), from the GRPOModule's ``configure_model``: shard the transformer per block, and the
    frozen full-fine-tuning reference the same way; then the EMA is rebuilt on the sharded parameters (the optimizer
    is built after this hook) and the objective's copies re-attached. Other strategies: nothing to do."""
    from stepflow.core.ema import ParamEMA

    policy = module.policy
    if not hasattr(strategy, "shard") or is_sharded(policy.transformer):
        return
    strategy.shard(policy.transformer)
    ref = getattr(policy, "_ref_copy", None)
    if ref:
        strategy.shard(ref[0])
    if module.ema is not None:  # fully_shard replaced the parameters: track the new (sharded) ones
        module.ema = ParamEMA(policy.trainable_parameters(), module.ema.decay, module.ema.update_every)
        module.learner.on_optimizer_step = module.ema.step
    module.objective.attach(list(policy.trainable_parameters()))  # its copies too


def full_trained_state(policy, full: bool) -> dict[str, Tensor] | None:
    """The trained transformer weights gathered from the shards (every rank calls it; rank 0 gets the tensors, on the
    CPU): every weight when ``full`` (fine-tuned fully), else the LoRA weights (keys as ``transformer.state_dict()``).
    None when the transformer is not sharded."""
    net = policy.transformer
    if not is_sharded(net):
        return None
    if full:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {n: full_tensor(p.detach()).cpu() for n, p in net.named_parameters() if "lora_" in n}


class _BlockInput(torch.autograd.Function):
    """Identity; in the backward, the gradients of a block's uses of an input are summed before they leave it."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g


def _wrap_inputs(module, args, kwargs):
    def wrap(v):
        return _BlockInput.apply(v) if isinstance(v, Tensor) and v.requires_grad else v

    return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}


def same_graph_as_fsdp(module: nn.Module) -> None:
    """Give every block of ``module`` (:func:`blocks_of`) the backward structure FSDP2's sharding gives it: each
    tensor input that needs a gradient passes an identity node, so the gradients of the block's uses of it (SD3's
    ``temb`` feeds two norms per block) are summed inside the block before the sum leaves it. Without this a
    gradient that many blocks share adds up in another order under FSDP2 than under DDP / one process, the last
    bits of the time-embedding gradients differ, and full fine-tuning drifts apart. The values are unchanged; a
    second application (FSDP2's own) adds nothing. Called on every trained transformer whatever the strategy."""
    for block in blocks_of(module):
        if not getattr(block, "_stepflow_block_inputs", False):
            block.register_forward_pre_hook(_wrap_inputs, with_kwargs=True)
            block._stepflow_block_inputs = True
