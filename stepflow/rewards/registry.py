"""Build a :class:`~stepflow.rewards.base.Reward` from a Hydra config (``conf/reward/<name>.yaml``).

``build_reward(cfg)`` is ``hydra.utils.instantiate`` plus one thing: a reward that cannot load its weights raises a
one-line :class:`~stepflow.errors.RewardLoadError` (naming the id/path and the ``reward.<key>=/local/copy``
override) instead of Hydra's wrapped, multi-screen traceback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stepflow.errors import RewardError, StepflowError
from stepflow.rewards.base import Reward

__all__ = ["build_reward", "reward_config"]


def _find_reward_error(e: BaseException) -> RewardError | None:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, RewardError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def reward_config(name: str, overrides: Sequence[str] = ()) -> Any:
    """Compose ``conf/reward/<name>.yaml`` (with its defaults list) and ``reward.*`` overrides, e.g.
    ``reward_config("pickscore", ["model_path=/models/PickScore_v1"])``."""
    from stepflow.config import compose

    ov = [f"+reward={name}"] + [o if o.startswith(("reward.", "+reward.", "~reward.")) else
                                ("+" if o.startswith("+") else "") + "reward." + o.lstrip("+") for o in overrides]
    return compose(None, ov).reward


def build_reward(cfg: Any, overrides: Sequence[str] = ()) -> Reward:
    """Instantiate a reward from a config node with ``_target_`` (DictConfig or dict), a reward name
    (``"pickscore"``, composed from ``conf/reward``), or pass through an already built :class:`Reward`.

    Raises :class:`~stepflow.errors.RewardLoadError` (one line) when weights cannot be loaded.
    """
    if isinstance(cfg, Reward):
        return cfg
    if isinstance(cfg, str):
        cfg = reward_config(cfg, overrides)
    elif overrides:
        raise ValueError("build_reward: overrides are only supported with a reward name")
    if not isinstance(cfg, Mapping) and not hasattr(cfg, "_target_"):
        raise TypeError(f"build_reward: expected a reward config with _target_, got {type(cfg).__name__}")
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        reward = instantiate(cfg)
    except InstantiationException as e:
        inner = _find_reward_error(e)
        if inner is not None:
            raise inner from None
        cause = e.__cause__
        if isinstance(cause, (ValueError, OSError)):  # the reward's own check of its arguments: its message, one line
            msg = " ".join(str(cause).split()) or type(cause).__name__
            raise StepflowError(msg if msg.startswith("reward") else f"reward: {msg}") from None
        raise
    if not isinstance(reward, Reward):
        raise TypeError(f"build_reward: {cfg.get('_target_')} built a {type(reward).__name__}, not a Reward")
    return reward
