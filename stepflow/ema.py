"""EMA of the trained parameters, with Flow-GRPO's warm-up (used for evaluation and the saved weights)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["ParamEMA"]


class ParamEMA:
    """Shadow copies ``s ← d·s + (1 − d)·p`` of a list of parameters, ``d_n = min((1 + n)/(10 + n), decay)`` after n
    updates, one update every ``update_every`` optimizer steps."""

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float, update_every: int = 1):
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay, self.update_every, self.num_updates = decay, update_every, 0

    @torch.no_grad()
    def step(self, opt_step: int) -> None:
        """Call after optimizer step ``opt_step`` (0-based)."""
        if (opt_step + 1) % self.update_every:
            return
        d = min((1 + self.num_updates) / (10 + self.num_updates), self.decay)
        for s, p in zip(self.shadow, self.params):
            s.mul_(d).add_(p.detach(), alpha=1 - d)
        self.num_updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self):
        """The parameters hold the EMA weights inside the context and their own weights again after it."""
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
        from stepflow.sharding import full_tensor

        return {"shadow": [full_tensor(s).detach().cpu().clone() for s in self.shadow], "num_updates": self.num_updates}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        from stepflow.sharding import local_shard_of

        for s, v in zip(self.shadow, sd["shadow"]):
            s.copy_(local_shard_of(v, s))
        self.num_updates = int(sd["num_updates"])
