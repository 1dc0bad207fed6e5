"""The prepared GPU check, on the CPU: ``experiments/gpu_check.py --tiny`` for every model family and both fine-tuning
modes, the random builders of ``stepflow.testing.random_policies`` (tiny: the family's classes and text shapes; full size
on the meta device: the published architectures, without memory), the ``model=*_random`` configs through the training
CLI, the memory estimate, and ``experiments/gpu_check.sh``'s dry run (``GPU_CHECK_TINY=1``)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from stepflow.testing import random_policies as rf
from stepflow.testing.harness import (
    RANDOM_TINY,
    ROOT,
    base_parameters,
    compose_config,
    random_config_policies,
    train_random_config_once,
)

FAMILY_POLICY = {"sd35_medium": "SD3Policy", "sd35_large": "SD3Policy", "flux_dev": "FluxPolicy",
                 "qwen_image": "QwenImagePolicy"}
TRANSFORMER = {"sd35_medium": "SD3Transformer2DModel", "sd35_large": "SD3Transformer2DModel",
               "flux_dev": "FluxTransformer2DModel", "qwen_image": "QwenImageTransformer2DModel"}
VAE = {"sd35_medium": "AutoencoderKL", "sd35_large": "AutoencoderKL", "flux_dev": "AutoencoderKL",
       "qwen_image": "AutoencoderKLQwenImage"}
#: the real text encoders' output shapes: (token length or None for per-prompt lengths, width, pooled width)
TEXT = {"sd35_medium": (333, 4096, 2048), "sd35_large": (333, 4096, 2048), "flux_dev": (512, 4096, 768),
        "qwen_image": (None, 3584, 0)}


def _gpu_check():
    path = ROOT / "experiments" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _base_names(obj) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


# ------------------------------------------------------------------------------------------ gpu_check.py --tiny
@pytest.mark.parametrize("model", rf.MODELS)
def test_gpu_check_tiny_runs_each_model_with_lora_and_full(model, tmp_path, capsys):
    out = tmp_path / "gc.json"
    rc = _gpu_check().main(["--tiny", "--device", "cpu", "--runs", f"{model}:lora,{model}:full", "--iters", "1",
                            "--batch", "4", "--group-size", "2", "--substeps", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert [(r["model"], r["finetune"], r["status"]) for r in runs] == [(model, "lora", "ok"), (model, "full", "ok")]
    lora, full = runs
    assert lora["transformer_class"] == TRANSFORMER[model] and FAMILY_POLICY[model] in lora["policy"]
    assert lora["trained_params"] < full["trained_params"] == full["transformer_params"]  # full: every weight
    for r in res["results"]:
        assert r["finite"] and r["steps_trained"] >= 1 and r["grad_norm"] > 0 and r["nfe"] > 0
    assert [r["scheme"] for r in res["results"]] == ["uniform", "gain", "uniform", "gain"]
    # the per-run table, with seconds and memory columns per phase, and the final summary table
    assert "rollout_s" in printed and "update_GiB" in printed and "summary" in printed
    assert f"{model:12s} lora     ok" in printed and f"{model:12s} full     ok" in printed


def test_gpu_check_all_and_runs_selection():
    gc = _gpu_check()
    assert gc._runs(gc.parse_args(["--all"])) == gc.ALL_RUNS
    assert {m for m, _ in gc.ALL_RUNS} == set(rf.MODELS) and {f for _, f in gc.ALL_RUNS} == {"lora", "full"}
    assert len(gc.ALL_RUNS) == 2 * len(rf.MODELS) and gc.ALL_RUNS[0] == ("sd35_medium", "lora")
    assert gc._runs(gc.parse_args(["--runs", "flux_dev:full,qwen_image"])) == [("flux_dev", "full"),
                                                                              ("qwen_image", "lora")]
    with pytest.raises(SystemExit, match="--runs"):
        gc._runs(gc.parse_args(["--runs", "sdxl:lora"]))


def test_gpu_check_skips_what_does_not_fit_and_keeps_going(tmp_path, monkeypatch, capsys):
    """The fit check (CUDA only) skips a run with one line; simulated on the CPU with a tiny 'free memory'."""
    gc = _gpu_check()
    args = gc.parse_args(["--tiny", "--device", "cpu"])
    counts = rf.param_counts("qwen_image")
    ok, need = rf.fits(counts, "full", free_gib=141.0)
    assert not ok and need > 200  # Qwen-Image full fine-tuning: ~245 GiB before activations
    ok, need = rf.fits(counts, "lora", free_gib=141.0)
    assert ok and 35 < need < 50
    assert rf.fits(rf.param_counts("flux_dev"), "full", free_gib=141.0)[0] is False
    assert rf.fits(rf.param_counts("sd35_large"), "full", free_gib=141.0)[0] is True
    monkeypatch.setattr(gc, "_free_cuda", lambda device: 10.0)
    args.tiny = False
    run = gc.run_one("qwen_image", "lora", args, torch.device("cuda"), torch.float32, "float32")
    assert run["status"] == "skipped" and "GiB free" in run["reason"]
    assert "== skip qwen_image lora: needs ~" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ random builders
@pytest.mark.parametrize("model", rf.MODELS)
def test_tiny_random_builder_is_its_familys_architecture(model):
    pol = rf.random_policy(model, tiny=True, device="cpu", dtype="float32",
                           lora={"rank": 2, "alpha": 4, "targets": rf.lora_targets(model)})
    assert FAMILY_POLICY[model] in _base_names(pol)
    assert type(pol.transformer).__name__ == TRANSFORMER[model] and type(pol.vae).__name__ == VAE[model]
    tcfg = pol.transformer.config
    if model == "sd35_medium":
        assert len(tcfg.dual_attention_layers) > 0 and tcfg.qk_norm == "rms_norm"
    if model == "sd35_large":
        assert tuple(tcfg.dual_attention_layers) == () and tcfg.qk_norm == "rms_norm"
    if model == "flux_dev":
        assert tcfg.guidance_embeds and tcfg.num_single_layers >= 1 and pol.embedded_guidance == 3.5
    if model == "qwen_image":
        assert not tcfg.guidance_embeds and pol.negative_prompt == " "
    prompts = ["a cat", "two red dogs on a green bench"]
    c = pol.encode(prompts)
    assert c.tokens.shape[0] == 2 and bool(torch.isfinite(c.tokens).all())
    if model == "qwen_image":  # per-prompt lengths: zero-padded to the longest, with a mask, and no pooled vector
        assert c.mask is not None and c.mask.sum(1).tolist() == [rf._qwen_len(p) for p in prompts]
        assert c.pooled.shape == (2, 0)
    else:
        assert c.mask is None and c.pooled.shape[1] == rf.TINY_SPECS[model]["text"]["pooled_dim"]
    again = pol.encode(prompts[:1]).tokens  # fixed per prompt (and cached)
    assert torch.equal(again[0], c.tokens[0, :again.shape[1]])
    assert pol.encoder_calls == 1  # cached
    x = torch.randn(2, *pol.latent_shape)
    v = pol.velocity(x, 0.7, c, guidance=3.0)
    assert v.shape == x.shape and bool(torch.isfinite(v).all())
    img = pol.decode(x)
    assert img.shape == (2, 3, 64, 64) and float(img.min()) >= 0 and float(img.max()) <= 1
    grid = pol.time_grid(4)
    assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0
    assert sum(p.numel() for p in pol.lora_parameters()) > 0


def test_tiny_builds_in_bf16_as_on_the_gpu():
    """The GPU path's dtypes: the transformer (and its buffers) constructed in bf16, the VAE fp32, a finite
    bf16 forward with CFG, for every family."""
    for model in rf.MODELS:
        pol = rf.random_policy(model, tiny=True, device="cpu", dtype="bfloat16")
        assert {p.dtype for p in pol.transformer.parameters()} == {torch.bfloat16}
        assert {b.dtype for b in pol.transformer.buffers()} <= {torch.bfloat16}
        assert {p.dtype for p in pol.vae.parameters()} == {torch.float32}
        c = pol.encode(["a cat", "two red dogs"])
        assert c.tokens.dtype == torch.bfloat16
        v = pol.velocity(torch.randn(2, *pol.latent_shape), 0.5, c, guidance=4.0)
        assert v.dtype == torch.float32 and bool(torch.isfinite(v).all()), model


@pytest.mark.parametrize("model", rf.MODELS)
def test_full_size_builds_on_the_meta_device_at_the_published_size(model):
    """The published architectures, built by the same builder without memory: size, latent, text shapes, LoRA."""
    counts = rf.param_counts(model)
    size = (counts["transformer"] + counts["buffers"]) / 1e9
    assert abs(size - rf.SPECS[model]["published_b"]) / rf.SPECS[model]["published_b"] < 0.01, size
    pol = rf.random_policy(model, device="meta", lora={"rank": 32, "alpha": 64, "targets": rf.lora_targets(model)})
    assert pol.device.type == "meta" and next(pol.transformer.parameters()).dtype == torch.bfloat16
    assert next(pol.vae.parameters()).dtype == torch.float32
    assert pol.latent_shape == (16, 64, 64) and FAMILY_POLICY[model] in _base_names(pol)
    assert sum(p.numel() for p in pol.lora_parameters()) == counts["lora"]
    length, width, pooled = TEXT[model]
    c = pol.encode(["a photo of a cat", "a dog"])
    assert c.tokens.shape[2] == width and c.pooled.shape[1] == pooled
    if length is not None:
        assert c.tokens.shape[1] == length
    tcfg = pol.transformer.config
    want = {"sd35_medium": dict(num_layers=24, num_attention_heads=24, attention_head_dim=64, pos_embed_max_size=384),
            "sd35_large": dict(num_layers=38, num_attention_heads=38, attention_head_dim=64, joint_attention_dim=4096,
                               caption_projection_dim=2432, pooled_projection_dim=2048, qk_norm="rms_norm",
                               pos_embed_max_size=192),
            "flux_dev": dict(num_layers=19, num_single_layers=38, num_attention_heads=24, attention_head_dim=128,
                             joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True),
            "qwen_image": dict(num_layers=60, num_attention_heads=24, attention_head_dim=128,
                               joint_attention_dim=3584)}[model]
    assert {k: tcfg[k] for k in want} == want
    if model == "sd35_large":
        assert tuple(tcfg.dual_attention_layers) == ()
    if model.startswith("sd35"):  # SD3's forward runs on meta tensors: the whole full-size graph, shapes only
        v = pol.velocity(torch.zeros(1, *pol.latent_shape, device="meta"), 0.5, c.index([0]))
        assert v.shape == (1, *pol.latent_shape)


def test_full_fine_tuning_writes_no_random_weights_unless_asked(tmp_path):
    pol = rf.random_policy("sd35_large", tiny=True, device="cpu", dtype="float32", finetune="full", save_weights=False)
    d = pol.save_trained(tmp_path / "t")
    assert (d / "config.json").is_file() and (d / "NOT_SAVED.txt").is_file()
    assert not list(d.glob("*.safetensors"))
    pol.save_weights = True
    assert list(pol.save_trained(tmp_path / "u").glob("*.safetensors"))


# ------------------------------------------------------------------------------------------ model=*_random configs
#: the *_random configs built by random_policies.random_policy (a family with its own builder tests its configs in
#: its own file: the Wan families' stepflow/testing/tiny_wan.py, the editing families' random_edit.py in
#: tests/test_random_edit.py, FLUX.2 / Z-Image's random_flux2_zimage.py in tests/test_random_flux2_zimage.py)
RANDOM_CONFIGS = sorted(p.stem for p in (ROOT / "stepflow" / "conf" / "model").glob("*_random.yaml")
                        if "random_policies.random_policy" in p.read_text())


def test_there_is_a_random_config_per_model():
    assert RANDOM_CONFIGS == sorted(f"{m}_random" for m in rf.MODELS)


@pytest.mark.parametrize("name", RANDOM_CONFIGS)
def test_random_config_composes_and_builds_tiny_and_full_size(name):
    model = name.removesuffix("_random")
    pol, big = random_config_policies(name)
    assert FAMILY_POLICY[model] in _base_names(pol) and type(pol.transformer).__name__ == TRANSFORMER[model]
    assert pol.has_lora and pol.latent_shape == (16, 8, 8)
    cfg = compose_config("train", [f"model={name}", *RANDOM_TINY])
    assert set(cfg.lora.targets) == set(rf.lora_targets(model))  # recipe/<model>_random.yaml = the real recipe
    full, _ = random_config_policies(name, "model.finetune=full", full_size=False)
    assert full.finetune == "full" and not full.has_lora
    # full size on the meta device: the YAML's defaults build the published model (no memory)
    assert base_parameters(big.transformer) == rf.param_counts(model)["transformer"]
    assert big.latent_shape == (16, 64, 64)


@pytest.mark.slow
@pytest.mark.parametrize("name,finetune", [("sd35_medium_random", "full"), ("flux_dev_random", "lora")])
def test_random_config_trains_one_iteration_through_the_cli(tmp_path, name, finetune):
    """The strategies matrix's command line (gpu_check.sh) at tiny size on the CPU: stand-in reward, memory.csv."""
    train_random_config_once(tmp_path, name, finetune)


