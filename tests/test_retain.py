"""``loop.retain_graph`` (stepflow.core.retain, docs/method.md §14): the on-policy update trains from the rollout's own
forward pass. The reference is the recomputing update, which does not share the kept graphs: with retain on and off,
the same gradient at every optimizer step (to fp32 rounding: the rollout evaluates a batch of 16, the update
micro-batches of 8) and the same metrics for 3 iterations, for the step-0 default, the every-step recipe, uniform
credit, the KL reference, GRPO-Guard, DanceGRPO's subset, the overlapped reward call, TurningPoint-GRPO and the
distill objective; under 2-process DDP (slow). The rollout is the same with and without; the settings where it cannot
apply refuse with one line (``true``) or fall back (``auto``); ``SavedBytes`` against closed forms."""

from __future__ import annotations

import math
import os

import pytest
import torch

from stepflow.errors import StepflowError
from stepflow.testing.harness import compose_config, run_cli, run_in_process

# adam_eps = 1, lr = 1: each Adam step is ~ the gradient itself, not its sign, so fp32 rounding in a gradient
# element near 0 cannot flip a whole lr-sized step and the later iterations stay comparable
BASE = ["experiment=smoke", "reward=pickscore_tiny", "train.micro_batch_size=3", "train.adam_eps=1.0", "train.lr=1.0"]
EVERY = ["advantage.over=all", "train.train_steps=null", "train.weighting=guard"]  # mini_allsteps' recipe
RECIPES = {
    "step0": ["train.train_steps=[0]", "advantage.over=trained", "sampler.schedule=eta_s"],  # the default recipe
    "every_step": EVERY,
    "uniform": ["advantage=uniform", "sampler=flow_sde"],
    # the reference's forward still runs in the update; one micro-batch of the rollout's 8 rows, as the rollout
    # evaluates them: the KL's μ_θ − μ_ref cancels 4-5 digits, so the rounding of a batch of 3 against one of 8 (1e-7
    # in v) shows at 1e-5 in its gradient, while equal batches agree to 1e-10
    "kl": [*EVERY, "train.beta_kl=0.05", "train.micro_batch_size=16"],
    "guard_released": ["train.weighting=guard_released", "train.train_steps=null"],
    "dance_subset": ["sampler=dance_sde", "advantage=uniform", "train.step_subset=random_per_sample"],
    "overlap": [*EVERY, "loop.overlap_reward=true", "loop.overlap_chunks=3"],
    "turning_point": ["advantage=turning_point", "sampler=flow_sde", "window=fixed", "window.start=0", "window.size=2"],
    "distill": ["objective=distill"],
    "cfg": [*EVERY, "loop.guidance=2.0"],  # CFG: the unconditional half detached in both
}


def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    m = build_module(compose_config("train", [*BASE, *overrides]), tmp_path)
    m.learner.optimizer = m._own_optimizer()
    return m


def _run(tmp_path, overrides, iterations=1):
    """``iterations`` iterations of a freshly built module: (the gradient of every optimizer step, the metrics of
    every iteration)."""
    import stepflow.core.algorithm as alg
    import stepflow.core.update as upd

    m = _module(tmp_path, *overrides)
    grads, metrics = [], []
    real = upd.clip_and_step

    def capture(learner, params, max_norm):
        grads.append(torch.cat([p.grad.flatten().clone() for p in params]))
        return real(learner, params, max_norm)

    upd.clip_and_step = capture
    try:
        for it in range(iterations):
            res = alg.iteration(m.learner, it)
            metrics.append(alg.iteration_metrics(res, 1))
    finally:
        upd.clip_and_step = real
    return grads, metrics


def _run_pair(tmp_path, overrides, iterations=3):
    """``iterations`` iterations of two freshly built modules in lockstep, the first recomputing, the second with
    ``loop.retain_graph=true``: (the gradients of every optimizer step and the metrics of every iteration, for each).
    After each iteration the second takes the first's weights and optimizer state, so every iteration of the two
    starts from the same bits and a difference is that iteration's own: rounding differences carried over would
    otherwise grow with the iterations (the KL's μ_θ − μ_ref, which cancels 4-5 digits, by 1e-4 at iteration 2)."""
    import stepflow.core.algorithm as alg
    import stepflow.core.update as upd

    pair = [_module(tmp_path / "off", *overrides), _module(tmp_path / "on", *overrides, "loop.retain_graph=true")]
    grads = {id(m.learner): [] for m in pair}
    metrics = {id(m.learner): [] for m in pair}
    real = upd.clip_and_step

    def capture(learner, params, max_norm):
        grads[id(learner)].append(torch.cat([p.grad.flatten().clone() for p in params]))
        return real(learner, params, max_norm)

    upd.clip_and_step = capture
    try:
        for it in range(iterations):
            for m in pair:
                metrics[id(m.learner)].append(alg.iteration_metrics(alg.iteration(m.learner, it), 1))
            off, on = pair
            with torch.no_grad():
                for a, b in zip(on.learner.policy.trainable_parameters(), off.learner.policy.trainable_parameters(),
                                strict=True):
                    a.copy_(b)
            on.learner.optimizer.load_state_dict(off.learner.optimizer.state_dict())
    finally:
        upd.clip_and_step = real
    return [(grads[id(m.learner)], metrics[id(m.learner)]) for m in pair]


