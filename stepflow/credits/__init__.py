"""Credit schemes (``advantage=<option>``): one class per file, named by its YAML's ``_target_``
(:class:`stepflow.credits.base.Credit`)."""

from stepflow.credits.base import Credit

__all__ = ["Credit"]