# ------------------------------------------------------------------------------------------ memory estimate
def test_memory_estimate_orders_and_parts():
    c = rf.param_counts("sd35_medium")
    lora, full = (rf.memory_estimate(c, ft, "ddp", 8) for ft in ("lora", "full"))
    gib = 2**30
    w = (c["transformer"] + c["buffers"]) * 2 / gib
    assert lora["weights"] == pytest.approx(w) and "reference" not in lora
    assert full["reference"] == pytest.approx(w) and full["adam"] == pytest.approx(2 * c["transformer"] * 2 / gib)
    assert full["total"] > 5 * w  # weights, grads, buckets, two moments, EMA, reference
    for ft in ("lora", "full"):
        ddp, fsdp, ds = (rf.memory_estimate(c, ft, s, 8)["total"] for s in rf.STRATEGIES)
        assert fsdp < ddp and ds <= ddp + 1e-9
    assert rf.memory_estimate(c, "full", "fsdp", 1)["total"] > rf.memory_estimate(c, "full", "fsdp", 8)["total"]
    fsdp, ds = rf.memory_estimate(c, "full", "fsdp", 8), rf.memory_estimate(c, "full", "deepspeed", 8)
    assert fsdp["weights"] == pytest.approx(w / 8) and fsdp["reference"] == pytest.approx(w / 8)  # sharded too
    assert ds["weights"] == pytest.approx(w) and ds["adam"] == pytest.approx(8 * c["transformer"] / 8 / gib)
    table = rf.memory_table(counts={m: rf.param_counts(m) for m in rf.MODELS})
    lines = table.splitlines()
    assert len(lines) == 2 + 2 * len(rf.MODELS) and "fsdp ×8" in lines[0]
    assert "✗" in [x for x in lines if x.startswith("| qwen_image") and "full" in x][0]  # 20 B full FT: not on 80 GB


