"""GPU smoke runs (``pytest -m gpu`` on a CUDA machine; skipped elsewhere): one GRPO iteration of the tiny SD3 pipeline
in bf16 under each trainer config the project ships for GPUs (``trainer=ddp``, ``fsdp`` = FSDP2, ``deepspeed`` =
ZeRO-2), one device each.

The sharded strategies' correctness (equal to DDP, global metrics, resume, multi-node) is tested on the CPU
(``tests/test_sharded.py``: ``trainer=fsdp_cpu`` / ``deepspeed_cpu`` on 2 gloo processes); these runs check what
only a GPU shows (NCCL, bf16 mixed precision, memory) through the entry point a user runs
(``python -m stepflow.train``). The full-size tests at the end
build the published architectures with random weights (``stepflow.testing.random_policies``, ``model=*_random``): one
gain iteration of each model through ``experiments/gpu_check.py``, and the strategies x {LoRA, full} on SD3.5-Medium
(they need ~40 GB for Qwen-Image's LoRA; an 80 GB GPU holds every one of them).
"""

from __future__ import annotations

import csv
import importlib.util

import pytest

from stepflow.testing.harness import run_cli

pytestmark = pytest.mark.gpu

STRATEGIES = ["ddp", "fsdp", "deepspeed"]  #: conf/trainer/<name>.yaml, on one device


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_iteration_of_tiny_sd3_in_bf16(tmp_path, strategy):
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (make install installs it)")
    r = run_cli("stepflow.train", "experiment=smoke", "model=sd3_tiny", "model.dtype=bfloat16", f"trainer={strategy}",
                "trainer.devices=1", "loop.iterations=2", "eval.max_prompts=4", "advantage=gain",
                f"hydra.run.dir={tmp_path}", env={"STEPFLOW_CACHE": str(tmp_path / "cache")}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    with (tmp_path / "metrics.csv").open() as fh:
        rows = [x for x in csv.DictReader(fh) if x.get("train/reward_final")]
    assert len(rows) == 2
    assert float(rows[-1]["train/steps_trained"]) > 0 and float(rows[-1]["cost/nfe"]) > 0
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


# ------------------------------------------------------------------------------------------------------------------
# full size, random weights (stepflow.testing.random_policies): what experiments/gpu_check.sh runs, as tests
# ------------------------------------------------------------------------------------------------------------------
FULL_RUNS = [("sd35_medium", "lora"), ("sd35_medium", "full"), ("sd35_large", "lora"), ("flux_dev", "lora"),
             ("qwen_image", "lora")]


@pytest.mark.parametrize("model,finetune", FULL_RUNS, ids=[f"{m}-{f}" for m, f in FULL_RUNS])
def test_one_gain_iteration_of_each_full_size_random_model(tmp_path, model, finetune):
    """experiments/gpu_check.py at the published size (bf16, 512 px), small batch: finite, and its peak memory."""
    import json
    import subprocess
    import sys

    from stepflow.testing.harness import ROOT

    out = tmp_path / "gc.json"
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_check.py"), "--runs", f"{model}:{finetune}",
                        "--advantages", "gain", "--iters", "1", "--steps", "3", "--batch", "4", "--group-size", "2",
                        "--substeps", "2", "--micro-batch", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    assert run["status"] == "ok" and run["finite"] and run["peak_gib"] > 0


@pytest.mark.parametrize("finetune", ["lora", "full"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_iteration_of_full_size_sd35_medium_random(tmp_path, strategy, finetune):
    """python -m stepflow.train model=sd35_medium_random (2.5 B, bf16, random weights) under each strategy on one
    GPU, LoRA and full fine-tuning (full: no checkpoint file, no weights written)."""
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (make install installs it)")
    extra = ["model.save_weights=false", "callbacks.checkpoint=null", "train.lr=1e-5"] if finetune == "full" else []
    r = run_cli("stepflow.train", "model=sd35_medium_random", f"trainer={strategy}", "trainer.devices=1",
                f"model.finetune={finetune}", *extra, "~reward=shapes_geneval",
                "+reward._target_=stepflow.testing.random_policies.StandInReward",
                "+callbacks.memory._target_=stepflow.testing.random_policies.peak_memory_callback",
                "loop.iterations=1", "loop.prompts_per_iter=1", "loop.group_size=4", "loop.num_steps=4",
                "loop.substeps=2", "train.micro_batch_size=4", "train.beta_kl=0.04", "advantage=gain",
                "sampler=flow_sde", "eval.max_prompts=2", "eval.num_steps=2", "eval.batch_size=2",
                "eval.grid_prompts=2", f"hydra.run.dir={tmp_path}", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    with (tmp_path / "metrics.csv").open() as fh:
        rows = [x for x in csv.DictReader(fh) if x.get("time/iteration_s")]
    assert len(rows) == 1 and float(rows[0]["train/steps_trained"]) > 0
    with (tmp_path / "memory.csv").open() as fh:
        mem = [x for x in csv.DictReader(fh) if x["iteration"] != "start"]
    assert float(mem[-1]["peak_allocated_gib"]) > 4  # at least the bf16 weights
