"""``loop.retain_graph``: on-policy updates from the rollout's own forward pass (LeanGRPO's Retain; docs/method.md §14).

With one optimizer step per rollout the weights the update differentiates are the weights that rolled out, so the
velocity the loss needs at each trained state (X_k, τ_k) is the one the rollout already computed. With retain on, the
rollout evaluates the trained steps with gradients and keeps their graphs (:attr:`stepflow.core.rollout.Trajectory.kept`);
the update's loss reads those velocities and back-propagates once through all of them, instead of running the
transformer again on every trained state. The loss is unchanged: the ratio ρ = π_θ/π_old is exactly 1 (and the clip
inactive, as it is at the first on-policy step with recomputation), the KL reference's forward still runs in the update
(it needs the reference weights, not the rollout's), and the gradient is the same sum of the same terms.

What it needs (:func:`why_not`): one optimizer step per rollout; an objective that trains at the rollout's own states
(GRPO, distill; the forward-process objectives train at re-noised points the rollout never visited); the rollout's
own trajectories (not the branch credits' ODE anchors and branches); one backward over every term (not the per-step
gradient weightings, which back-propagate each step apart); unsharded weights (FSDP2 / DeepSpeed reshard between a
forward and its backward, and the rollout's later no-grad forwards would run in between); no active dropout (the
rollout runs in eval mode, the update in train mode).

On the CPU (``loop.retain_keep_memory``, :func:`keep_freed_memory`): the kept graphs' activations are freed by the
update's backward, all at once, and glibc's malloc returns such memory to the OS (it trims the top of the heap above
``M_TRIM_THRESHOLD`` and unmaps blocks above its dynamic ``M_MMAP_THRESHOLD``); the next rollout and estimate then
allocate it again as fresh pages, which the kernel faults in and zeroes one by one. Measured on the every-step recipe
(shapes, 64 rows, 9 kept steps): 190,000 minor page faults per iteration with retain against none without it, and
+0.6 s of a 6.7 s iteration. Keeping freed memory in the process (what PyTorch's CUDA caching allocator does on GPUs)
removes them.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["SavedBytes", "why_not", "why_not_at_runtime", "mode", "keep_freed_memory", "allocator_hint"]


class SavedBytes:
    """Bytes of the activations autograd saves for backward inside the block (``with SavedBytes(params) as s: ...;
    s.bytes``), through :func:`torch.autograd.graph.saved_tensors_hooks`. Tensors on the storage of one of
    ``params`` (the weights, and views of them such as a transposed matrix) are not counted, nor the same tensor
    twice (same data pointer, shape and dtype)."""

    def __init__(self, params=()) -> None:
        self.bytes = 0
        self._weights = {p.untyped_storage().data_ptr() for p in params}
        self._seen: set[tuple] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: Tensor) -> Tensor:
        if t.layout == torch.strided and t.untyped_storage().data_ptr() not in self._weights:
            key = (t.data_ptr(), tuple(t.shape), t.dtype)
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def why_not(*, updates_per_iter: int, update_per_step: bool, forward_process: bool, branched: str | None,
            per_step_weighting: str | None, strategy: str, dropout: float = 0.0) -> str | None:
    """Why the update cannot train from the rollout's graphs under these settings (None: it can). Each reason is
    the second half of a one-line error: ``loop.retain_graph=true: <reason>``."""
    if updates_per_iter > 1:
        return (f"train.updates_per_iter={updates_per_iter} takes several optimizer steps per rollout (off-policy after "
                "the first: the weights that rolled out are not those the later steps differentiate)")
    if update_per_step:
        return ("train.update_per_step=true takes one optimizer step per trained step (off-policy after the first "
                "step)")
    if forward_process:
        return ("the forward-process objectives train at re-noised points the rollout never evaluated: there is no "
                "forward pass to reuse")
    if branched:
        return (f"advantage={branched} trains branches of ODE anchors, whose SDE steps the rollout's forward pass does "
                "not produce")
    if per_step_weighting:
        return (f"train.weighting={per_step_weighting} back-propagates each step's loss apart, the kept graphs once "
                "(use train.weighting=none, noise, gain_var, guard or guard_released)")
    if strategy in ("fsdp", "deepspeed"):
        return (f"the {strategy} strategy reshards the weights between a forward and its backward, and the rollout's "
                "later forwards would run in between")
    if dropout > 0:
        return (f"dropout {dropout:g} is active in training mode only, so the rollout's forward (eval mode) is not the "
                "update's")
    return None


def why_not_at_runtime(learner) -> str | None:
    """:func:`why_not` for a built :class:`stepflow.core.algorithm.Learner` (its dist's strategy, the policy's own dropout
    modules)."""
    o, obj = learner.train, learner.objective
    per_step = learner.weighting.name if learner.weighting.per_step else None
    drop = max((m.p for m in _modules(learner.policy) if isinstance(m, torch.nn.Dropout)), default=0.0)
    return why_not(updates_per_iter=o.updates_per_iter, update_per_step=o.update_per_step,
                   forward_process=obj.forward_process,
                   branched=learner.advantage.cfg.scheme if learner.advantage.branched else None,
                   per_step_weighting=per_step, strategy=learner.dist.kind, dropout=float(drop))


def _modules(policy):
    """The modules the velocity runs (the transformer; the conditioning comes encoded from the rollout)."""
    net = getattr(policy, "transformer", policy)
    return net.modules() if isinstance(net, torch.nn.Module) else []


def mode(value) -> str:
    """``loop.retain_graph`` as ``off`` | ``on`` | ``auto``."""
    return "auto" if value == "auto" else ("on" if value is True else "off")


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: the largest M_MMAP_THRESHOLD glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX) and the largest trim threshold
#: mallopt's int can carry
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 * 2**20, 2**31 - 1
_kept_memory: bool | None = None


#: allocators that, preloaded, replace glibc's malloc (the hint below is then not given)
_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def allocator_hint() -> str | None:
    """The one line a retaining CPU run logs under glibc's malloc (None under another allocator, or not glibc).

    The kept graphs' tensors sit between the forward's freed temporaries in glibc's heap, and the next forward's kept
    tensors do not fit the holes: the process grows by about twice what the graphs hold and the other phases slow down
    (docs/results.md, "What it costs in memory"). tcmalloc does not fragment this way; it has to be preloaded
    (``LD_PRELOAD``), which only the command that starts the process can do."""
    import os

    if any(a in os.environ.get("LD_PRELOAD", "") for a in _ALLOCATORS) or not _glibc():
        return None
    lib = _tcmalloc()
    how = f"LD_PRELOAD={lib}" if lib else "LD_PRELOAD=libtcmalloc_minimal.so.4 (Debian/Ubuntu: libtcmalloc-minimal4)"
    return ("loop.retain_graph on the CPU under glibc's malloc: the kept graphs leave holes in the heap (the process "
            "grows by about twice what they hold, and the rollout and estimate slow down); tcmalloc avoids both: "
            f"{how} python -m stepflow.train ...")


@functools.cache
def _tcmalloc() -> str | None:
    """tcmalloc's library name as the dynamic loader finds it (``ldconfig``), or None; looked up once per process."""
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


@functools.cache
def _glibc():
    """glibc's C library (ctypes), or None; loaded once per process."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:  # pragma: no cover - no C library to load (not Linux)
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def keep_freed_memory() -> bool:
    """Keep freed host memory in the process for reuse instead of returning it to the OS (glibc only; once per
    process; True where applied). ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` serves every block below 32 MiB from the heap
    (a fixed threshold: glibc no longer adapts it) and ``mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)`` trims the heap only
    above 2 GiB of free memory at its top, so the activations the update frees are the next rollout's, without page
    faults (the module docstring). Blocks of 32 MiB and more are still mapped and unmapped each time. The process
    keeps its peak heap (up to the 2 GiB above what it uses) until it ends."""
    global _kept_memory
    if _kept_memory is None:
        libc = _glibc()
        _kept_memory = libc is not None and hasattr(libc, "mallopt") and bool(
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept_memory
