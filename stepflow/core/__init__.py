"""The core: what builds a run and runs an iteration (it names no built-in part; it asks the parts)."""