# ------------------------------------------------------------------------------------------ gpu_check.sh
@pytest.mark.slow
def test_gpu_check_sh_dry_run_on_the_cpu(tmp_path):
    """GPU_CHECK_TINY=1: the script's sequence at tiny size (strategies as trainer=cpu runs), its outputs and
    summary."""
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_TINY": "1", "GPU_CHECK_PARTS": "sd35m strat_lora", "OUT": str(out),
           "RUNS": str(tmp_path / "runs"), "PYTHON": __import__("sys").executable, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summary = (out / "summary.txt").read_text()
    assert "sd35m\t0\t" in summary and "strategy_auto_lora\t0\t" in summary
    assert "sd35_medium  lora  ok" in summary and "sd35_medium  full  ok" in summary
    rows = list(csv.DictReader((out / "strategies.tsv").open(), delimiter="\t"))
    assert len(rows) == 1 and rows[0]["rc"] == "0" and float(rows[0]["iteration_s"]) > 0 and rows[0]["trained"] == "yes"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "sd35m.json", "strategies.tsv", "summary.txt"]
    assert not (tmp_path / "runs" / "auto-lora").exists()  # run directories are removed after their row is taken
    assert json.loads((out / "sd35m.json").read_text())["runs"][1]["finetune"] == "full"
    assert Path(out / "gpu_check.log").stat().st_size > 0