def _same_metrics(a: dict, b: dict, where: str) -> None:
    skip = ("time/", "cost/", "mem/", "train/retained")  # the costs differ by design (no recomputation)
    keys = [k for k in a if not k.startswith(skip)]
    assert keys and set(keys) == {k for k in b if not k.startswith(skip)}, where
    for k in keys:
        x, y = float(a[k]), float(b[k])
        if math.isnan(x) and math.isnan(y):
            continue
        assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), f"{where}: {k} {y} with retain vs {x} recomputed"


@pytest.mark.parametrize("name", list(RECIPES))
def test_retain_trains_exactly_as_recomputation(tmp_path, name):
    ov = RECIPES[name]
    (g_off, m_off), (g_on, m_on) = _run_pair(tmp_path, ov)
    assert len(g_off) == len(g_on) >= 1, (len(g_off), len(g_on))  # some iteration took an optimizer step
    for i, (a, b) in enumerate(zip(g_off, g_on)):
        assert float(a.norm()) > 0, f"optimizer step {i}: no gradient"
        # fp32 rounding of a batch of 16 against micro-batches of 3: 2-4e-6 of the gradient's norm; an element 300x
        # below the largest, a sum of terms as large as that one, keeps the absolute error (1e-10, 2e-6 of the max)
        assert float((b - a).norm() / a.norm()) <= 1e-5, f"optimizer step {i}: {float((b - a).norm() / a.norm())}"
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()), msg=f"optimizer step {i}")
    for it, (a, b) in enumerate(zip(m_off, m_on)):
        _same_metrics(a, b, f"iteration {it}")
        assert b["train/retained"] == 1.0 and "train/retained" not in a
        assert b["cost/nfe"] < a["cost/nfe"] or b["train/samples_trained"] == 0  # the update's forwards are gone
        if name == "dance_subset":  # the rollout evaluates every row of a trained step with gradients; the update
            # recomputed only the (row, step) pairs of each row's subset
            assert b["cost/nfe_backward"] > a["cost/nfe_backward"]
        else:  # the same gradient passes, counted in the rollout
            assert b["cost/nfe_backward"] == a["cost/nfe_backward"]


def test_the_rollout_is_the_same_with_its_graphs_kept(tmp_path):
    """Keeping the trained steps' graphs does not change the trajectory: the same states, log-probs and velocities
    (the retained forward runs the same weights with autograd on); the kept velocities are those velocities, with
    gradients to the trained weights."""
    from stepflow.core.rollout import rollout

    m = _module(tmp_path, *EVERY)
    lr = m.learner
    plan = lr.plan.plan(0)
    a = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance)
    b = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance, keep=[0, 2])
    assert a.kept is None and sorted(b.kept) == [0, 2] and b.kept_gib > 0
    for f in ("latents", "velocities", "log_probs"):
        torch.testing.assert_close(getattr(b, f), getattr(a, f), rtol=1e-5, atol=1e-6)
    assert not b.latents.requires_grad and not b.velocities.requires_grad
    for k, v in b.kept.items():
        assert v.requires_grad
        torch.testing.assert_close(v.detach(), b.velocities[:, k])
        g = torch.autograd.grad(v.sum(), [p for p in lr.policy.trainable_parameters()], allow_unused=True)
        assert any(x is not None and float(x.abs().sum()) > 0 for x in g)


