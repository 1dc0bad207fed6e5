# stepflow: two commands do all set-up on a fresh machine: `make train` and `make test`.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.DEFAULT_GOAL := help
.PHONY: help install train test test-fast test-slow test-golden test-extended test-all evaluate pretrain ablations ablations-quick league league-quick clean

help: ## list the targets
	@echo "stepflow: make <target> [ARGS='key=value ...']   (every target installs first; set-up is make train / make test)"
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/\1@@\2/' | awk -F'@@' '{printf "  %-17s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv and install stepflow with its test and launcher extras (about 4 min)

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c constraints.txt -e ".[dev,launchers]"
	# deepspeed (trainer=deepspeed / deepspeed_cpu) builds from source against the torch just installed: no build
	# isolation, no compiled ops (DeepSpeed JIT-builds what it needs on first use)
	DS_BUILD_OPS=0 $(VPY) -m pip install -q -c constraints.txt --no-build-isolation deepspeed
	touch $(STAMP)

# `make train`: the league's best held-out GenEval within 7 minutes on 2 CPU cores (conf/experiment/league_best.yaml,
# docs/league/report.md); `make train TRAIN=` runs the plain default (python -m stepflow.train), ARGS adds overrides
TRAIN ?= experiment=league_best
train: install ## train the embedded world on the CPU: 0.36 -> 0.44 held-out GenEval in about 5 min
	$(VPY) -m stepflow.train $(TRAIN) $(ARGS)

evaluate: install ## held-out GenEval of a model or a trained LoRA (ARGS='ckpt_path=...')
	$(VPY) -m stepflow.evaluate $(ARGS)

pretrain: install ## pretrain the embedded world's base model (docs/guide.md)
	$(VPY) -m stepflow.pretrain $(ARGS)

# Tests (pyproject's [tool.pytest.ini_options]: --strict-markers, the 20 slowest printed). `make test`: every test
# but the `slow` ones (multi-process / sharded training, signals, the wheel, the golden run), WORKERS xdist processes;
# `make test-slow`: the `slow` ones; `make test-all` (CI, .ci/run): both.
WORKERS ?= 2

test: install ## every test but the slow ones (about 10-12 min)
	$(VPY) -m pytest -q -n $(WORKERS) -m "not slow" $(ARGS)

test-fast: test ## the same as make test

# The multi-process tests (2 ranks each) run one at a time per xdist group: "multiprocess" (the sharded runs that
# share one module's runs) on one worker, "multiprocess2" (the SIGTERM and DDP-equals-one-process runs) on the other,
# between the single-process slow tests (those run the CLI in the test's process where they can)
test-slow: install ## the slow tests: DDP / FSDP2 / DeepSpeed on the CPU, signals, the wheel, goldens (about 16 min)
	$(VPY) -m pytest -q -n $(WORKERS) --dist loadgroup -m "slow and not golden_full and not extended" $(ARGS)

# every league recipe's first iteration at its own batch against tests/golden/league_it1.json (about 12 min on 2
# cores; CI compares the small-batch set, tests/golden/league_it1_small.json, in test-slow)
test-golden: install ## every league recipe's first iteration at its own batch against its golden (about 12 min)
	$(VPY) -m pytest -q -n $(WORKERS) -m golden_full $(ARGS)

# the longer variants outside CI's 30 minutes (pytest -m extended): the newer methods' 2-process, command-line and
# small-golden runs, DDP cases beyond plain / tempflow, sampler x credit pairs beyond a covering set, the retain
# benchmark's test and the retained-graph memory measurement, Qwen-Image-Edit's parity at its own 1024² sizing
test-extended: install ## the longer variants outside CI: more DDP cases, the newer methods' CLI runs and goldens (56 tests, 28 min beside two league runs)
	$(VPY) -m pytest -q -n $(WORKERS) --dist loadgroup -m extended $(ARGS)

test-all: test test-slow ## make test and make test-slow (what CI runs)

clean: ## remove outputs/, multirun/ and pytest's cache
	rm -rf outputs multirun .pytest_cache

# Ablation suites (experiments/ablations.py, experiments/README.md): SCALE=mini (embedded world on the CPU, default)
# | paper (SD3.5-M, 8 GPUs per run, SLURM launcher); JOBS=N local runs at once; reruns skip finished runs.
SCALE ?= mini
JOBS  ?= 1
SWEEP ?= outputs/ablations/full
.PHONY: report

ablations: install ## the ablation suite (SCALE=mini|paper, JOBS=N; reruns skip finished runs)
	$(VPY) experiments/ablations.py --suite $(if $(filter paper,$(SCALE)),paper,$(if $(filter mini,$(SCALE)),full,$(error SCALE must be mini or paper))) --jobs $(JOBS) $(ARGS)

ablations-quick: install ## a quick ablation suite (a pipeline check)
	$(VPY) experiments/ablations.py --suite quick --jobs $(JOBS) $(ARGS)

report: install ## the ablations' report from SWEEP
	$(VPY) experiments/report.py $(SWEEP) $(ARGS)

# The league (experiments/league.py, docs/league/report.md): every method at equal forward-equivalent NFEs, 5 paired
# seeds, lr chosen on a grid with other seeds, the paper's claims; LEAGUE_JOBS runs at once; reruns skip finished runs.
LEAGUE_JOBS ?= 2
league: install ## the league: every method at equal NFEs, 5 seeds (hours; reruns skip finished runs)
	$(VPY) experiments/league.py --scale $(if $(filter paper,$(SCALE)),paper,$(if $(filter mini,$(SCALE)),mini,$(error SCALE must be mini or paper))) --jobs $(LEAGUE_JOBS) $(ARGS)

league-quick: install ## a 4-method, 2-seed league in minutes (a pipeline check, not a ranking)
	$(VPY) experiments/league.py --quick --jobs $(LEAGUE_JOBS) $(ARGS)
