"""A user's own config options, the Hydra way: a config folder outside the checkout on the search path
(``hydra.searchpath=[file://<dir>]`` or ``--config-dir <dir>``) whose options (``reward=bright``) and groups the
entry points accept, compose and check like the package's own, and whose ``_target_`` names a class of the user's
own package (on ``PYTHONPATH``)."""

from __future__ import annotations

import csv
import os
import sys
import textwrap

import pytest

from stepflow.cli import check_keys, group_options, search_path, searchpath_overrides
from stepflow.testing.harness import compose_config, one_line_error, run_cli

BRIGHT = '''
"""A user's reward, outside stepflow: the mean pixel value of each image."""
from stepflow.rewards.base import Reward, RewardOut


class Brightness(Reward):
    name = "bright"

    def __init__(self, batch_size: int = 64):
        self.batch_size = batch_size

    def score(self, images, prompts, meta):
        scores = images.float().mean(dim=(1, 2, 3))
        return RewardOut(scores, {"brightness": scores})
'''


@pytest.fixture
def plugin(tmp_path):
    """``<tmp>/bright.py`` (the user's package) and ``<tmp>/conf`` (the user's config folder): ``reward/bright.yaml``,
    ``reward/broken.yaml`` (a ``_target_`` that does not import) and a group of the user's own, ``extra``."""
    (tmp_path / "bright.py").write_text(textwrap.dedent(BRIGHT))
    conf = tmp_path / "conf"
    (conf / "reward").mkdir(parents=True)
    (conf / "reward" / "bright.yaml").write_text("_target_: bright.Brightness\nbatch_size: 32\n")
    (conf / "reward" / "broken.yaml").write_text("_target_: nosuchmodule.X\n")
    (conf / "extra" / "sub").mkdir(parents=True)
    (conf / "extra" / "three.yaml").write_text("# @package _global_\nloop:\n  iterations: 3\n")
    (conf / "extra" / "sub" / "four.yaml").write_text("# @package _global_\nloop:\n  iterations: 4\n")
    return tmp_path


def _training_rows(run_dir) -> list[dict]:
    with (run_dir / "metrics.csv").open() as fh:
        return [row for row in csv.DictReader(fh) if row.get("time/iteration_s")]


# ------------------------------------------------------------------------------------------------ fast, no run
def test_options_of_a_group_are_the_package_ones_and_the_search_path_ones(plugin, tmp_path_factory):
    conf = plugin / "conf"
    package = group_options("reward")
    assert "shapes_geneval" in package and "bright" not in package
    assert group_options("reward", [conf]) == sorted({*package, "bright", "broken"})
    assert group_options("extra", [conf]) == ["sub/four", "three"]  # a group only the user has, sub-folders too
    assert group_options("extra") is None and group_options("nosuchgroup", [conf]) is None
    assert group_options("../conf", [conf / "reward"]) is None  # no way out of a config folder

    # where the search path comes from: hydra.searchpath (file://, a plain path, pkg://), --config-dir / -cd
    pkg = tmp_path_factory.mktemp("pkgroot")
    (pkg / "userpkg_confs" / "conf" / "reward").mkdir(parents=True)
    (pkg / "userpkg_confs" / "__init__.py").write_text("")
    (pkg / "userpkg_confs" / "conf" / "reward" / "pkgbright.yaml").write_text("_target_: bright.Brightness\n")
    sys.path.insert(0, str(pkg))
    try:
        got = search_path([f"hydra.searchpath=[file://{conf},{plugin},pkg://userpkg_confs/conf]", "reward=bright"])
        assert got == [conf.resolve(), plugin.resolve(), (pkg / "userpkg_confs" / "conf").resolve()]
        assert "pkgbright" in group_options("reward", got)
    finally:
        sys.path.remove(str(pkg))
        sys.modules.pop("userpkg_confs", None)
    other = tmp_path_factory.mktemp("other")
    for argv in (["-cd", str(conf)], ["--config-dir", str(conf)], [f"--config-dir={conf}"]):
        assert search_path([*argv, f"hydra.searchpath=[{other}]"]) == [conf.resolve(), other.resolve()]
    # the primary config's own hydra.searchpath, unless the command line gives one
    primary = tmp_path_factory.mktemp("primary")
    (primary / "train.yaml").write_text(f"hydra:\n  searchpath:\n    - file://{conf}\n")
    assert search_path([], "train", conf_dir=primary) == [conf.resolve()]
    assert search_path([f"hydra.searchpath=[{other}]"], "train", conf_dir=primary) == [other.resolve()]
    assert search_path(["reward=bright"], "train") == []


