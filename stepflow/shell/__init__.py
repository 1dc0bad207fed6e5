"""The Lightning shell around the iteration (with :mod:`stepflow.grpo`'s module): the sharded strategies (FSDP2,
DeepSpeed), checkpoints that survive a kill, the loggers and the plots."""
