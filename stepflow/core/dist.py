"""Ranks, gathers and reductions of one GRPO iteration, behind one small object (single process or Lightning).

The iteration's plan is global and identical on every rank; each rank rolls out its contiguous slice of the rows,
the rewards of all rows are gathered in rank order for the group statistics, and each rank trains on its own rows
with gradients summed over ranks (``stepflow.core.update.update``).

Strategies differ in two ways the update must know (:meth:`Dist.from_module`):

- how gradients are reduced: DDP here sums them by hand (:meth:`Dist.all_reduce_grads`); FSDP2 reduce-scatters and
  DeepSpeed reduces with a mean over ranks, so the loss is scaled by the world size (:attr:`Dist.grad_scale`) and the
  gradient is the same under every strategy;
- whether forward and backward passes are collectives: under FSDP2 (all-gather / reduce-scatter) and DeepSpeed
  (reduction at each backward) every rank must run the same passes (:attr:`Dist.lockstep`), so a rank with fewer
  rows runs zero-weight micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Dist", "strategy_kind", "clip_grad_norm", "full_tensor", "local_shard_of"]


@dataclass
class Dist:
    """rank / world of this process and the collectives the iteration needs.

    ``manual_grad_sync``: gradients are all-reduced by :meth:`all_reduce_grads` (DDP, whose own reducer is off
    because backward runs many times per optimizer step); sharded strategies (FSDP, DeepSpeed) reduce their own.
    """

    rank: int = 0
    world: int = 1
    device: torch.device | str = "cpu"
    manual_grad_sync: bool = False
    kind: str = "single"  #: single | ddp | fsdp | deepspeed
    lockstep: bool = False  #: every forward / backward is a collective: ranks run the same passes
    grad_mean: bool = False  #: the strategy averages gradients over ranks (FSDP2, DeepSpeed)
    engine: Any = None  #: the DeepSpeed engine (accumulation boundary, its clipped gradient norm)
    _sync_grads: Any = None  #: FSDP2: callable(bool), whether the next backward reduce-scatters
    coalesce: bool = False  #: DeepSpeed: one reduction per optimizer step (``engine.coalesce_grad_reduction``)
    _gather: Any = None  #: callable Tensor -> (world, ...) Tensor (Lightning's ``all_gather``)
    _barrier: Any = None

    @classmethod
    def from_module(cls, module) -> Dist:
        """The collectives of a LightningModule attached to a Trainer (a single process without one)."""
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            return cls(device=module.device)
        kind = strategy_kind(trainer.strategy)
        strategy = trainer.strategy
        policy = getattr(module, "policy", None)
        net = getattr(policy, "transformer", None)
        once = not reduces_every_backward(strategy, getattr(policy, "finetune", "lora") == "full")
        sync = net.set_requires_gradient_sync if kind == "fsdp" and once and hasattr(net, "set_requires_gradient_sync") else None
        return cls(rank=module.global_rank, world=trainer.world_size, device=module.device,
                   manual_grad_sync=kind == "ddp" and trainer.world_size > 1, kind=kind, lockstep=kind in ("fsdp", "deepspeed"),
                   grad_mean=kind in ("fsdp", "deepspeed"), _gather=module.all_gather, _barrier=strategy.barrier,
                   engine=getattr(strategy, "deepspeed_engine", None) if kind == "deepspeed" else None,
                   _sync_grads=sync, coalesce=kind == "deepspeed" and once)

    @property
    def grad_scale(self) -> float:
        """The factor on every loss that makes the strategy's reduction a sum over ranks (world under a mean)."""
        return float(self.world) if self.grad_mean else 1.0

    def gather_rows(self, x: Tensor) -> Tensor:
        """All ranks' rows in rank order: (B_local, ...) -> (B_global, ...) on the CPU."""
        if self.world == 1:
            return x
        return self._gather(x.to(self.device)).flatten(0, 1).cpu()

    def local_rows(self, x: Tensor) -> Tensor:
        """This rank's contiguous slice of a global (B_global, ...) tensor."""
        per = x.shape[0] // self.world
        return x[self.rank * per:(self.rank + 1) * per]

    def all_sum(self, x: float) -> float:
        if self.world == 1:
            return float(x)
        t = torch.tensor([float(x)], device=self.device)
        torch.distributed.all_reduce(t)
        return float(t)

    def all_sum_tensor(self, x: Tensor) -> Tensor:
        """``x`` summed over ranks (a new tensor on x's device; x itself when single-process)."""
        if self.world == 1:
            return x
        t = x.to(self.device).clone()
        torch.distributed.all_reduce(t)
        return t.to(x.device)

    def all_max_tensor(self, x: Tensor) -> Tensor:
        """``x`` maxed elementwise over ranks."""
        if self.world == 1:
            return x
        t = x.to(self.device).clone()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.to(x.device)

    def all_max(self, x: float) -> float:
        return float(self.all_max_tensor(torch.tensor([float(x)], dtype=torch.float64)))

    def union(self, names: Iterable[str]) -> list[str]:
        """The sorted union of every rank's ``names`` (every rank must call it at the same point)."""
        mine = sorted(set(names))
        if self.world == 1:
            return mine
        everyone: list = [None] * self.world
        torch.distributed.all_gather_object(everyone, mine)
        return sorted({n for names_r in everyone for n in names_r})

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any rank (every rank must call it at the same point)."""
        if self.world == 1:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item() > 0)

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over ranks (no-op unless :attr:`manual_grad_sync`)."""
        if not self.manual_grad_sync:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)

    def stop_requested(self) -> bool:
        """Whether any rank was asked to stop (every rank must call it at the same point); every rank then holds the
        same reason (the signal's name, though it reached one process)."""
        from stepflow.core import stop

        return stop.agree(int(self.all_max_tensor(torch.tensor([float(stop.code())])).item()))

    @contextlib.contextmanager
    def accumulating(self):
        """Around the backward passes of one optimizer step. DeepSpeed with one reduction per step: every backward
        inside leaves its gradients on this rank and the block's end reduces their sum once (the sum over ranks of
        each rank's sum, as DDP computes it); otherwise nothing."""
        if self.engine is None or not self.coalesce:
            yield
            return
        self.engine.set_gradient_accumulation_boundary(True)  # the step after the block is a boundary
        with self.engine.coalesce_grad_reduction():
            yield

    def boundary(self, last: bool) -> None:
        """Before each backward pass: whether it is the last before the optimizer step. DeepSpeed reducing every
        backward (ZeRO-2's own protocol) steps only at a boundary; left at its default (every backward a boundary)
        ZeRO-2 keeps only the last backward's gradient. FSDP2 with one reduction per step accumulates this rank's
        gradients unsharded and reduce-scatters them at the last backward: the sum over ranks of each rank's sum, as
        DDP computes it (reducing every backward sums in another order, and differs from DDP in the last bits)."""
        if self.engine is not None and not self.coalesce:
            self.engine.set_gradient_accumulation_boundary(bool(last))
        if self._sync_grads is not None:
            self._sync_grads(bool(last))

    def barrier(self) -> None:
        if self.world > 1 and self._barrier is not None:
            self._barrier()