def test_the_kept_bytes_are_every_kept_steps_measured_by_hand(tmp_path):
    """The rollout measures the activations on its first kept step only and counts the others the same: measured
    step by step with SavedBytes on the rollout's own states, the kept steps save exactly as many bytes each, and
    their sum is ``kept_gib``."""
    from stepflow.core.retain import SavedBytes
    from stepflow.core.rollout import rollout

    m = _module(tmp_path, *EVERY)
    lr = m.learner
    pol = lr.policy
    traj = rollout(pol, lr.plan.plan(0), lr.sampler, lr.loop.num_steps, lr.guidance, keep=[0, 1, 3])
    each = []
    for k in (0, 1, 3):
        with torch.enable_grad(), SavedBytes(list(pol.parameters())) as s:
            pol.velocity(traj.latents[:, k], traj.times[k], traj.cond, lr.guidance)
        each.append(s.bytes)
    assert len(set(each)) == 1 and each[0] > 0
    assert traj.kept_gib * 2**30 == pytest.approx(sum(each), rel=1e-12)


def test_auto_keeps_the_graphs_within_the_budget_and_recomputes_beyond(tmp_path, caplog):
    """``auto``: on where it applies and the kept activations fit ``loop.retain_max_gib``; a budget below what one
    step keeps falls back (the graphs let go), logs why, and trains exactly as recomputation."""
    g_off, m_off = _run(tmp_path / "off", EVERY, iterations=1)
    g_on, m_on = _run(tmp_path / "on", [*EVERY, "loop.retain_graph=auto"], iterations=1)
    assert m_on[0]["train/retained"] == 1.0 and m_on[0]["mem/retained_gib"] > 0
    with caplog.at_level("INFO", logger="stepflow.train"):
        g_low, m_low = _run(tmp_path / "low", [*EVERY, "loop.retain_graph=auto", "loop.retain_max_gib=1e-9"], 1)
    assert m_low[0]["train/retained"] == 0.0 and "mem/retained_gib" not in m_low[0]
    assert any("loop.retain_graph=auto: the update recomputes: the kept activations would take" in r.message
               for r in caplog.records)
    torch.testing.assert_close(g_low[0], g_off[0], rtol=1e-5, atol=0)
    assert m_low[0]["cost/nfe"] == m_off[0]["cost/nfe"] and m_on[0]["cost/nfe"] < m_off[0]["cost/nfe"]
    # auto where it cannot apply (two optimizer steps per rollout): recomputation, said once
    _, m_two = _run(tmp_path / "two", [*EVERY, "loop.retain_graph=auto", "train.updates_per_iter=2"], 1)
    assert m_two[0]["train/retained"] == 0.0


def test_dropout_in_the_transformer_is_refused_at_run_time(tmp_path):
    """The rollout runs in eval mode and the update in train mode: with an active dropout their forwards differ, so
    ``true`` refuses (a LoRA dropout is not a config field; the model's own modules are looked at)."""
    import stepflow.core.algorithm as alg

    m = _module(tmp_path, *EVERY, "loop.retain_graph=true")
    m.learner.policy.transformer.add_module("_drop", torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"^loop.retain_graph=true: dropout 0.1 is active in training mode only"):
        alg.iteration(m.learner, 0)


@pytest.mark.parametrize("overrides,needle", [
    (["train.updates_per_iter=2"], "loop.retain_graph=true: train.updates_per_iter=2 takes several optimizer steps"),
    (["train.update_per_step=true"], "loop.retain_graph=true: train.update_per_step=true takes one optimizer step"),
    (["objective=nft", "sampler=dpm2"], "loop.retain_graph=true: the forward-process objectives train at re-noised"),
    (["advantage=tempflow", "sampler=flow_sde"], "loop.retain_graph=true: advantage=tempflow trains branches"),
    (["train.weighting=grad_rms"], "loop.retain_graph=true: train.weighting=grad_rms back-propagates each step"),
    (["trainer=fsdp_cpu"], "loop.retain_graph=true: the fsdp strategy reshards"),
    (["trainer=deepspeed_cpu"], "loop.retain_graph=true: the deepspeed strategy reshards"),
])
def test_settings_where_it_cannot_apply_are_refused(overrides, needle):
    from stepflow.train import settings

    with pytest.raises(StepflowError) as err:
        settings(compose_config("train", [*BASE, "loop.retain_graph=true", *overrides]))
    assert str(err.value).startswith(needle), str(err.value)
    settings(compose_config("train", [*BASE, "loop.retain_graph=auto", *overrides]))  # auto: falls back at run time


@pytest.mark.parametrize("value,needle", [("maybe", "loop.retain_graph: must be true, false or auto"),
                                          ("1", "loop.retain_graph: must be true, false or auto")])
def test_bad_values_are_one_line(value, needle):
    from stepflow.train import settings

    with pytest.raises(StepflowError, match=f"^{needle}"):
        settings(compose_config("train", [*BASE, f"loop.retain_graph={value}"]))
    with pytest.raises(StepflowError, match="^loop.retain_max_gib: must be a number > 0"):
        settings(compose_config("train", [*BASE, "loop.retain_max_gib=0"]))


