"""The configuration: every group option composes and builds, every field has one default (stepflow/config.py), the
YAML files only override it, and a bad value is caught where the field is defined."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest
import yaml
from omegaconf import OmegaConf

from stepflow.cli import CONF_DIR
from stepflow.config import (
    EmaConfig,
    EvalConfig,
    EvaluateConfig,
    LoopConfig,
    LoraConfig,
    PretrainConfig,
    RunConfig,
    ServeRewardConfig,
    TrainConfig,
    to_config,
)
from stepflow.core.parts import _import, build_part, option_node
from stepflow.credits.base import Credit
from stepflow.errors import StepflowError
from stepflow.math.sde import SamplerConfig
from stepflow.objectives.base import Objective
from stepflow.samplers.base import Sampler
from stepflow.testing.harness import compose_config
from stepflow.windows.base import Window

GROUPS = ["model", "reward", "advantage", "sampler", "window", "objective", "data", "trainer", "logger", "experiment"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]
SECTIONS = {"loop": LoopConfig, "train": TrainConfig, "eval": EvalConfig, "ema": EmaConfig, "lora": LoraConfig}
PARTS = {"sampler": Sampler, "advantage": Credit, "window": Window, "objective": Objective}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_and_builds(group, option):
    cfg = compose_config("train", [f"{group}={option}"])
    for name, cls in SECTIONS.items():
        obj = to_config(cfg[name], cls, name)  # the dataclass checks pass for every shipped option
        assert isinstance(obj, cls)
    for name, base in PARTS.items():  # every part builds from its node (its class checks its fields)
        assert isinstance(build_part(name, cfg[name]), base), name
    for name in ("model", "reward", "trainer"):
        assert "_target_" in cfg[name], f"{name} of {group}={option} has no _target_"
    for name, node in cfg.logger.items():
        assert "_target_" in node, f"logger.{name}"


def _yaml(path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _defaults(cls) -> dict:
    return {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


@pytest.mark.parametrize("group", list(PARTS))
def test_group_files_name_their_class_and_only_its_fields(group):
    """A part's option file names its class (``_target_``) and holds only fields that class takes (every one of
    them: tests/test_parts.py); model files name theirs, and every recipe has its model."""
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        node = option_node(group, path.stem, [CONF_DIR])
        cls = _import(node.pop("_target_"), group)
        takes = set(inspect.signature(cls).parameters) | {n for k in cls.__mro__ if "__init__" in vars(k)
                                                          for n in inspect.signature(vars(k)["__init__"]).parameters}
        assert set(node) <= takes, f"{path.name}: {sorted(set(node) - takes)} are not fields of {cls.__name__}"
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        keys = set(_yaml(path))
        assert "_target_" in keys and not keys & {"train_steps", "ddim_schedule", "lora"}, path.name
    for path in sorted((CONF_DIR / "recipe").glob("*.yaml")):
        assert (CONF_DIR / "model" / path.name).is_file(), f"recipe/{path.name} has no model/{path.name}"


def test_train_yaml_holds_no_defaults_of_its_own():
    """conf/train.yaml chooses groups; the fields and their defaults live in RunConfig (except loop.seed, which
    follows the run's seed)."""
    top = _yaml(CONF_DIR / "train.yaml")
    assert top.pop("defaults")[0] == "train_schema"
    assert top.pop("loop") == {"seed": "${seed}"}
    assert set(top) <= {"hydra", "callbacks"}, set(top)


def test_the_composed_defaults_are_the_dataclass_defaults():
    """Without a recipe (model=shapes_tiny has none), each section composes to its dataclass's defaults."""
    cfg = compose_config("train", ["model=shapes_tiny"])
    for name in ("loop", "train", "eval", "ema", "lora"):
        got = OmegaConf.to_container(cfg[name], resolve=True)
        want = dataclasses.asdict(SECTIONS[name]())
        if name == "loop":
            assert got.pop("seed") == cfg.seed
            want.pop("seed")
        assert got == want, name
    assert RunConfig().seed == 0


# ------------------------------------------------------------------------------------------------------------------
# the other entry points (pretrain, evaluate, serve_reward): typed the same way
# ------------------------------------------------------------------------------------------------------------------
#: each entry point's schema and what its composition needs (serve_reward asks for a reward)
ENTRY_POINTS = {"pretrain": (PretrainConfig, []), "evaluate": (EvaluateConfig, []),
                "serve_reward": (ServeRewardConfig, ["reward=shapes_geneval"])}
#: the _target_ nodes a config group chooses (the dataclass has no default for them to compare with)
TARGET_NODES = ("model", "reward")


def _settings(name: str, overrides=()):
    """The entry point's own parse function (``stepflow.<name>.settings``) on its composed config."""
    cls, needs = ENTRY_POINTS[name]
    return importlib.import_module(f"stepflow.{name}").settings(compose_config(name, [*needs, *overrides]))


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_entry_point_yaml_composes_its_schema_and_repeats_no_default(name):
    """conf/<name>.yaml composes <name>_schema first; any value it sets is a field whose default it changes."""
    cls, _ = ENTRY_POINTS[name]
    top = _yaml(CONF_DIR / f"{name}.yaml")
    assert top.pop("defaults")[0] == f"{name}_schema"
    assert top.pop("hydra")["callbacks"]["run_dir"]["_target_"] == "stepflow.rundir.RunDirCallback"

    def walk(got: dict, want: dict, path: str) -> None:
        for k, v in got.items():
            assert k in want, f"{name}.yaml: {path}{k} is not a field of {cls.__name__}"
            if isinstance(v, dict) and isinstance(want[k], dict):
                walk(v, want[k], f"{path}{k}.")
            else:
                assert v != want[k], f"{name}.yaml: {path}{k}: {v!r} repeats the default of {cls.__name__}"

    walk(top, dataclasses.asdict(cls()), "")


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_entry_point_composed_defaults_are_the_dataclass_defaults(name):
    cls, needs = ENTRY_POINTS[name]
    got = OmegaConf.to_container(compose_config(name, needs), resolve=True)
    want = dataclasses.asdict(cls())
    for key in TARGET_NODES:
        if key in want:
            assert want.pop(key) is None and "_target_" in got.pop(key), key
    assert got == want
    typed = _settings(name)  # the entry point reads them as its typed config, every check passing
    assert isinstance(typed, cls)
    assert dataclasses.replace(typed, **{k: None for k in TARGET_NODES if hasattr(typed, k)}) == cls()


def _named(overrides: dict[str, list[str]]) -> list[tuple[str, str, str]]:
    """``(entry point, override, the field its one-line error names)`` for each override of each entry point: the
    field is the override's key."""
    return [(name, o, o.partition("=")[0]) for name, entry_overrides in overrides.items() for o in entry_overrides]


#: (entry point, override, the field its one-line error names)
BAD_VALUES = _named({
    "pretrain": [
        "seed=-1", "torch_threads=0", "arch.num_layers=0", "arch.image_size=30", "arch.qk_norm=batch_norm",
        "arch.prediction=eps", "arch.t_eps=0", "data.batch_size=0", "data.categories=[circles]", "data.categories=[]",
        "data.empty_prompt_prob=1.5", "data.num_workers=-1", "objective.t_sampling=cosine", "objective.logit_std=0",
        "optim.lr=0", "optim.betas=[0.9,1.0]", "optim.betas=[0.9]", "optim.weight_decay=-0.1", "optim.warmup_steps=-1",
        "optim.min_lr_ratio=2", "optim.grad_clip=-1", "ema.decay=1.0", "trainer.max_steps=0", "trainer.max_time=42min",
        "trainer.log_every_n_steps=0", "trainer.checkpoint_every_n_steps=0", "trainer.progress_refresh=0",
        "eval.every_n_steps=-1", "eval.split=test", "eval.max_prompts=0", "eval.num_steps=0", "eval.guidance=0.5",
        "eval.seed=-1", "eval.grid_per_category=0", "select.target=1.5", "select.low=0.8", "select.high=-0.1",
        "select.min_category=1", "select.tolerance=-0.1", "select.rescore_top_k=0", "select.rescore_margin=-1",
        "select.rescore_max_prompts=0",
    ],
    "evaluate": [
        "seed=-1", "num_per_prompt=0", "max_prompts=0", "batch_size=0", "torch_threads=0", "sampler.num_steps=0",
        "sampler.guidance=0.5", "grid.per_category=-1", "grid.ncol=0",
    ],
    "serve_reward": [
        "max_body_mb=0", "max_images=0", "max_images=2.5", "max_image_pixels=-1", "max_request_pixels=0",
        "decode_workers=0", "max_inflight=-1", "read_timeout_s=0", "port=70000", "port=-1", "host=''",
    ],
})


@pytest.mark.parametrize("name,override,field", BAD_VALUES, ids=[f"{n}:{o}" for n, o, _ in BAD_VALUES])
def test_a_bad_value_of_an_entry_point_names_its_field(name, override, field):
    with pytest.raises(StepflowError, match=rf"^{re.escape(field)}: "):
        _settings(name, [override])


@pytest.mark.parametrize("name,override,field", _named({"pretrain": ["optim.lr=inf", "select.tolerance=inf"],
                                                         "evaluate": ["sampler.guidance=inf"],
                                                         "serve_reward": ["max_body_mb=inf"]}))
def test_the_dataclass_checks_refuse_non_finite_values_on_their_own(name, override, field):
    """inf passes a one-sided bound (lr > 0): the dataclasses refuse it themselves, without cli.check_finite."""
    cls, needs = ENTRY_POINTS[name]
    node = compose_config(name, [*needs, override])
    with pytest.raises(StepflowError, match=rf"^{re.escape(field)}: must be .*, got inf"):
        to_config(node, cls)


def test_a_count_that_is_no_number_is_one_line(capsys):
    """serve_reward's counts take an integral float (max_images=4.0), so their schema type is int | float: a string is
    refused at composition, in one line naming the field."""
    from stepflow.cli import check_keys

    with pytest.raises(SystemExit):
        check_keys(["reward=shapes_geneval", "max_images=abc"], "serve_reward")
    assert "stepflow: error: max_images: 'abc' is not a number; give max_images=<number>" in capsys.readouterr().err


def test_models_hold_constructor_arguments_only():
    """Recipe keys (which steps to train, the DDIM schedule) live in recipe/<model>.yaml, not in model configs."""
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        keys = set(_yaml(path))
        assert "_target_" in keys and not keys & {"train_steps", "ddim_schedule", "lora"}, path.name
    for path in sorted((CONF_DIR / "recipe").glob("*.yaml")):
        assert (CONF_DIR / "model" / path.name).is_file(), f"recipe/{path.name} has no model/{path.name}"


def test_python_and_yaml_sampler_defaults_agree():
    """SamplerConfig(name=...) in Python gives what sampler=<name> gives on the command line."""
    for path in sorted((CONF_DIR / "sampler").glob("*.yaml")):
        py = SamplerConfig(name=path.stem)
        cfg = compose_config("train", ["model=shapes_tiny", f"sampler={path.stem}"])
        built = build_part("sampler", cfg.sampler)
        assert type(built) is type(py) and vars(built) == vars(py), path.stem
    assert SamplerConfig(name="cps").logprob == "cps_constfree"
    assert SamplerConfig(name="flow_sde").logprob == "gaussian"


def test_distill_states_its_ode_rollout_and_independent_noise():
    from stepflow.train import settings

    cfg = compose_config("train", ["objective=distill"])
    assert cfg.objective.rollout_sampler == "ode" and cfg.objective.same_latent is False
    assert settings(cfg).sampler.name == "ode"
    assert compose_config("train").objective.rollout_sampler is None
    assert compose_config("train").objective._target_ == "stepflow.objectives.grpo.Grpo"


@pytest.mark.parametrize("section,value,needle", [
    ("loop", {"iterations": -1}, "loop.iterations"),
    ("loop", {"group_size": 1}, "loop.group_size"),
    ("eval", {"every": -2}, "eval.every"),
    ("ema", {"decay": 1.5}, "ema.decay"),
    ("ema", {"update_every": 0}, "ema.update_every"),
    ("train", {"lr": 0}, "train.lr"),
    ("train", {"train_steps": "abc"}, "train.train_steps"),
    ("lora", {"rank": 0}, "lora.rank"),
])
def test_a_bad_value_names_its_field(section, value, needle):
    node = OmegaConf.merge(OmegaConf.structured(SECTIONS[section]), value)
    with pytest.raises(StepflowError, match=needle.replace(".", r"\.")):
        to_config(node, SECTIONS[section], section)


def test_uniform_credit_is_flow_grpos_released_setting():
    """advantage=uniform normalises by the batch's std as Flow-GRPO's released configs do (sample.global_std=True);
    gains keep the group std of the paper's Eq. 5."""
    assert compose_config("train", ["advantage=uniform"]).advantage.std_scope == "global"
    assert compose_config("train", ["experiment=paper_fig6_sde", "advantage=uniform"]).advantage.std_scope == "global"
    assert compose_config("train").advantage.std_scope == "group"


# ------------------------------------------------------------------------------------------------------------------
# sharded strategies and multi-node launch (the runs themselves: tests/test_sharded.py)
# ------------------------------------------------------------------------------------------------------------------
def test_fsdp_config_builds_fsdp2_over_every_rank():
    """trainer=fsdp: stepflow's FSDP2 strategy (Lightning's ModelParallelStrategy), bf16 compute with fp32 gradient
    reduction for a bf16 model, gradients sharded per backward for full fine-tuning (auto)."""
    import hydra.utils
    import torch

    from stepflow.core.dist import reduces_every_backward, strategy_kind
    from stepflow.shell.sharding import FSDP2Strategy

    cfg = compose_config("train", ["trainer=fsdp", "model=sd35_medium"])
    s = hydra.utils.instantiate(cfg.trainer.strategy)
    assert isinstance(s, FSDP2Strategy) and strategy_kind(s) == "fsdp"
    assert (s.param_dtype, s.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert reduces_every_backward(s, full_finetune=True) and not reduces_every_backward(s, full_finetune=False)
    assert (cfg.trainer.devices, cfg.trainer.accelerator) == (8, "gpu")
    cpu = compose_config("train", ["trainer=fsdp_cpu"])
    s = hydra.utils.instantiate(cpu.trainer.strategy)
    assert s.param_dtype is None and not reduces_every_backward(s, full_finetune=True)  # the exact mode, tested
    with pytest.raises(ValueError, match="trainer.strategy.param_dtype"):
        FSDP2Strategy(param_dtype="float8")


def test_deepspeed_config_clips_as_the_train_config_says():
    import hydra.utils

    from stepflow.core.dist import strategy_kind

    cfg = compose_config("train", ["trainer=deepspeed", "train.max_grad_norm=0.5"])
    s = hydra.utils.instantiate(cfg.trainer.strategy)
    assert strategy_kind(s) == "deepspeed"  # not "ddp", though Lightning's DeepSpeedStrategy subclasses DDPStrategy
    assert s.config["zero_optimization"]["stage"] == 2 and s.config["gradient_clipping"] == 0.5
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="trainer.strategy.stage: ZeRO stage 3"):
        hydra.utils.instantiate(compose_config("train", ["trainer=deepspeed", "trainer.strategy.stage=3"]).trainer.strategy)


@pytest.mark.parametrize("trainer", ["ddp", "fsdp", "deepspeed"])
def test_slurm_launcher_takes_nodes_and_gpus_from_the_trainer(trainer):
    """N nodes over SLURM: one job of trainer.num_nodes nodes x trainer.devices tasks (one per GPU); Lightning
    takes the ranks from SLURM (its SLURMEnvironment), whatever the strategy."""
    cfg = compose_config("train", [f"trainer={trainer}", "trainer.num_nodes=4", "hydra/launcher=slurm"],
                         return_hydra_config=True)
    lc = cfg.hydra.launcher
    assert (lc.nodes, lc.tasks_per_node, lc.gpus_per_node) == (4, 8, 8)
    assert cfg.trainer.num_nodes == 4
