"""GPU smoke runs (``pytest -m gpu`` on a CUDA machine; skipped elsewhere): one GRPO iteration of the tiny SD3 pipeline
in bf16 under each Lightning strategy the project ships (DDP, FSDP, DeepSpeed ZeRO-2), one device each.

Lightning refuses FSDP and DeepSpeed on the CPU, so these are the only tests of those strategies; they use the
same entry point a user runs (``python -m stepflow.train``) and check its outputs.
"""

from __future__ import annotations

import csv
import importlib.util

import pytest
from conftest import run_cli

pytestmark = pytest.mark.gpu

STRATEGIES = ["ddp", "fsdp", "deepspeed_stage_2"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_iteration_of_tiny_sd3_in_bf16(tmp_path, strategy):
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    r = run_cli("stepflow.train", "experiment=smoke", "model=sd3_tiny", "model.dtype=bfloat16", "trainer=gpu",
                f"trainer.strategy={strategy}", "loop.iterations=2", "eval.max_prompts=4", "advantage=gain",
                f"hydra.run.dir={tmp_path}", env={"STEPFLOW_CACHE": str(tmp_path / "cache")}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    with (tmp_path / "metrics.csv").open() as fh:
        rows = [x for x in csv.DictReader(fh) if x.get("train/reward_final")]
    assert len(rows) == 2
    assert float(rows[-1]["train/steps_trained"]) > 0 and float(rows[-1]["cost/nfe"]) > 0
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
