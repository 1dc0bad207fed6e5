"""SDE windows: which denoising steps of an iteration are stochastic (and trained); the others follow the ODE.

A window is a pure function of the iteration (and the seed), so a resumed run draws the same windows (docs/method.md
§9). Kinds (the ``window`` config group):

- ``none``: every step follows the sampler (the paper);
- ``fixed``: steps ``[start, start + size)`` (Flow-GRPO-Fast's window);
- ``sliding``: a simplified MixGRPO progressive window of ``size`` steps, moved by ``stride`` every ``every``
  iterations from ``start`` up to the last position (``T − size``), then held there (stepflow's, kept as measured);
- ``random``: ``size`` steps drawn anew every iteration from ``[start, T)``, the same for every sample (MixGRPO-random
  semantics; not DanceGRPO's subset, which trains a per-sample subset of all-SDE rollouts, league.md §0);
- ``random_start``: ``size`` consecutive steps at a start drawn anew every iteration, the window inside
  ``[start, end)`` (Flow-GRPO-Fast as released: ``start = random.randint(range[0], range[1] − size)``,
  window_range (0, 5), window_size 3);
- ``mixgrpo``: MixGRPO's progressive window as released (:func:`mixgrpo_window`): ``range(cur, min(cur + size, T − 2))``
  with ``cur`` moved by ``stride`` every ``every`` iterations; the window shrinks at the end of the grid and is empty
  at ``cur = T − 2``, after which it rolls back to ``start`` (``roll_back``) or stays empty. ``post_solver=dpmpp2m``
  (MixGRPO-Flash): the ODE after the window is a DPM-Solver++(2M) tail on a compressed grid (:func:`post_tail`,
  :func:`stepflow.solvers.flash_tail`) instead of the grid's Euler steps.

Steps outside the window carry no log-prob and are never trained; the x̂0 estimates and rewards of their states are
still computed where the credit scheme reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch import Tensor

__all__ = ["WindowConfig", "window_steps", "mixgrpo_window", "mixgrpo_position", "post_tail", "WINDOWS",
           "POST_SOLVERS"]

WINDOWS = ("none", "fixed", "sliding", "random", "random_start", "mixgrpo")
#: the ODE after the window: the grid's Euler steps, or MixGRPO-Flash's compressed DPM-Solver++(2M) tail
POST_SOLVERS = ("euler", "dpmpp2m")


@dataclass
class WindowConfig:
    """The SDE window (see the module docstring)."""

    kind: str = "none"  #: none | fixed | sliding | random | random_start | mixgrpo
    #: first step of the window (sliding, mixgrpo: its first position; random: the lowest step drawn)
    start: int = 0
    #: random_start: the window lies in ``[start, end)`` (Flow-GRPO-Fast's window_range); null = the grid's end T
    end: int | None = None
    size: int = 3  #: steps in the window
    stride: int = 1  #: sliding, mixgrpo: steps moved at each shift (mixgrpo: 0 = a frozen window, MixGRPO-Flash*)
    every: int = 10  #: sliding, mixgrpo: iterations between shifts
    #: mixgrpo: past the last position (T − 2) the window restarts at ``start`` (MixGRPO's ``--roll_back``, which every
    #: released script passes); false: it stays at T − 2, where it is empty, for the rest of the run
    roll_back: bool = False
    #: mixgrpo: the ODE after the window's last step: ``euler`` (MixGRPO; the grid's own steps) | ``dpmpp2m``
    #: (MixGRPO-Flash, ``--dpm_algorithm_type dpmsolver++ --dpm_apply_strategy post``: DPM-Solver++(2M) on a compressed
    #: grid of ``int(max((T − last)·post_compress_ratio, 1))`` points; only the final latent is kept, so it needs
    #: uniform credit, which stepflow.train checks)
    post_solver: str = "euler"
    #: dpmpp2m: ``--dpm_post_compress_ratio`` (0.4 in ..._MixGRPO_Flash.sh, 0.2 in ..._MixGRPO_Flash*.sh)
    post_compress_ratio: float = 0.4

    def __post_init__(self) -> None:
        if self.kind not in WINDOWS:
            raise ValueError(f"kind: must be one of {', '.join(WINDOWS)}, got {self.kind!r}")
        for name in ("size", "stride", "every"):
            v = getattr(self, name)
            low = 0 if name == "stride" and self.kind == "mixgrpo" else 1
            if not (isinstance(v, int) and v >= low):
                raise ValueError(f"{name}: must be an integer >= {low}, got {v!r}")
        if not (isinstance(self.start, int) and self.start >= 0):
            raise ValueError(f"start: must be an integer >= 0, got {self.start!r}")
        if self.end is not None and not (isinstance(self.end, int) and not isinstance(self.end, bool)
                                         and self.end >= self.start + self.size):
            raise ValueError(f"end: must be null or an integer >= start + size = {self.start + self.size} (the window "
                             f"[start, start + size) must fit below it), got {self.end!r}")
        if not isinstance(self.roll_back, bool):
            raise ValueError(f"roll_back: must be true or false, got {self.roll_back!r}")
        if self.post_solver not in POST_SOLVERS:
            raise ValueError(f"post_solver: must be one of {', '.join(POST_SOLVERS)}, got {self.post_solver!r}")
        r = self.post_compress_ratio
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0):
            raise ValueError(f"post_compress_ratio: must be a float > 0 (MixGRPO-Flash 0.4, Flash* 0.2), got {r!r}")
        if self.post_solver != "euler" and self.kind != "mixgrpo":  # the release asserts sample_strategy=progressive
            raise ValueError(f"post_solver: {self.post_solver} (MixGRPO-Flash's tail) follows the progressive window "
                             f"only; use window=mixgrpo, or window.post_solver=euler with window={self.kind}")


def window_steps(cfg: WindowConfig, iteration: int, num_steps: int, seed: int = 0) -> list[int] | None:
    """The stochastic steps of ``iteration`` on a ``num_steps``-step grid, sorted; None = every step (``none``);
    ``mixgrpo`` may give ``[]`` (every step follows the ODE and nothing is trained)."""
    if cfg.kind == "none":
        return None
    if cfg.kind == "mixgrpo":
        return mixgrpo_window(cfg, iteration, num_steps)
    if cfg.start + (cfg.size if cfg.kind != "random" else 1) > num_steps or cfg.size > num_steps - cfg.start:
        raise ValueError(f"window.size: start {cfg.start} + size {cfg.size} do not fit a {num_steps}-step grid "
                         f"(loop.num_steps); lower window.start or window.size")
    if cfg.kind == "fixed":
        lo = cfg.start
    elif cfg.kind == "sliding":
        lo = min(cfg.start + (iteration // cfg.every) * cfg.stride, num_steps - cfg.size)
    elif cfg.kind == "random_start":
        end = num_steps if cfg.end is None else cfg.end
        if end > num_steps:
            raise ValueError(f"window.end: {end} is past the {num_steps}-step grid (loop.num_steps); lower window.end "
                             f"or set it to null")
        rng = np.random.default_rng([seed, iteration, 7_772])
        lo = int(rng.integers(cfg.start, end - cfg.size + 1))  # inclusive of end - size, as python's randint
    else:
        rng = np.random.default_rng([seed, iteration, 7_771])
        return sorted(int(k) for k in rng.choice(np.arange(cfg.start, num_steps), size=cfg.size, replace=False))
    return list(range(lo, lo + cfg.size))


# ----------------------------------------------------------------------------------------------------------------
# MixGRPO's progressive window as released (Tencent-Hunyuan/MixGRPO@e5cdd6a)
# ----------------------------------------------------------------------------------------------------------------
def _mixgrpo_last(cfg: WindowConfig, num_steps: int) -> int:
    """``max_timesteps = sampling_steps − 2`` (fastvideo/train_grpo_flux.py L919), checked against ``start``."""
    last = num_steps - 2
    if not 0 <= cfg.start < last:
        raise ValueError(f"window.start: the mixgrpo window runs over the steps start .. T - 3 (T = loop.num_steps = "
                         f"{num_steps}; MixGRPO's max_timesteps = T - 2 is exclusive), so start must be in "
                         f"0..{last - 1}, got {cfg.start}; lower window.start or raise loop.num_steps")
    return last


def mixgrpo_position(cfg: WindowConfig, iteration: int, num_steps: int) -> int:
    """``cur_timestep`` of ``GRPOTrainingStates`` (fastvideo/utils/grpo_states.py) when iteration ``iteration``
    (0-based) reads its window, in closed form.

    Released (``sample_strategy="progressive"``, ``prog_overlap=True``; grpo_states.py L85-99, called at
    train_grpo_flux.py L945-947 as ``get_current_timesteps()`` then ``update_iteration()``): every iteration
    ``cur_iter_in_group += 1``; when it reaches ``iters_per_group`` (= ``every``) it is reset and ``cur_timestep +=
    prog_overlap_step`` (= ``stride``); then, if ``cur_timestep > max_timesteps`` (M = T − 2), ``roll_back`` resets it
    to the initial ``start`` (and the counter to 0), else clips it to M. Hence, with ``P = ⌊(M − start)/stride⌋ + 1``
    positions per cycle (stride ≥ 1):

        roll_back:     cur(i) = start + ⌊(i mod P·every) / every⌋ · stride
        no roll_back:  cur(i) = min(start + ⌊i / every⌋ · stride, M)

    and ``cur(i) = start`` for ``stride = 0`` (MixGRPO-Flash*: ``prog_overlap_step=0``, a frozen window).
    """
    if not (isinstance(iteration, int) and iteration >= 0):
        raise ValueError(f"iteration: must be an integer >= 0, got {iteration!r}")
    last = _mixgrpo_last(cfg, num_steps)
    if cfg.stride == 0:
        return cfg.start
    if cfg.roll_back:
        positions = (last - cfg.start) // cfg.stride + 1
        return cfg.start + ((iteration % (positions * cfg.every)) // cfg.every) * cfg.stride
    return min(cfg.start + (iteration // cfg.every) * cfg.stride, last)


def mixgrpo_window(cfg: WindowConfig, iteration: int, num_steps: int) -> list[int]:
    """MixGRPO's SDE (and trained) steps of ``iteration``: ``range(cur, min(cur + size, T − 2))`` with ``cur`` =
    :func:`mixgrpo_position` (``get_current_timesteps``, fastvideo/utils/grpo_states.py L141-148; ``group_size`` =
    ``size``). The end is exclusive, so the last step a window holds is T − 3 (released: 22 of 0..24 at 25 steps): near
    the end the window shrinks (``[T − 4, T − 3]``, ``[T − 3]``) and at ``cur = T − 2`` it is **empty**; the released
    rollout then samples every step with the Euler ODE (train_grpo_flux.py L236-240: ``determistic`` all True) and
    the update's loop over the window is empty (L532-533), so nothing is trained (the optimizer step sees no
    gradient). Example (T = 10, size 4, stride 1, every 25, roll_back): iterations 0-24 → [0, 1, 2, 3], 25-49 →
    [1, 2, 3, 4], …, 125-149 → [5, 6, 7], 150-174 → [6, 7], 175-199 → [7], 200-224 → [], 225 → [0, 1, 2, 3] again."""
    cur = mixgrpo_position(cfg, iteration, num_steps)
    return list(range(cur, min(cur + cfg.size, num_steps - 2)))


def post_tail(cfg: WindowConfig | None, grid: Tensor, window: list[int] | None, shift: float) -> Tensor | None:
    """MixGRPO-Flash's tail grid for one iteration: ``flash_grid(grid, last, post_compress_ratio, shift)[last + 1:]``
    (:func:`stepflow.solvers.flash_grid`; ``last`` = the window's last step), which
    :func:`stepflow.rollout.rollout` (``tail=``) runs with DPM-Solver++(2M) from ``X_{last+1}`` to the final latent.
    None (every step after the window is the grid's Euler step) for ``post_solver=euler``, no window, or an **empty**
    window: that iteration rolls out all-Euler, as MixGRPO does. The released Flash crashes there
    (sampling_utils.py L44: ``last_false_index`` is None for an all-deterministic rollout), which its 300 iterations
    never reach. grid: the (T+1,) rollout grid; shift: the grid's shift (released ``--shift``, 3)."""
    if cfg is None or cfg.post_solver == "euler" or not window:
        return None
    from stepflow.solvers import flash_grid

    last = max(window)
    return flash_grid(grid, last, cfg.post_compress_ratio, shift)[last + 1:]
