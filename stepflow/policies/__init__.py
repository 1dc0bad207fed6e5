"""FlowPolicy implementations: the embedded shapes model and diffusers' SD3 family."""

from stepflow.policies.base import LORA_TARGETS_SD3, Cond, FlowPolicy

__all__ = ["Cond", "FlowPolicy", "LORA_TARGETS_SD3"]