def test_the_up_front_composition_sees_the_search_path_and_checks_a_users_option(plugin, capsys):
    conf = plugin / "conf"
    for argv in (["-cd", str(conf)], [f"hydra.searchpath=['file://{conf}']"]):
        cfg = compose_config("train", ["reward=bright", "+extra=three", *searchpath_overrides(argv, "train")])
        assert cfg.reward._target_ == "bright.Brightness" and cfg.loop.iterations == 3
        check_keys([*argv, "experiment=smoke", "reward=bright", "reward.batch_size=8"], "train")  # no exit
        with pytest.raises(SystemExit):
            check_keys([*argv, "experiment=smoke", "reward=bright", "reward.batch_sise=8"], "train")
        assert capsys.readouterr().err.strip().startswith("stepflow: error: reward.batch_sise: unknown key")


# ------------------------------------------------------------------------------------------------ the entry point
def test_a_users_reward_trains_through_hydra_searchpath(plugin):
    run_dir = plugin / "run"
    r = run_cli("stepflow.train", "experiment=smoke", "loop.iterations=2", f"hydra.searchpath=[file://{plugin}/conf]",
                "reward=bright", f"hydra.run.dir={run_dir}",
                env={"PYTHONPATH": os.pathsep.join([str(plugin), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(_training_rows(run_dir)) == 2
    assert "eval/bright" in (run_dir / "metrics.csv").read_text().splitlines()[0]


def test_a_users_reward_trains_through_config_dir(plugin, cli, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin))
    monkeypatch.delitem(sys.modules, "bright", raising=False)
    run_dir = plugin / "run"
    try:
        # Hydra's parser wants its flags before the overrides
        r = cli("stepflow.train", "--config-dir", str(plugin / "conf"), "experiment=smoke", "loop.iterations=2",
                "reward=bright", f"hydra.run.dir={run_dir}")
    finally:
        sys.modules.pop("bright", None)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(_training_rows(run_dir)) == 2


def test_an_unknown_option_lists_the_users_options_too(plugin, cli):
    line = one_line_error(cli("stepflow.train", "experiment=smoke", f"hydra.searchpath=[file://{plugin}/conf]",
                              "reward=nosuch"), "reward=nosuch: unknown option for 'reward'")
    assert "bright" in line and "broken" in line and "shapes_geneval" in line
    line = one_line_error(cli("stepflow.train", "-cd", str(plugin / "conf"), "experiment=smoke", "+extra=nosuch"),
                          "extra=nosuch: unknown option for 'extra'")
    assert line.endswith("choose one of: sub/four, three")


def test_a_search_path_entry_that_is_no_directory_is_one_line(plugin, cli):
    missing = plugin / "nosuchdir"
    one_line_error(cli("stepflow.train", "experiment=smoke", f"hydra.searchpath=[file://{missing}]", "reward=bright"),
                   f"hydra.searchpath: file://{missing} is not a directory")
    one_line_error(cli("stepflow.train", "--config-dir", str(missing), "experiment=smoke", "reward=bright"),
                   f"--config-dir: {missing} is not a directory")


def test_a_target_that_does_not_import_names_the_option_and_the_target(plugin, cli):
    line = one_line_error(cli("stepflow.train", "experiment=smoke", "loop.iterations=1",
                              f"hydra.searchpath=[file://{plugin}/conf]", "reward=broken",
                              f"hydra.run.dir={plugin / 'run'}"), "reward._target_: cannot import 'nosuchmodule.X'")
    assert "reward=broken" in line and "No module named 'nosuchmodule'" in line and "PYTHONPATH" in line

