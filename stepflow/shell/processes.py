"""The trainer's process counts, checked before any process starts: ``trainer.devices`` / ``trainer.num_nodes`` as
counts, and an iteration's rows split evenly over the processes (Lightning's own errors come after every rank
started, in its words)."""

from __future__ import annotations

from omegaconf import OmegaConf

from stepflow.config import LoopConfig
from stepflow.errors import StepflowError


def _processes(key: str, value) -> int | None:
    """How many processes ``trainer.<key>`` (``devices`` / ``num_nodes``) asks for; None where Lightning decides
    (``auto``, -1: every device). A count below 1 is one line naming the field."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    elif isinstance(value, str) and "," in value:  # device ids: "0,1"
        value = [x for x in value.split(",") if x.strip()]
    if key == "devices" and (value == "auto" or value == -1):
        return None
    if isinstance(value, (list, tuple)) and key == "devices":
        if value:
            return len(value)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    what = "a count >= 1 (or -1 / auto: every device, or a list of device ids)" if key == "devices" else "an integer >= 1"
    raise StepflowError(f"trainer.{key}: must be {what}, got {value!r}; give trainer.{key}=1 (or more)")


def check_trainer(t, loop: LoopConfig) -> None:
    """``trainer.devices`` / ``trainer.num_nodes`` as counts, and the iteration's rows (``loop.prompts_per_iter`` ×
    ``loop.group_size``) split evenly over their processes, before any process starts (Lightning's own errors come
    after every rank started, in its words)."""
    if t is None:
        return
    devices, nodes = _processes("devices", t.get("devices", 1)), _processes("num_nodes", t.get("num_nodes", 1))
    if devices is None or nodes is None:
        return
    world, rows = devices * nodes, loop.prompts_per_iter * loop.group_size
    if rows % world:
        raise StepflowError(
            f"trainer.devices: the {rows} rows of an iteration (loop.prompts_per_iter={loop.prompts_per_iter} x "
            f"loop.group_size={loop.group_size}) do not split over trainer.devices x trainer.num_nodes = {world} "
            f"processes; give loop.prompts_per_iter / loop.group_size whose product is a multiple of {world}, or a "
            f"trainer.devices that divides {rows}")