def test_saved_bytes_counts_what_autograd_saves():
    """Closed forms: ``exp`` saves its output (n floats), ``x * y`` both inputs, ``x @ W`` with W a weight only x;
    the same tensor saved twice counts once; nothing is counted outside the block."""
    from stepflow.core.retain import SavedBytes

    x = torch.randn(1000, requires_grad=True)
    with SavedBytes() as s:
        x.exp()
    assert s.bytes == 4000
    y = torch.randn(1000, requires_grad=True)
    with SavedBytes() as s:
        x * (y + 1)  # saves x and (y + 1)
    assert s.bytes == 8000
    w = torch.nn.Parameter(torch.randn(1000, 30))
    with SavedBytes([w]) as s:
        h = x[None] @ w  # saves x (1, 1000) and w (a weight: not counted)
    assert s.bytes == 4000
    h.sum().backward()  # the saved tensors are what they were
    with SavedBytes() as s:
        x * x  # the same tensor twice
    assert s.bytes == 4000


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess2")
def test_ddp_with_retain_takes_the_step_of_one_process_recomputing(tmp_path):
    """2-process DDP on the CPU with retain on takes the optimizer step that one process takes recomputing (the kept
    graphs are back-propagated on each rank and the gradients summed by the manual all-reduce)."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["experiment=smoke", "reward=pickscore_tiny", "loop.iterations=1", "eval.max_prompts=2",
              "train.adam_eps=1.0", "train.lr=1.0", "train.max_grad_norm=0", *EVERY]
    r1 = run_in_process("stepflow.train", *common, f"hydra.run.dir={one}")  # one process: no fresh interpreter
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run_cli("stepflow.train", *common, "loop.retain_graph=true", "trainer=ddp_cpu", f"hydra.run.dir={two}",
                 timeout=400)
    assert r2.returncode == 0, r2.stderr[-3000:]
    from safetensors.torch import load_file

    wa = load_file(str(one / "lora" / "pytorch_lora_weights.safetensors"))
    wb = load_file(str(two / "lora" / "pytorch_lora_weights.safetensors"))
    moved = max(float(wa[k].abs().max()) for k in wa if "lora_B" in k)
    assert moved > 1e-5
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-3 * moved, rtol=1e-3)


def _glibc() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "gnu_get_libc_version")
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.extended  # two 3-iteration mini_allsteps runs (~110 s on a loaded CI machine): make test-extended
@pytest.mark.skipif(not _glibc(), reason="glibc's malloc")
def test_the_memory_the_backward_frees_is_the_next_rollouts(tmp_path, run_module):
    """The kept graphs' activations, freed together by the update's backward, are the next iteration's rollout and
    estimate memory (``loop.retain_keep_memory``, stepflow.core.retain.keep_freed_memory): from the second iteration on,
    those phases fault in a few pages (iterations 2 and 3 together: 12-16 % of what the graphs hold, most of it in the
    second while the heap grows to its peak), while glibc left alone returns the memory to the OS and the rollout and
    estimate fault much of it back in (77-177 % over the two; glibc's own thresholds adapt now and then, so one
    iteration alone may show none). Fresh processes: the allocator's settings are per process."""
    import csv

    ov = ["experiment=mini_allsteps", "loop.iterations=3", "eval.every=0", "eval.at_start=false", "eval.max_prompts=4",
          "loop.retain_graph=true"]
    share = {}
    for keep in ("true", "false"):
        d = tmp_path / keep
        r = run_module("stepflow.train", *ov, f"loop.retain_keep_memory={keep}", f"hydra.run.dir={d}")
        assert r.returncode == 0, r.stderr[-2000:]
        rows = [x for x in csv.DictReader((d / "metrics.csv").open()) if x.get("mem/retained_gib")]
        assert len(rows) == 3 and all(float(x["train/retained"]) == 1.0 for x in rows)
        pages = [float(x["mem/retained_gib"]) * 2**30 / 4096 for x in rows]
        share[keep] = [(float(x["mem/page_faults_rollout"]) + float(x["mem/page_faults_estimate"])) / p
                       for x, p in zip(rows, pages)]
    assert sum(share["true"][1:]) < 0.3 and sum(share["false"][1:]) > 0.5, share


