"""Copies of the trained parameters: the EMA used for evaluation and the saved weights (with Flow-GRPO's warm-up),
and the lagged copies some objectives train against (DiffusionNFT's old policy, AWM's fast EMA)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from stepflow.core.dist import full_tensor, local_shard_of

__all__ = ["ParamCopy", "ParamEMA"]


class ParamCopy:
    """Shadow copies ``s`` of a list of parameters, moved toward them by :meth:`blend` (``s ← d·s + (1 − d)·p``)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]
        self.num_updates = 0

    @torch.no_grad()
    def blend(self, d: float) -> None:
        """``s ← d·s + (1 − d)·p`` (d = 0: the copy becomes the parameters)."""
        for s, p in zip(self.shadow, self.params):
            s.mul_(d).add_(p.detach(), alpha=1 - d)
        self.num_updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self):
        """The parameters hold the copy's weights inside the context and their own weights again after it."""
        backup: list[Tensor] = [p.detach().clone() for p in self.params]
        for s, p in zip(self.shadow, self.params):
            p.copy_(s)
        try:
            yield
        finally:
            for b, p in zip(backup, self.params):
                p.copy_(b)

    def state_dict(self) -> dict:
        """Whole tensors: FSDP2's sharded shadows are gathered (a collective: every rank calls it), so a checkpoint
        loads onto any number of ranks."""
        return {"shadow": [full_tensor(s).detach().cpu().clone() for s in self.shadow], "num_updates": self.num_updates}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        for s, v in zip(self.shadow, sd["shadow"]):
            s.copy_(local_shard_of(v, s))
        self.num_updates = int(sd["num_updates"])


class ParamEMA(ParamCopy):
    """The evaluation EMA: ``d_n = min((1 + n)/(10 + n), decay)`` after n updates, one update every ``update_every``
    optimizer steps."""

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float, update_every: int = 1):
        super().__init__(params)
        self.decay, self.update_every = decay, update_every

    def step(self, opt_step: int) -> None:
        """Call after optimizer step ``opt_step`` (0-based)."""
        if (opt_step + 1) % self.update_every:
            return
        self.blend(min((1 + self.num_updates) / (10 + self.num_updates), self.decay))
