"""Sharded training on the CPU: FSDP2 (``trainer=fsdp_cpu``) and DeepSpeed ZeRO-2 (``trainer=deepspeed_cpu``) on two
gloo processes train as DDP (``trainer=ddp_cpu``) does on the same two ranks, and as one process does.

The runs are the CLI's own (``python -m stepflow.train``), on a tiny SD3 pipeline with a tiny PickScore (the rewards
vary, so every sample is trained) and a KL term, in micro-batches of 2 over 12 rows. The references do not share the
code under test's reduction: DDP sums ``p.grad`` by hand; FSDP2 reduce-scatters; DeepSpeed reduces its partitions.
A scale of 1/world (the loss not multiplied back under a mean-reducing strategy) halves the iteration-1 gradient
norm; a missing DeepSpeed accumulation boundary keeps only the last micro-batch's gradient; both fail here.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stepflow.testing.harness import ROOT, one_line_error, run_cli, run_in_process

# every multi-process test here is `slow` (make test-slow); the config refusals run in-process, in `make test`
# make test-slow (--dist loadgroup): the tests sharing the module's runs one at a time on one worker; the SIGTERM test
# (runs of its own) with the other 2-process tests on the other ("multiprocess2": tests/test_train_loop.py's DDP runs)
pytestmark = pytest.mark.xdist_group("multiprocess")

BASE = ["experiment=smoke", "model=sd3_tiny", "reward=pickscore_tiny", "train.beta_kl=0.04", "eval.max_prompts=3",
        "loop.prompts_per_iter=3", "train.micro_batch_size=2"]
KEYS = ["train/grad_norm", "train/policy_loss", "train/kl", "train/reward_mean", "train/clip_frac", "train/adv_abs"]
FINETUNE = {"lora": [], "full": ["model.finetune=full"]}


def metrics(run_dir: Path) -> dict[int, dict[str, str]]:
    with (run_dir / "metrics.csv").open() as fh:
        return {int(float(r["iteration"])): r for r in csv.DictReader(fh) if r.get("train/reward_mean")}


def _train(run_dir: Path, *args: str, timeout: int = 500):
    """A run of the CLI: a subprocess for every trainer but the one-process ``trainer=cpu`` (in this process: the
    same command, without a fresh interpreter's imports)."""
    if "trainer=cpu" in args:
        r = run_in_process("stepflow.train", *BASE, *args, f"hydra.run.dir={run_dir}")
    else:
        r = run_cli("stepflow.train", *BASE, *args, f"hydra.run.dir={run_dir}", timeout=timeout)
    assert r.returncode == 0, (r.stderr or r.stdout)[-3000:]
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(trainer, finetune)``: the run directory of a 3-iteration run (made once per module), with the checkpoint
    of each iteration kept (``checkpoints/iter_000k.ckpt``)."""
    done: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("sharded")

    def get(trainer: str, finetune: str) -> Path:
        if (trainer, finetune) not in done:
            d = root / f"{trainer}_{finetune}"
            # keep_every=1: checkpoints/iter_0002.ckpt stays for the resume tests (it changes no training number)
            _train(d, "loop.iterations=3", f"trainer={trainer}", *FINETUNE[finetune], "callbacks.checkpoint.keep_every=1")
            done[trainer, finetune] = d
        return done[trainer, finetune]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("finetune", ["lora", "full"])
@pytest.mark.parametrize("trainer", ["fsdp_cpu", "deepspeed_cpu"])
def test_sharded_trains_as_ddp(runs, trainer, finetune):
    """Every logged training metric of 3 iterations equals DDP's on the same two ranks (rel 1e-4; FSDP2 equals it to
    the last bit), the counts are global (those of one process, which do not depend on the fine-tuning mode), and the
    iteration-1 gradient has the scale of one process (its norm within 2 %: a 1/world scale would halve it; checked
    with LoRA: a fully fine-tuned run's gradient is DDP's, whose averaging does not depend on which weights train)."""
    ddp, got, one = metrics(runs("ddp_cpu", finetune)), metrics(runs(trainer, finetune)), metrics(runs("cpu", "lora"))
    assert sorted(got) == sorted(ddp) == [1, 2, 3]
    for it in ddp:
        for k in KEYS:
            a, b = float(ddp[it][k]), float(got[it][k])
            assert b == pytest.approx(a, rel=1e-4, abs=1e-9), (it, k)
        for k in ("train/samples_trained", "cost/nfe_rollout", "cost/reward_images"):
            assert float(got[it][k]) == float(one[it][k]), (it, k)
    if finetune == "lora":
        assert float(got[1]["train/grad_norm"]) == pytest.approx(float(one[1]["train/grad_norm"]), rel=0.02)
    assert float(ddp[1]["train/kl"]) == 0.0 < float(ddp[2]["train/kl"])  # the KL term is live after step 1


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["fsdp_cpu", "deepspeed_cpu"])
def test_reducing_every_backward_has_ddp_gradient(runs, tmp_path, trainer):
    """``reduce_every_backward=true`` (sharded gradients, ``auto``'s choice for full fine-tuning; ZeRO-2's own
    protocol with the accumulation boundary) sums the ranks per backward: the same gradient as DDP up to rounding
    (iteration 1, before any weight differs), not bit for bit. Without the boundary ZeRO-2 keeps only the last
    backward's gradient, and without the world-size scale the gradient is halved: either fails here."""
    _train(tmp_path, "loop.iterations=1", f"trainer={trainer}", "trainer.strategy.reduce_every_backward=true",
           "model.finetune=full")
    ddp, got = metrics(runs("ddp_cpu", "full")), metrics(tmp_path)
    for k in KEYS:
        assert float(got[1][k]) == pytest.approx(float(ddp[1][k]), rel=1e-5, abs=1e-9), k


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["fsdp_cpu", "deepspeed_cpu"])
def test_sharded_run_writes_the_weights_ddp_writes(runs, trainer):
    """The (EMA) LoRA written from a sharded run is DDP's (diffusers format, loadable by ``load_lora_weights``); the
    fully fine-tuned transformer is gathered from the shards and written by ``save_pretrained``."""
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    a = load_file(str(runs("ddp_cpu", "lora") / "lora" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(runs(trainer, "lora") / "lora" / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    moved = max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k)
    assert moved > 0
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4 * moved)
    ta = SD3Transformer2DModel.from_pretrained(str(runs("ddp_cpu", "full") / "transformer")).state_dict()
    tb = SD3Transformer2DModel.from_pretrained(str(runs(trainer, "full") / "transformer")).state_dict()
    assert ta.keys() == tb.keys()
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-4, atol=1e-5)