def test_keep_freed_memory_is_applied_once_and_a_bad_value_is_one_line(cli, tmp_path):
    from stepflow.core import retain

    assert retain.keep_freed_memory() is _glibc() and retain.keep_freed_memory() is _glibc()
    r = cli("stepflow.train", "experiment=smoke", f"hydra.run.dir={tmp_path}", "loop.retain_keep_memory=sometimes")
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and "loop.retain_keep_memory" in err[0], r.stderr[-2000:]


#: the per-phase peak resident set needs Linux's /proc/self/clear_refs (stepflow.core.algorithm._reset_peak_rss)
needs_clear_refs = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                      reason="Linux's /proc/self/clear_refs")


@needs_clear_refs
def test_each_phase_reports_its_own_peak_resident_set():
    """``mem/peak_rss_gib_<phase>`` (the CPU's counterpart of CUDA's per-phase peak): a phase that touches 256 MiB and
    frees them peaks that much above the next phase, which touches nothing (the peak is reset at each phase's start:
    without the reset the second phase reports the first one's peak)."""
    from stepflow.core.algorithm import Phases, _peak_rss_gib

    class _Policy:
        device, nfe, nfe_grad = torch.device("cpu"), 0, 0

    ph = Phases(_Policy())
    with ph("alloc"):
        x = torch.ones(64 * 2**20)  # 256 MiB, every page written; over glibc's mmap threshold: unmapped when freed
        del x
    with ph("idle"):
        now = _peak_rss_gib()
    assert ph.peak_rss_gib["alloc"] - ph.peak_rss_gib["idle"] >= 0.24, ph.peak_rss_gib
    assert abs(ph.peak_rss_gib["idle"] - now) < 0.05, (ph.peak_rss_gib, now)
    with ph("alloc"):  # a phase met again keeps its largest peak
        pass
    assert ph.peak_rss_gib["alloc"] - ph.peak_rss_gib["idle"] >= 0.24, ph.peak_rss_gib


@needs_clear_refs
def test_a_runs_metrics_carry_every_phases_peak_resident_set(tmp_path):
    m = _module(tmp_path, *RECIPES["every_step"], "loop.retain_graph=true").iterate()
    for p in ("rollout", "estimate", "reward", "advantage", "update"):
        assert 0.05 < m[f"mem/peak_rss_gib_{p}"] < 64, (p, m[f"mem/peak_rss_gib_{p}"])


@pytest.mark.slow
@pytest.mark.extended  # the benchmark script's own test, minutes on 2 cores: make test-extended
@needs_clear_refs
def test_bench_memory_trains_each_variant_in_its_own_process(tmp_path, capsys):
    """``experiments/bench_iteration.py --compare loop.retain_graph=false,true --memory``: a row per variant with each
    phase's peak resident set, and the kept activations where retain kept some."""
    from helpers.experiments import load_experiment

    bench = load_experiment("bench_iteration")
    bench.main(["--settings", "shapes_default", "--compare", "loop.retain_graph=false,true", "--memory", "--iters", "1",
                "--run-dir", str(tmp_path), "experiment=smoke"])
    rows = [r.split("|")[1:-1] for r in capsys.readouterr().out.splitlines() if r.startswith("| loop.retain_graph=")]
    assert [r[0].strip() for r in rows] == ["loop.retain_graph=false", "loop.retain_graph=true"], rows
    for r in rows:
        assert all(0.05 < float(x) < 64 for x in r[1:6]), r
    assert rows[0][6].strip() == "—" and float(rows[1][6]) > 0, rows
    with pytest.raises(SystemExit):
        bench.main(["--memory"])


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc")
def test_a_retaining_cpu_run_under_glibc_says_how_to_preload_tcmalloc(tmp_path, caplog, monkeypatch):
    """Under glibc's malloc the kept graphs fragment the heap (docs/results.md, "What it costs in memory"): a retaining
    CPU run logs once how to preload tcmalloc; under a preloaded allocator, or recomputing, nothing is said."""
    from stepflow.core import retain

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    hint = retain.allocator_hint()
    assert hint is not None and "glibc" in hint and "LD_PRELOAD=" in hint and "tcmalloc" in hint, hint
    with caplog.at_level("INFO", logger="stepflow.train"):
        m = _module(tmp_path / "on", *EVERY, "loop.retain_graph=true")
        m.iterate()
        m.iterate()
    assert [r.message for r in caplog.records].count(hint) == 1
    caplog.clear()
    with caplog.at_level("INFO", logger="stepflow.train"):
        _module(tmp_path / "off", *EVERY).iterate()
    assert hint not in [r.message for r in caplog.records]
    for lib in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "libjemalloc.so.2"):
        monkeypatch.setenv("LD_PRELOAD", lib)
        assert retain.allocator_hint() is None
