"""stepflow: stepwise credit assignment for GRPO on flow-matching text-to-image models."""

__version__ = "0.1.0"
