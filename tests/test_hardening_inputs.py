"""Bad inputs, round 2: a checkpoint that is no checkpoint at all (random bytes, empty, truncated) or one of another
model, prompt files that are not UTF-8 or not JSON lines, LoRA files of random bytes, damaged ``config.json`` files,
negative / non-finite guidance and sizes the model cannot take, the keys the README tells users to set on the tiny
model configs, and ``experiments/check_estimate_decoder.py``. Each is one line naming its field and the fix, before
any weights load where it can be; in-process unless the whole command line matters."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers.payloads import evil_checkpoint, payload_checkpoint

from stepflow.cli import CONF_DIR
from stepflow.errors import StepflowError
from stepflow.testing.harness import ROOT, compose_config, one_line_error


# ------------------------------------------------------------------------------------------------ checkpoints
def _not_checkpoints(d: Path) -> dict[str, Path]:
    """Files that are no torch checkpoint at all: random bytes, empty, a torch zip cut in half, a legacy torch file
    cut short, a zip of something else."""
    import zipfile

    files = {"random": d / "rand.ckpt", "empty": d / "empty.ckpt", "truncated": d / "trunc.ckpt",
             "legacy_truncated": d / "legacy.ckpt", "other_zip": d / "other.ckpt"}
    files["random"].write_bytes(b"garbage")
    files["empty"].write_bytes(b"")
    torch.save({"state_dict": {"w": torch.zeros(64)}}, d / "whole.ckpt")
    whole = (d / "whole.ckpt").read_bytes()
    files["truncated"].write_bytes(whole[: len(whole) // 2])
    torch.save({"w": torch.zeros(8)}, d / "legacy_whole.ckpt", _use_new_zipfile_serialization=False)
    files["legacy_truncated"].write_bytes((d / "legacy_whole.ckpt").read_bytes()[:-10])
    with zipfile.ZipFile(files["other_zip"], "w") as z:
        z.writestr("notes.txt", "not a checkpoint")
    return files


@pytest.mark.parametrize("kind", ["random", "empty", "truncated", "legacy_truncated", "other_zip"])
def test_a_file_that_is_no_checkpoint_says_so(tmp_path, kind):
    from stepflow.shell.checkpoint import safe_load

    path = _not_checkpoints(tmp_path)[kind]
    with pytest.raises(StepflowError) as info:
        safe_load(path, "ckpt_path")
    msg = str(info.value)
    assert msg.startswith(f"ckpt_path: {path} is not a checkpoint (") and "\n" not in msg, msg
    assert "running code" not in msg and msg.endswith("point it at <run dir>/checkpoints/last.ckpt"), msg
    assert ("(empty)" in msg) == (kind == "empty"), msg


def test_a_crafted_pickle_is_still_refused_without_running_code(tmp_path):
    from stepflow.shell.checkpoint import safe_load

    evil, marker = evil_checkpoint(tmp_path)
    with pytest.raises(StepflowError, match=r"ckpt_path: .*evil\.ckpt cannot be loaded as a checkpoint without "
                                            r"running code from it \(torch.load\(weights_only=True\) refused it"):
        safe_load(evil, "ckpt_path")
    assert not marker.exists()
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, good)
    assert torch.equal(safe_load(good, "ckpt_path")["state_dict"]["w"], torch.ones(2))


def test_a_reward_checkpoint_of_random_bytes_is_not_called_code(tmp_path):
    from stepflow.errors import RewardLoadError
    from stepflow.rewards.loading import load_state_dict

    path = tmp_path / "HPS_v2.1_compressed.pt"
    path.write_bytes(b"\x13\x37 random bytes, no pickle")
    with pytest.raises(RewardLoadError) as info:
        load_state_dict(str(path), "HPSv2 checkpoint", "reward.checkpoint")
    msg = str(info.value)
    assert "it is not a checkpoint (not a torch file" in msg and "reward.checkpoint" in msg, msg
    assert "running code" not in msg and "\n" not in msg, msg
    evil, marker = payload_checkpoint(tmp_path, "evil.pt", {}, legacy_pickle=True)  # a pickle that needs code
    with pytest.raises(RewardLoadError, match="without running code from it"):  # still the refusal
        load_state_dict(evil, "HPSv2 checkpoint", "reward.checkpoint")
    assert not marker.exists()


def test_train_with_a_checkpoint_of_random_bytes_is_one_line(tmp_path, cli):
    """The issue's acceptance check: `printf 'garbage' > rand.ckpt; python -m stepflow.train experiment=smoke
    ckpt_path=rand.ckpt` (through Lightning's restore and AtomicCheckpointIO)."""
    rand = tmp_path / "rand.ckpt"
    rand.write_bytes(b"garbage")
    r = cli("stepflow.train", "experiment=smoke", f"ckpt_path={rand}", f"hydra.run.dir={tmp_path / 'run'}")
    line = one_line_error(r, "ckpt_path")
    assert "is not a checkpoint" in line and "running code" not in r.stderr + r.stdout, line


def _ckpt(**state) -> dict:
    return {"state_dict": {k: torch.zeros(*s) for k, s in state.items()}, "stepflow": {}}


def test_a_checkpoint_of_another_model_is_one_line_naming_the_first_difference():
    from stepflow.shell.checkpoint import check_compatible

    model = {"policy.a.lora_A.weight": torch.zeros(4, 32), "policy.a.lora_B.weight": torch.zeros(32, 4)}
    check_compatible(_ckpt(**{k: tuple(v.shape) for k, v in model.items()}), model, "last.ckpt")  # its own: passes
    check_compatible(_ckpt(**{k: tuple(v.shape) for k, v in model.items()}), {k: v.shape for k, v in model.items()})
    rank8 = _ckpt(**{"policy.a.lora_A.weight": (8, 32), "policy.a.lora_B.weight": (32, 8)})
    with pytest.raises(StepflowError, match=r"^ckpt_path: last.ckpt holds a checkpoint of another model \("
                                            r"policy.a.lora_A.weight: shape \[8, 32\] in the checkpoint vs \[4, 32\] "
                                            r"in the model; 2 keys differ\); resume with the run's own model"):
        check_compatible(rank8, model, "last.ckpt")
    other = _ckpt(**{"policy.b.lora_A.weight": (4, 32), "policy.a.lora_B.weight": (32, 4)})
    with pytest.raises(StepflowError, match=r"policy.a.lora_A.weight: in the model, not in the checkpoint; 2 keys"):
        check_compatible(other, model, "last.ckpt")
    extra = _ckpt(**{k: tuple(v.shape) for k, v in model.items()}, **{"policy.z.weight": (3,)})
    with pytest.raises(StepflowError, match=r"policy.z.weight: in the checkpoint, not in the model; 1 key differs"):
        check_compatible(extra, model, "last.ckpt")


def test_a_checkpoint_without_state_or_stepflow_entry_is_one_line():
    from stepflow.shell.checkpoint import check_compatible

    with pytest.raises(StepflowError, match=r"^ckpt_path: x.ckpt is not a training checkpoint \(no state_dict\)"):
        check_compatible({"w": torch.zeros(2)}, {}, "x.ckpt")
    with pytest.raises(StepflowError, match=r"^ckpt_path: x.ckpt is not a checkpoint of this kind of run \(no "
                                            r"'stepflow' entry"):
        check_compatible({"state_dict": {}}, {}, "x.ckpt", needs=("stepflow",))


# ------------------------------------------------------------------------------------------------ prompt files
@pytest.mark.parametrize("name,data,needle", [
    ("p.txt", b"a red cube\na blue \xe9t\xe9 ball\n", r"data.eval_file: .*p.txt is not UTF-8 text \(byte 18, line 2: b'\\xe9'"),
    ("p.jsonl", b'{"prompt": "a"}\n\xff\n', r"data.eval_file: .*p.jsonl is not UTF-8 text \(byte 16, line 2"),
    ("p.jsonl", b'{"prompt": "a"}\n\n{"prompt": "b",}\n', r"data.eval_file: .*p.jsonl:3 is not valid JSON"),
    ("p.jsonl", b'{"prompt": "a"}\n{"text": "b"}\n', r"data.eval_file: .*p.jsonl:2 has no string 'prompt' field "
                                                      r"\(no 'prompt' field\)"),
    ("p.jsonl", b'{"prompt": 3}\n', r"data.eval_file: .*p.jsonl:1 has no string 'prompt' field \('prompt' is a int"),
    ("p.jsonl", b'["a", "b"]\n', r"data.eval_file: .*p.jsonl:1 is a JSON list, not an object"),
    ("p.txt", b"\n  \n", r"data.eval_file: prompt file is empty: .*p.txt; give .jsonl"),
    ("p.json", b'[{"prompt": "a"}]', r"data.eval_file: .*p.json is a .json file; stepflow reads .jsonl"),
], ids=["latin1_txt", "bad_byte_jsonl", "not_json", "no_prompt", "prompt_not_str", "json_list", "empty", "json"])
def test_a_bad_prompt_file_names_its_field_and_where(tmp_path, name, data, needle):
    from stepflow.core.data import load_prompt_file
    from stepflow.errors import PromptFileError

    (tmp_path / name).write_bytes(data)
    with pytest.raises(PromptFileError, match=needle) as info:
        load_prompt_file(tmp_path / name, "data.eval_file")
    assert "\n" not in str(info.value)


def test_a_prompt_file_with_a_byte_order_mark_or_crlf_reads(tmp_path):
    from stepflow.core.data import load_prompt_file
    from stepflow.errors import PromptFileError

    (tmp_path / "p.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "a cat"}\r\n{"prompt": "a dog", "tag": "x"}\r\n')
    assert load_prompt_file(tmp_path / "p.jsonl") == [{"prompt": "a cat"}, {"prompt": "a dog", "tag": "x"}]
    with pytest.raises(PromptFileError, match=r"data.train_file: .* is a directory, not a prompt file"):
        load_prompt_file(tmp_path)


# ------------------------------------------------------------------------------------------------ policies
@pytest.mark.parametrize("policy,kwargs,needle", [
    ("sd3", {"guidance": -1}, r"model.guidance: must be >= 1 \(1 = no CFG\), got -1"),
    ("sd3", {"eval_guidance": float("nan")}, r"model.eval_guidance: must be a finite number .*got nan"),
    ("sd3", {"guidance": float("inf")}, r"model.guidance: must be a finite number .*got inf"),
    ("sd3", {"max_sequence_length": 600}, r"model.max_sequence_length: must be an integer in 1..512"),
    ("sd3", {"width": 0}, r"model.width: must be >= 1"),
    ("sd3", {"height": 2.5}, r"model.height: must be an integer"),
    ("sd3", {"decode_batch_size": 0}, r"model.decode_batch_size: must be >= 1"),
    ("flux", {"embedded_guidance": -1}, r"model.embedded_guidance: must be >= 0 .*got -1"),
    ("flux", {"embedded_guidance": float("nan")}, r"model.embedded_guidance: must be a finite number"),
    ("flux", {"max_sequence_length": 0}, r"model.max_sequence_length: must be an integer in 1..512"),
    ("flux", {"eval_guidance": "high"}, r"model.eval_guidance: must be a finite number .*got 'high'"),
    ("qwen_image", {"guidance": -1}, r"model.guidance: must be >= 1 \(true CFG; 1 = no CFG"),
    ("qwen_image", {"max_sequence_length": 2000}, r"model.max_sequence_length: must be an integer in 1..1024"),
    ("qwen_image", {"encode_batch_size": True}, r"model.encode_batch_size: must be an integer"),
])
def test_bad_numeric_arguments_are_refused_before_anything_loads(policy, kwargs, needle):
    """The path does not exist: the argument's error comes first, so nothing was loaded."""
    from stepflow.policies.flux import FluxPolicy
    from stepflow.policies.qwen_image import QwenImagePolicy
    from stepflow.policies.sd3 import SD3Policy

    cls = {"sd3": SD3Policy, "flux": FluxPolicy, "qwen_image": QwenImagePolicy}[policy]
    with pytest.raises(StepflowError, match="^" + needle):
        cls.from_pretrained("/nonexistent/model", **kwargs)


@pytest.mark.parametrize("width,needle", [(100, "got 100; use 96 or 112"), (8, "got 8; use 16")])
def test_a_size_the_model_cannot_take_names_the_nearest_valid_ones(width, needle):
    from stepflow.testing.tiny_policies import tiny_sd3_policy

    with pytest.raises(StepflowError, match=r"^model.width: must be a positive multiple of 16 for this model \(VAE "
                                            rf"scale 8 x patch 2\), {needle}$"):
        tiny_sd3_policy(width=width, max_sequence_length=8)


@pytest.mark.parametrize("model", ["flux_dev", "qwen_image", "sd35_large"])
def test_random_policies_check_their_size_before_building(model):
    from stepflow.testing.random_policies import random_policy

    with pytest.raises(StepflowError, match=r"^model.height: must be a positive multiple of 16 .*got 40; use 32 or 48"):
        random_policy(model, tiny=True, device="meta", height=40)
    with pytest.raises(StepflowError, match=r"^model.guidance: must be >= 1"):
        random_policy(model, tiny=True, device="meta", guidance=0.5)


def test_shapes_policy_arguments_are_checked():
    from stepflow.policies.shapes import ShapesPolicy

    with pytest.raises(StepflowError, match=r"^model.shift: must be a finite number .*got nan"):
        ShapesPolicy.build(shift=float("nan"))
    with pytest.raises(StepflowError, match=r"^model.image_size: 30 is not a multiple of model.patch_size=4; use 28"):
        ShapesPolicy.build(image_size=30)
    with pytest.raises(StepflowError, match=r"^arch.num_layers: must be >= 1, got 0"):
        ShapesPolicy.build(num_layers=0, prefix="arch.")


def test_a_lora_of_random_bytes_names_its_field(tmp_path):
    from stepflow.policies.shapes import ShapesPolicy
    from stepflow.testing.tiny_policies import tiny_sd3_policy

    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"\x00\x01 random bytes" * 50)
    with pytest.raises(StepflowError, match=r"^model.lora.path: cannot load a LoRA from '.*lora' \(OSError: .*\); "
                                            r"point model.lora.path at a LoRA saved for this model"):
        tiny_sd3_policy(lora={"path": str(tmp_path / "lora")}, max_sequence_length=8)
    with pytest.raises(StepflowError, match=r"^lora_path: cannot load a LoRA from .*SafetensorError"):
        ShapesPolicy.build(num_layers=1).load_lora(tmp_path / "lora" / "pytorch_lora_weights.safetensors")


@pytest.fixture(scope="module")
def sd3_copy(tmp_path_factory):
    """A writable copy of the tiny SD3 pipeline folder (its JSON files get damaged)."""
    from stepflow.testing.tiny_policies import tiny_sd3_dir

    dst = tmp_path_factory.mktemp("sd3") / "pipe"
    shutil.copytree(tiny_sd3_dir(), dst)
    return dst


@pytest.mark.parametrize("file", ["model_index.json", "transformer/config.json", "scheduler/scheduler_config.json"])
def test_a_damaged_config_json_in_model_path_is_one_line(sd3_copy, tmp_path, file):
    from stepflow.errors import ModelLoadError
    from stepflow.policies.sd3 import SD3Policy

    pipe = tmp_path / "pipe"
    shutil.copytree(sd3_copy, pipe)
    (pipe / file).write_text('{"_class_name": "SD3Transformer2DModel", ')
    with pytest.raises(ModelLoadError, match=rf"^model.path: {pipe / file} is not valid JSON \(.*line 1 column .*\); "
                                             r"the SD3 model folder is damaged: download it once"):
        SD3Policy.from_pretrained(str(pipe), dtype="float32", height=64, width=64)


def test_a_damaged_config_json_in_transformer_path_is_one_line(sd3_copy, tmp_path):
    from stepflow.errors import ModelLoadError
    from stepflow.policies.sd3 import SD3Policy

    tr = tmp_path / "transformer"
    shutil.copytree(sd3_copy / "transformer", tr)
    (tr / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ModelLoadError, match=rf"^model.transformer_path: {tr / 'config.json'} is not UTF-8 text .*; "
                                             r"point model.transformer_path at a folder written by save_trained"):
        SD3Policy.from_pretrained(str(sd3_copy), dtype="float32", height=64, width=64, transformer_path=str(tr))


@pytest.mark.parametrize("model,override,needle", [
    ("qwen_image_tiny", "model.guidance=-1", "model.guidance"),
    ("flux_tiny", "model.embedded_guidance=-1", "model.embedded_guidance"),
])
def test_negative_guidance_on_the_command_line_is_one_line(tmp_path, model, override, needle, cli):
    """The issue's acceptance lines, through Hydra's instantiate and the entry point."""
    r = cli("stepflow.train", "experiment=smoke", f"model={model}", override, f"hydra.run.dir={tmp_path}")
    assert one_line_error(r, needle).startswith(f"stepflow: error: {needle}: must be ")


def test_guidance_inf_through_build_policy_is_one_line(tmp_path, monkeypatch):
    from stepflow.train import build_policy

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))  # nothing may be built: the check comes first
    cfg = compose_config("train", ["experiment=smoke", "model=qwen_image_tiny", "model.eval_guidance=inf"])
    with pytest.raises(StepflowError, match=r"^model.eval_guidance: must be a finite number"):
        build_policy(cfg)
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------------------------ tiny configs
TINY_OF = {"sd3_tiny": "sd35_medium", "sd35_large_tiny": "sd35_large", "flux_tiny": "flux_dev",
           "flux_schnell_tiny": "flux_schnell", "qwen_image_tiny": "qwen_image"}
README_KEYS = ("path", "transformer_path", "estimate_vae", "finetune")  # every `model.<key>=` README.md / docs/guide.md mention
#: the other `model.<key>=` the docs mention: settings of some families (each a field of a model config)
README_OTHER_KEYS = ("tiny", "source_area", "source_fit", "decode_batch_size", "gradient_checkpointing")


def test_the_readme_names_only_keys_this_test_knows():
    import re

    said = set(re.findall(r"\bmodel\.(\w+)=", "".join((ROOT / f).read_text() for f in ("README.md", "docs/guide.md"))))
    assert said <= set(README_KEYS) | set(README_OTHER_KEYS), said - set(README_KEYS) - set(README_OTHER_KEYS)
    fields = set().union(*(yaml.safe_load(f.read_text()) for f in (CONF_DIR / "model").glob("*.yaml")))
    assert set(README_OTHER_KEYS) <= fields, set(README_OTHER_KEYS) - fields


@pytest.mark.parametrize("tiny,real", TINY_OF.items())
def test_tiny_configs_take_the_readme_keys_their_real_model_takes(tiny, real):
    tiny_keys = set(yaml.safe_load((CONF_DIR / "model" / f"{tiny}.yaml").read_text()))
    real_keys = set(yaml.safe_load((CONF_DIR / "model" / f"{real}.yaml").read_text()))
    want = real_keys & set(README_KEYS)
    assert want <= tiny_keys, f"{tiny}.yaml lacks {sorted(want - tiny_keys)} ({real}.yaml has them)"
    cfg = compose_config("train", [f"model={tiny}", *(f"model.{k}=/some/dir" for k in want - {"finetune"})])
    assert all(cfg.model[k] == "/some/dir" for k in want - {"finetune"})


# ------------------------------------------------------------------------------------------------ estimate decoder
def _check_estimate_decoder():
    spec = importlib.util.spec_from_file_location("ced", ROOT / "experiments" / "check_estimate_decoder.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv,needle", [
    (["--batches", "0", "--tiny"], r"^--batches: must be >= 1, got 0$"),
    (["--batches", "x"], r"^argument --batches: invalid int value: 'x'; see --help$"),
    (["model=sd3_tiny"], r"^model.estimate_vae: not set; set model.estimate_vae=<AutoencoderTiny"),
    (["--tiny", "model=qwen_image_tiny"], r"^model.estimate_vae: model qwen_image_tiny takes no estimate decoder"),
    (["model=qwen_image_tiny", "+model.estimate_vae=/x"], r"^model.estimate_vae: model qwen_image_tiny takes no"),
    (["--tiny", "loop.no_such_key=1"], r"^loop.no_such_key: "),
])
def test_check_estimate_decoder_bad_inputs_are_one_line(argv, needle, capsys):
    mod = _check_estimate_decoder()
    with pytest.raises(StepflowError, match=needle):
        mod.main(argv)
    with pytest.raises(SystemExit) as info:
        mod.cli(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stepflow: error: "), err


def test_check_estimate_decoder_takes_model_estimate_vae_without_a_plus(tmp_path):
    """The docstring's real command shape (``model.estimate_vae=...``, no ``+``) on a tiny model: no traceback."""
    from stepflow.testing.tiny_policies import tiny_taesd_dir

    mod = _check_estimate_decoder()
    res = mod.main(["--batches", "1", "--json", str(tmp_path / "out" / "res.json"), "experiment=smoke",
                    "model=flux_tiny", "reward=pickscore_tiny", f"model.estimate_vae={tiny_taesd_dir()}"])
    assert len(res["reward_rank_corr"]) == 5 and res["reward_rank_corr"][-1] == pytest.approx(1.0)
    assert (tmp_path / "out" / "res.json").is_file()