def reduces_every_backward(strategy, full_finetune: bool) -> bool:
    """Whether a sharded strategy reduces the gradients after every backward pass (``reduce_every_backward``: true,
    false, or auto = when fine-tuning fully, where a whole gradient per rank costs what sharding saves) rather than
    once per optimizer step."""
    r = getattr(strategy, "reduce_every_backward", "auto")
    return full_finetune if r == "auto" else bool(r)


def strategy_kind(strategy) -> str:
    """``ddp`` / ``fsdp`` (FSDP2: Lightning's ModelParallelStrategy and stepflow's subclass) / ``deepspeed`` /
    ``single`` for a Lightning strategy. DeepSpeed is checked first: Lightning's DeepSpeedStrategy subclasses
    DDPStrategy, but reduces its own gradients (in ZeRO partitions, not ``p.grad``)."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    cls = strategy if isinstance(strategy, type) else type(strategy)
    if isinstance(strategy, str):  # a Lightning registry name: "ddp", "fsdp", "deepspeed_stage_2", ...
        name = strategy.lower()
        return next((k for k in ("deepspeed", "fsdp", "ddp") if name.startswith(k)), "single")
    if issubclass(cls, DeepSpeedStrategy):
        return "deepspeed"
    if issubclass(cls, (ModelParallelStrategy, FSDPStrategy)):
        return "fsdp"
    if issubclass(cls, DDPStrategy):
        return "ddp"
    return "single"


def strategy_kind_of_config(trainer_cfg) -> str:
    """:func:`strategy_kind` of a ``trainer`` config node (its ``strategy``: a name or a ``_target_`` node), without
    building the Trainer."""
    node = (trainer_cfg or {}).get("strategy")
    target = node.get("_target_") if hasattr(node, "get") else None
    if target is None:
        return strategy_kind(str(node or "auto"))
    import hydra.utils

    try:
        return strategy_kind(hydra.utils.get_class(target))
    except Exception:  # noqa: BLE001 - an unknown target fails later, with the Trainer's own error
        return "single"


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> Tensor:
    """Clip the gradients to a total 2-norm of ``max_norm`` (factor ``1 / max(1, (norm + 1e-6) / max_norm)``, as
    DeepSpeed's step computes it; ``torch.nn.utils.clip_grad_norm_``'s ``min(1, max_norm / (norm + 1e-6))`` up to the
    last bit); returns the norm before clipping (fp32, 0-d).

    The norm is the square root of the squares summed in float64, over FSDP2's sharded (DTensor) gradients on every
    rank as well (one all-reduce): rounded to fp32 it is the same number however the gradient is split, so a sharded
    run clips exactly as DDP and one process do (torch's per-tensor norms of the shards differ in the last bit, and
    the difference grows through the training)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sq = torch.stack([torch.linalg.vector_norm(g, 2, dtype=torch.float64).square() for g in local]).sum()
    sharded = [g for g in grads if hasattr(g, "device_mesh")]
    if sharded:  # FSDP2 shards each gradient along dim 0 over the mesh: the squares add up over its ranks
        torch.distributed.all_reduce(sq, group=sharded[0].device_mesh.get_group())
    total = sq.sqrt().float()
    clip = torch.clamp((total + 1e-6) / max_norm, min=1.0)
    if float(clip) > 1.0:
        for g in local:
            g.mul_((1.0 / clip).to(g.device, g.dtype))
    return total.detach().cpu()


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank calls it), or ``t`` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_shard_of(full: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of ``full`` laid out as the DTensor ``like`` (no communication), or ``full`` itself."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)
