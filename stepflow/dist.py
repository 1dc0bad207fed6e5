"""Ranks, gathers and reductions of one GRPO iteration, behind one small object (single process or Lightning).

The iteration's plan is global and identical on every rank; each rank rolls out its contiguous slice of the rows,
the rewards of all rows are gathered in rank order for the group statistics, and each rank trains on its own rows
with gradients summed over ranks (``stepflow.algorithm.update``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Dist"]


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
    _gather: Any = None  #: callable Tensor -> (world, ...) Tensor (Lightning's ``all_gather``)
    _barrier: Any = None

    @classmethod
    def from_module(cls, module) -> Dist:
        """The collectives of a LightningModule attached to a Trainer (a single process without one)."""
        trainer = getattr(module, "_trainer", None)
        if trainer is None or trainer.world_size == 1:
            return cls(device=module.device)
        from lightning.pytorch.strategies import DDPStrategy

        strategy = trainer.strategy
        return cls(rank=module.global_rank, world=trainer.world_size, device=module.device,
                   manual_grad_sync=isinstance(strategy, DDPStrategy), _gather=module.all_gather,
                   _barrier=strategy.barrier)

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

    def barrier(self) -> None:
        if self.world > 1 and self._barrier is not None:
            self._barrier()