def _resume_third(runs, run_dir: Path, trainer: str, *args: str) -> Path:
    """The uninterrupted ``runs(trainer, "lora")`` run as a kill after iteration 2 would have left it (a copy with its
    metrics cut there and its iter_0002.ckpt as last.ckpt), resumed for the third iteration; returns ``run_dir``."""
    import shutil

    shutil.copytree(runs(trainer, "lora"), run_dir)
    shutil.rmtree(run_dir / "lora")  # written anew by the resumed run (compared by _same_adapter)
    ckpts = run_dir / "checkpoints"
    torch.load(ckpts / "iter_0002.ckpt", weights_only=True)  # nothing in it needs unpickling code
    for f in ckpts.glob("*.ckpt"):
        if f.name != "iter_0002.ckpt":
            f.unlink()
    (ckpts / "iter_0002.ckpt").rename(ckpts / "last.ckpt")
    with (run_dir / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    with (run_dir / "metrics.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(r for r in rows if int(float(r["iteration"])) <= 2)
    _train(run_dir, "loop.iterations=3", f"trainer={trainer}", "callbacks.checkpoint.keep_every=1",
           f"ckpt_path={ckpts / 'last.ckpt'}", *args)
    with (run_dir / "metrics.csv").open() as fh:  # it trained iteration 3 only (a checkpoint ignored would retrain
        trained = [int(float(r["iteration"])) for r in csv.DictReader(fh) if r.get("train/reward_mean")]  # 1 to 3)
    assert trained == [1, 2, 3], trained
    return run_dir


def _same_adapter(got: Path, ref: Path) -> None:
    """The (EMA) LoRA the resumed run wrote is the uninterrupted run's: its third update used the restored optimizer
    state (Adam's moments; without them the step differs by about the lr), which no iteration-3 metric sees (they are
    measured before that update)."""
    from safetensors.torch import load_file

    a = load_file(str(ref / "lora" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(got / "lora" / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    moved = max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4 * moved)


@pytest.mark.slow
def test_fsdp_resume_is_exact(runs, tmp_path):
    """The third iteration resumed from the iteration-2 checkpoint (a full-state file, loadable onto any world size)
    equals the uninterrupted run's; the checkpoint also resumes on one process."""
    got, ref = metrics(_resume_third(runs, tmp_path / "two", "fsdp_cpu")), metrics(runs("fsdp_cpu", "lora"))
    for k in KEYS:
        assert float(got[3][k]) == pytest.approx(float(ref[3][k]), rel=1e-6, abs=1e-10), k
    _same_adapter(tmp_path / "two", runs("fsdp_cpu", "lora"))
    # onto one process (trainer.devices may change on resume): the same weights and optimizer state, so the third
    # iteration is one process's from the same state
    assert 3 in metrics(_resume_third(runs, tmp_path / "one", "fsdp_cpu", "trainer.devices=1"))


@pytest.mark.slow
def test_deepspeed_resume_is_exact(runs, tmp_path):
    """ZeRO-2: the checkpoint is one file (module weights and every rank's ZeRO partitions, loadable with
    ``weights_only=True``) and resumes exactly."""
    got, ref = metrics(_resume_third(runs, tmp_path / "run", "deepspeed_cpu")), metrics(runs("deepspeed_cpu", "lora"))
    for k in KEYS:
        assert float(got[3][k]) == pytest.approx(float(ref[3][k]), rel=1e-5, abs=1e-10), k
    _same_adapter(tmp_path / "run", runs("deepspeed_cpu", "lora"))


@pytest.mark.slow
def test_torchrun_two_nodes_equal_one_node(runs, tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 1`` (static rendezvous on 127.0.0.1, Lightning's TorchElastic
    environment) with ``trainer.num_nodes=2 trainer.devices=1`` trains as the 1-node 2-process run."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    args = [*BASE, "loop.iterations=3", "trainer=fsdp_cpu", "trainer.num_nodes=2", "trainer.devices=1",
            f"hydra.run.dir={tmp_path}"]
    procs = [subprocess.Popen([torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "stepflow.train", *args],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=500)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    ref, got = metrics(runs("fsdp_cpu", "lora")), metrics(tmp_path)
    for it in ref:
        for k in KEYS:
            assert float(got[it][k]) == pytest.approx(float(ref[it][k]), rel=1e-6, abs=1e-10), (it, k)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess2")  # its own runs: beside the module's, with the other 2-process tests
def test_sigterm_stops_a_sharded_run_cleanly(tmp_path):
    """SIGTERM to an FSDP2 run: both ranks stop at the same phase boundary, exit 143 with a usable last.ckpt, and
    the run resumes from it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "stepflow.train", *BASE, "loop.iterations=200", "trainer=fsdp_cpu",
           f"hydra.run.dir={tmp_path}"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    last = tmp_path / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not last.is_file() and time.time() < deadline and p.poll() is None:
        time.sleep(0.5)
    assert last.is_file(), "no checkpoint before the deadline"
    p.send_signal(signal.SIGTERM)
    try:
        out, err = p.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("the sharded run did not stop after SIGTERM") from None
    assert p.returncode == 143, err[-2000:]
    # one line, rank 0's, naming the signal though it reached rank 0 alone (rank 1 printed a second line, "stopped
    # by stop requested", which could land inside rank 0's progress bar line)
    assert err.count("stepflow: error:") == 1, err[-3000:]
    line = one_line_error(subprocess.CompletedProcess(cmd, p.returncode, out, err), "stopped by SIGTERM after iteration")
    assert "; resume: " in line, line
    done = max(metrics(tmp_path))
    _train(tmp_path, f"loop.iterations={done + 1}", "trainer=fsdp_cpu", f"ckpt_path={last}")
    assert max(metrics(tmp_path)) == done + 1


@pytest.mark.parametrize("trainer", ["fsdp_cpu", "deepspeed_cpu"])
@pytest.mark.parametrize("arg", ["train.weighting=grad_rms", "train.weighting=auto"])
def test_per_step_gradient_schemes_are_refused_when_sharded(tmp_path, trainer, arg, cli):
    r = cli("stepflow.train", "experiment=smoke", f"trainer={trainer}", arg, f"hydra.run.dir={tmp_path}")
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1, r.stderr[-2000:]
    assert err[0].startswith("stepflow: error:") and arg.split("=")[0] in err[0] and "trainer=ddp" in err[0], err[0]
