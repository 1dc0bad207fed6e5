"""The package as a user installs it: a wheel built from the tree, installed without ``-e`` into a fresh folder, runs
``python -m stepflow.train experiment=smoke`` from a directory outside the repository (the configs ship inside it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepflow.testing.harness import ROOT, run_cli


@pytest.mark.slow
def test_wheel_runs_the_smoke_experiment_outside_the_repo(tmp_path):
    whl = tmp_path / "whl"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(whl),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    wheel = next(whl.glob("stepflow-*.whl"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {"PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", "import stepflow, stepflow.cli as c; print(stepflow.__file__); "
                        "print(c.CONF_DIR)"], cwd=outside, env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=120)
    pkg, conf = r.stdout.split()
    assert Path(pkg).is_relative_to(site) and Path(conf).is_relative_to(site), r.stdout
    assert (Path(conf) / "train.yaml").is_file() and (Path(conf) / "recipe" / "shapes.yaml").is_file()
    r = run_cli("stepflow.train", "experiment=smoke", f"hydra.run.dir={tmp_path / 'run'}", cwd=outside, env=env,
                timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.csv").is_file() and (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
