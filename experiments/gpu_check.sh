#!/usr/bin/env bash
# The prepared GPU check (one script, one GPU, ~7.5 min of a 15-min device budget; hard limit GPU_CHECK_TOTAL_S=540 s):
#
#   1. env          versions, nvidia-smi, imports (incl. deepspeed)                                          ~10 s
#   2. sd35m        gpu_check.py --runs sd35_medium:lora,sd35_medium:full (B 8, T 10, T' 5, 512 px,
#                   uniform + gain, 1 iteration each): the README's reference setting                        ~60 s
#   3. strat_lora   python -m stepflow.train model=sd35_medium_random trainer=S trainer.devices=1,
#                   S = ddp, fsdp (FSDP2), deepspeed (ZeRO-2), LoRA, one iteration (B 4, T 4, T' 2, gain) each         ~90 s
#   4. big          gpu_check.py gain only, T 6: sd35_large lora, flux_dev lora, qwen_image lora,
#                   sd35_large full (flux_dev / qwen_image full: estimated not to fit in 141 GB, skipped)     ~155 s
#   5. strat_full   as 3 with model.finetune=full (no checkpoint file, no weights written)                    ~120 s
#   6. wan          video: python -m stepflow.train model=wan21_t2v_random (1.4 B) LoRA and full, wan22_t2v_random
#                   (two 14 B experts) LoRA, trainer=ddp, 256 x 448 px, 17 frames (5 latent frames, 2240 tokens),
#                   reward=frames over the stand-in image reward, one iteration each (B 4, T 4, gain); rows of
#                   strategies.tsv named wan21_t2v/wan22_t2v. Last in the default parts: skipped when time is out  ~150 s
#   7. img2 (not in the default parts; GPU_CHECK_PARTS="env img2"): FLUX.2-dev / Z-Image (docs/guide.md):
#                   the memory table, then one CLI iteration of model=zimage_random (LoRA; full when the GPU
#                   has >= 120 GiB) and model=flux2_random (LoRA, >= 100 GiB), results in img2.tsv         ~150 s
#   8. edit (not in the default parts; GPU_CHECK_PARTS="env edit"): python -m stepflow.train model=flux_kontext_random / qwen_image_edit_random, LoRA, trainer=ddp,
#                   data=edit_tiny reward=source_similarity, one iteration each; peaks into edit.tsv           ~150 s
#
# Estimates: a transformer forward of B samples at 512 px costs 2 x (per-token weights) x tokens per sample
# (SD3.5-M ~5 TFLOP, SD3.5-L ~15, FLUX.1-dev ~28 with 512 T5 tokens, Qwen-Image ~29), a checkpointed training step
# ~5 forwards (forward, recompute, backward, reference), at ~350 TFLOP/s effective bf16 on an H200 (45% of its
# 790); each CLI run adds ~25 s of process start, Lightning set-up and two tiny evaluations. Every part has its own
# timeout, capped by what is left of the total, so a slow part costs only itself; results are written as they come.
#
#   bash experiments/gpu_check.sh                 # everything above, into $OUT (or outputs/gpu_check/<time>)
#   GPU_CHECK_PARTS="env sd35m" bash experiments/gpu_check.sh     # some parts
#   GPU_CHECK_TINY=1 bash experiments/gpu_check.sh                # the same sequence at tiny size on the CPU (a dry run:
#                                                                 # strategies become one trainer=cpu run each)
#   bash experiments/gpu_check.sh --fetch-wheels  # HERE (with a registry): the wheels the GPU image lacks, into .whl/
#
# The CUDA image has torch, lightning, peft, transformers, accelerate, einops, msgpack, ninja, psutil, py-cpuinfo but
# not diffusers, hydra-core, omegaconf, antlr4, deepspeed (+ hjson, pydantic). --fetch-wheels downloads those as
# wheels for CPython 3.12 (antlr4 4.9.3 and deepspeed come as sources only: built here into pure-Python wheels,
# deepspeed with DS_BUILD_OPS=0 DS_ACCELERATOR=cuda) into .whl/ (ignored by git, 12 MB); carry them to the device
# machine (device tool: carry [".whl"]). This script installs them with --no-deps into /tmp/site and puts that first
# on PYTHONPATH. Outputs under $OUT (at most 8 files come back): gpu_check.log (everything printed), sd35m.json and
# big.json (gpu_check.py's results), strategies.tsv (per CLI run: seconds per phase from metrics.csv, peak memory from
# memory.csv), summary.txt (the tables printed at the end). The CLI runs' own directories go to $RUNS (default
# /tmp/stepflow_gpu_check; deleted after each run unless GPU_CHECK_KEEP_RUNS=1).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

DIFFUSERS_V=0.42.1 OMEGACONF_V=2.3.1 HYDRA_V=1.3.8 ANTLR_V=4.9.3 DEEPSPEED_V=0.19.8
PYDANTIC_V=2.14.4 PYDANTIC_CORE_V=2.50.5 ANNOTATED_TYPES_V=0.8.0 TYPING_INSPECTION_V=0.4.5 TYPING_EXT_V=4.16.0 HJSON_V=3.1.0

if [ "${1:-}" = "--fetch-wheels" ]; then
  set -e
  mkdir -p .whl
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
    "diffusers==$DIFFUSERS_V" "omegaconf==$OMEGACONF_V" "hydra-core==$HYDRA_V" "hjson==$HJSON_V" \
    "pydantic==$PYDANTIC_V" "pydantic_core==$PYDANTIC_CORE_V" "annotated-types==$ANNOTATED_TYPES_V" \
    "typing-inspection==$TYPING_INSPECTION_V" "typing_extensions==$TYPING_EXT_V"
  "$PY" -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$ANTLR_V"
  DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$DEEPSPEED_V"
  ls -la .whl
  du -sh .whl
  exit 0
fi

TINY=${GPU_CHECK_TINY:-0}
PARTS=${GPU_CHECK_PARTS:-env sd35m strat_lora big strat_full wan}
TOTAL=${GPU_CHECK_TOTAL_S:-540}
OUT=${OUT:-outputs/gpu_check/$(date +%Y%m%d-%H%M%S)}
RUNS=${RUNS:-/tmp/stepflow_gpu_check}
mkdir -p "$OUT" "$RUNS"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log
: >"$LOG"
: >"$OUT/parts.tmp"
START=$SECONDS
DEADLINE=$((START + TOTAL))
say() { echo "$@" | tee -a "$LOG"; }

CORE="import diffusers, peft, omegaconf, hydra"
if ! "$PY" -c "$CORE$([ "$TINY" = 1 ] || echo ', deepspeed')" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      2>&1 | tail -3 | tee -a "$LOG"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  elif ! "$PY" -c "$CORE" 2>/dev/null; then
    say "gpu_check.sh: diffusers/peft/omegaconf/hydra not importable and no wheels in .whl/ (see the header of this script)"
    exit 2
  else
    say "gpu_check.sh: deepspeed is not importable and there are no wheels in .whl/: the trainer=deepspeed runs will fail"
  fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
[ "$TINY" = 1 ] && export DS_ACCELERATOR=cpu || export DS_ACCELERATOR=cuda

# the limit a part of TIMEOUT seconds gets: capped by what is left of the total
limit_for() { local left=$((DEADLINE - SECONDS - 5)); echo $(($1 < left ? $1 : left)); }

# part NAME TIMEOUT CMD...: run CMD with min(TIMEOUT, time left - 5 s), its output appended to the log
part() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  limit=$(limit_for "$limit")
  if [ "$limit" -lt 20 ]; then
    say "== [$name] skipped: ${left}s left of GPU_CHECK_TOTAL_S=$TOTAL"
    printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$OUT/parts.tmp"
    return 0
  fi
  say "== [$name] (limit ${limit}s, $((SECONDS - START))s elapsed): $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  say "== [$name] rc=$rc in $((SECONDS - t0))s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$OUT/parts.tmp"
}

if [ "$TINY" = 1 ]; then
  GC_DEV=(--tiny --device cpu --batch 4 --group-size 2 --substeps 2)
  STRATEGIES=(auto)
  TRAINER=(trainer=cpu "model.tiny=true" "model.dtype=float32" "model.device=cpu")
else
  GC_DEV=()
  STRATEGIES=(ddp fsdp deepspeed)  # conf/trainer/<name>.yaml on one GPU
  TRAINER=()
fi

# the command of one CLI run (strategy, finetune[, model]) -> CMD
cli_cmd() {
  local s=$1 ft=$2 model=${3:-sd35_medium_random}
  local extra=() reward=('~reward=shapes_geneval' +reward._target_=stepflow.testing.random_policies.StandInReward)
  if [[ $model == wan* ]]; then  # a video model: the stand-in image reward on every 4th frame (reward=frames)
    reward=(reward=frames 'reward.image={_target_:stepflow.testing.random_policies.StandInReward}')
    [ "$TINY" != 1 ] && extra+=(model.height=256 model.width=448 model.num_frames=17)
  fi
  [ "$ft" = full ] && extra=(model.save_weights=false callbacks.checkpoint=null train.lr=1e-5)
  [ "$TINY" != 1 ] && extra+=("trainer=$s" "trainer.devices=1")
  CMD=("$PY" -m stepflow.train "model=$model" "${TRAINER[@]}" "model.finetune=$ft" "${extra[@]}" "${reward[@]}"
       +callbacks.memory._target_=stepflow.testing.random_policies.peak_memory_callback
       loop.iterations=1 loop.prompts_per_iter=1 loop.group_size=4 loop.num_steps=4 loop.substeps=2
       train.micro_batch_size=4 train.beta_kl=0.04 advantage=gain sampler=flow_sde
       eval.every=0 eval.max_prompts=2 eval.num_steps=2 eval.batch_size=2 eval.grid_prompts=2
       "hydra.run.dir=$RUNS/$s-$ft${3:+-$3}")
}

strategies() {
  local ft=$1 limit=$2 model=${3:-}
  local strats=("${STRATEGIES[@]}")
  [ -n "$model" ] && [ "$TINY" != 1 ] && strats=(ddp)  # a video model: one DDP run per fine-tuning mode
  for s in "${strats[@]}"; do
    local dir="$RUNS/$s-$ft${model:+-$model}"
    rm -rf "${dir:?}"
    cli_cmd "$s" "$ft" $model
    part "strategy_${s}_${ft}${model:+_$model}" "$limit" "${CMD[@]}"
    "$PY" - "$dir" "$s${model:+:${model%_random}}" "$ft" "$OUT/strategies.tsv" "$(tail -n 1 "$OUT/parts.tmp" | cut -f2,3)" <<'EOF'
import csv, os, sys
from pathlib import Path
d, s, ft, out, rc_s = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]), sys.argv[5].split("\t")
cols = ["strategy", "finetune", "rc", "wall_s", "iteration_s", "rollout_s", "estimate_s", "reward_s", "update_s",
        "peak_alloc_gib", "peak_reserved_gib", "reward_final", "grad_norm", "trained", "note"]
row = dict(strategy=s, finetune=ft, rc=rc_s[0], wall_s=rc_s[1] if len(rc_s) > 1 else "")
try:
    rows = [r for r in csv.DictReader((d / "metrics.csv").open()) if r.get("time/iteration_s")]
    m = rows[-1]
    row.update(iteration_s=m["time/iteration_s"], rollout_s=m["time/rollout_s"], estimate_s=m["time/estimate_s"],
               reward_s=m["time/reward_s"], update_s=m["time/update_s"], reward_final=m.get("train/reward_final", ""),
               grad_norm=m.get("train/grad_norm", ""))
except (OSError, IndexError, KeyError) as e:
    row["note"] = f"no metrics.csv row ({type(e).__name__})"
try:
    mem = [r for r in csv.DictReader((d / "memory.csv").open()) if r["iteration"] != "start"]
    row.update(peak_alloc_gib=mem[-1]["peak_allocated_gib"], peak_reserved_gib=mem[-1]["peak_reserved_gib"])
except (OSError, IndexError, KeyError):
    pass
row["trained"] = "yes" if (d / ("transformer" if ft == "full" else "lora")).is_dir() else "no"
if rc_s[0] not in ("0", "skipped") and not row.get("note"):
    log = d / "train.log"
    lines = [x for x in (log.read_text(errors="replace").splitlines() if log.is_file() else []) if x.strip()]
    row["note"] = (lines[-1] if lines else "see gpu_check.log")[:160]
for k, v in row.items():
    try:
        row[k] = f"{float(v):.3f}" if k.endswith(("_s", "_gib", "_final", "_norm")) and v != "" else v
    except ValueError:
        pass
new = not out.is_file()
with out.open("a") as fh:
    fh.write(("\t".join(cols) + "\n" if new else "") + "\t".join(str(row.get(c, "")).replace("\t", " ") for c in cols) + "\n")
EOF
    [ "${GPU_CHECK_KEEP_RUNS:-0}" = 1 ] || rm -rf "$dir"
  done
}

# img2 (FLUX.2-dev, Z-Image): one CLI iteration of MODEL_random with FINETUNE if the GPU has MIN_GIB, into img2.tsv
img2_run() {
  local model=$1 ft=$2 min_gib=$3
  local gib=0
  [ "$TINY" != 1 ] && gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  if [ "$TINY" != 1 ] && [ "${gib:-0}" -lt $((min_gib * 1024)) ]; then
    say "== [img2_${model}_${ft}] skipped: needs >= ${min_gib} GiB of GPU memory (docs/guide.md), this GPU has ${gib} MiB"
    printf '%s\tskipped\t0\t0\n' "img2_${model}_${ft}" >>"$OUT/parts.tmp"
    return 0
  fi
  local extra=() d="$RUNS/img2-$model-$ft"
  [ "$ft" = full ] && extra=(model.save_weights=false callbacks.checkpoint=null train.lr=1e-5)
  [ "$TINY" != 1 ] && extra+=(trainer=ddp trainer.devices=1)
  rm -rf "$d"
  part "img2_${model}_${ft}" 150 "$PY" -m stepflow.train "model=${model}_random" "${TRAINER[@]}" "model.finetune=$ft" \
    "${extra[@]}" '~reward=shapes_geneval' +reward._target_=stepflow.testing.random_policies.StandInReward \
    +callbacks.memory._target_=stepflow.testing.random_policies.peak_memory_callback \
    loop.iterations=1 loop.prompts_per_iter=1 loop.group_size=4 loop.num_steps=4 loop.substeps=2 \
    train.micro_batch_size=4 train.beta_kl=0.04 advantage=gain sampler=flow_sde \
    eval.every=0 eval.max_prompts=2 eval.num_steps=2 eval.batch_size=2 eval.grid_prompts=2 "hydra.run.dir=$d"
  "$PY" - "$d" "$model" "$ft" "$OUT/img2.tsv" "$(tail -n 1 "$OUT/parts.tmp" | cut -f2,3)" <<'EOF2'
import csv, sys
from pathlib import Path
d, model, ft, out, rc_s = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]), sys.argv[5].split("\t")
row = {"model": model, "finetune": ft, "rc": rc_s[0], "wall_s": rc_s[1] if len(rc_s) > 1 else ""}
try:
    m = [r for r in csv.DictReader((d / "metrics.csv").open()) if r.get("time/iteration_s")][-1]
    row.update(iteration_s=m["time/iteration_s"], grad_norm=m.get("train/grad_norm", ""),
               reward_mean=m.get("train/reward_mean", ""))
    mem = [r for r in csv.DictReader((d / "memory.csv").open()) if r["iteration"] != "start"][-1]
    row.update(peak_alloc_gib=mem["peak_allocated_gib"], peak_reserved_gib=mem["peak_reserved_gib"])
except (OSError, IndexError, KeyError) as e:
    row["note"] = f"no metrics ({type(e).__name__})"
cols = ["model", "finetune", "rc", "wall_s", "iteration_s", "peak_alloc_gib", "peak_reserved_gib", "grad_norm",
        "reward_mean", "note"]
new = not out.is_file()
with out.open("a") as fh:
    fh.write(("\t".join(cols) + "\n" if new else "") + "\t".join(str(row.get(c, "")) for c in cols) + "\n")
EOF2
  [ "${GPU_CHECK_KEEP_RUNS:-0}" = 1 ] || rm -rf "$d"
}

# the editing families (FLUX.1 Kontext, Qwen-Image-Edit; not in the default PARTS: GPU_CHECK_PARTS="env edit"):
# one LoRA iteration of each *_random model (512 px output, 512 px / 1024²-area sources) on the tiny edit set with the
# source_similarity reward, trainer=ddp on one GPU, peak memory from memory.csv into $OUT/edit.tsv
edit_runs() {
  local limit=$1 m d
  for m in flux_kontext_random qwen_image_edit_random; do
    d="$RUNS/edit-$m"; rm -rf "$d"
    local dev=(); [ "$TINY" != 1 ] && dev=(trainer=ddp trainer.devices=1)
    part "edit_$m" "$limit" "$PY" -m stepflow.train "model=$m" "${TRAINER[@]}" "${dev[@]}" data=edit_tiny \
      reward=source_similarity +callbacks.memory._target_=stepflow.testing.random_policies.peak_memory_callback \
      loop.iterations=1 loop.prompts_per_iter=1 loop.group_size=4 loop.num_steps=4 loop.substeps=2 \
      train.micro_batch_size=4 advantage=gain sampler=flow_sde eval.every=0 eval.max_prompts=1 eval.num_steps=2 \
      eval.batch_size=1 eval.grid_prompts=1 "hydra.run.dir=$d"
    "$PY" - "$d" "$m" "$OUT/edit.tsv" <<'EOF'
import csv, sys
from pathlib import Path
d, m, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
row = {"model": m}
try:
    last = [r for r in csv.DictReader((d / "metrics.csv").open()) if r.get("time/iteration_s")][-1]
    row.update(iteration_s=last["time/iteration_s"], reward=last.get("train/reward_mean", ""),
               grad_norm=last.get("train/grad_norm", ""))
    mem = [r for r in csv.DictReader((d / "memory.csv").open()) if r["iteration"] != "start"][-1]
    row.update(peak_alloc_gib=mem["peak_allocated_gib"], peak_reserved_gib=mem["peak_reserved_gib"])
except (OSError, IndexError, KeyError) as e:
    row["note"] = type(e).__name__
cols = ["model", "peak_alloc_gib", "peak_reserved_gib", "iteration_s", "reward", "grad_norm", "note"]
with out.open("a") as fh:
    fh.write(("" if out.is_file() and out.stat().st_size else "\t".join(cols) + "\n")
             + "\t".join(str(row.get(c, "")) for c in cols) + "\n")
EOF
    [ "${GPU_CHECK_KEEP_RUNS:-0}" = 1 ] || rm -rf "$d"
  done
}

say "gpu_check.sh: parts [$PARTS], total limit ${TOTAL}s, tiny=$TINY, OUT=$OUT, RUNS=$RUNS"
for p in $PARTS; do
  case $p in
    env)
      part env 60 bash -c "command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
        $PY -c \"import sys, torch, diffusers, peft, lightning, hydra, omegaconf; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'diffusers', diffusers.__version__, 'peft', peft.__version__, 'lightning', lightning.__version__, 'hydra', hydra.__version__)\"; \
        $PY -c 'import deepspeed; print(\"deepspeed\", deepspeed.__version__)' 2>&1 | tail -1" ;;
    sd35m)
      part sd35m 150 "$PY" experiments/gpu_check.py --runs sd35_medium:lora,sd35_medium:full --iters 1 "${GC_DEV[@]}" \
        --json "$OUT/sd35m.json" ;;
    strat_lora)
      strategies lora 90 ;;
    big)  # no new model after (limit - 80) s: the largest run takes ~50-70 s
      lim=$(limit_for 330)
      part big "$lim" "$PY" experiments/gpu_check.py \
        --runs sd35_large:lora,flux_dev:lora,qwen_image:lora,sd35_large:full,flux_dev:full,qwen_image:full \
        --advantages gain --iters 1 --steps "$([ "$TINY" = 1 ] && echo 2 || echo 6)" --time-limit $((lim > 100 ? lim - 80 : 20)) "${GC_DEV[@]}" \
        --json "$OUT/big.json" ;;
    strat_full)
      strategies full 120 ;;
    wan)  # video: Wan 2.1 1.3B LoRA + full, Wan 2.2 A14B (two experts) LoRA; its full fine-tuning needs FSDP x8
      strategies lora 120 wan21_t2v_random
      strategies full 120 wan21_t2v_random
      strategies lora 180 wan22_t2v_random ;;
    img2)  # FLUX.2-dev and Z-Image (docs/guide.md)
      part img2_memory 90 "$PY" -m stepflow.testing.random_flux2_zimage --world 8
      img2_run zimage lora 40
      img2_run zimage full 120
      img2_run flux2 lora 100 ;;
    edit)  # FLUX.1 Kontext and Qwen-Image-Edit (docs/guide.md, editing)
      edit_runs 120 ;;
    *) say "gpu_check.sh: unknown part '$p' (env sd35m strat_lora big strat_full wan img2 edit)" ;;
  esac
done

{
  echo
  echo "== summary ($((SECONDS - START))s of ${TOTAL}s)"
  printf 'part\trc\tseconds\tlimit\n'
  cat "$OUT/parts.tmp"
  for j in sd35m big; do
    [ -f "$OUT/$j.json" ] || continue
    echo
    echo "-- gpu_check.py $j (s/it per scheme; peak GiB = the highest phase peak; est = weights+grads+AdamW+EMA+ref)"
    "$PY" - "$OUT/$j.json" <<'EOF'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
print(f"{'model':12s} {'ft':5s} {'status':9s} {'uniform_s':>9s} {'gain_s':>8s} {'peak_GiB':>8s} {'phase':9s} {'est_GiB':>7s}"
      "  rollout/estimate/reward/update GiB (last iteration)")
for r in runs:
    last = (r.get("results") or [{}])[-1]
    ph = "/".join(f"{last[p + '_peak_gib']:.1f}" if p + "_peak_gib" in last else "-" for p in ("rollout", "estimate", "reward", "update"))
    f = lambda k, w, d=1: f"{r[k]:{w}.{d}f}" if isinstance(r.get(k), (int, float)) else f"{'-':>{w}s}"
    print(f"{r['model']:12s} {r['finetune']:5s} {r['status']:9s} {f('uniform_s', 9, 2)} {f('gain_s', 8, 2)} "
          f"{f('peak_gib', 8)} {r.get('peak_phase', ''):9s} {f('estimate_gib', 7, 0)}  {ph}  {r.get('reason', '')[:70]}")
EOF
  done
  if [ -f "$OUT/img2.tsv" ]; then
    echo
    echo "-- FLUX.2-dev / Z-Image, one CLI iteration each (model=<m>_random; docs/guide.md)"
    if command -v column >/dev/null; then column -t -s $'\t' "$OUT/img2.tsv"; else cat "$OUT/img2.tsv"; fi
  fi
  if [ -f "$OUT/edit.tsv" ]; then
    echo
    echo "-- the editing families, one LoRA iteration each (memory.csv peaks)"
    cat "$OUT/edit.tsv"
  fi
  if [ -f "$OUT/strategies.tsv" ]; then
    echo
    echo "-- python -m stepflow.train model=sd35_medium_random, one iteration per strategy (from metrics.csv / memory.csv)"
    if command -v column >/dev/null; then column -t -s $'\t' "$OUT/strategies.tsv"; else cat "$OUT/strategies.tsv"; fi
  fi
} | tee "$OUT/summary.txt" | tee -a "$LOG"
rm -f "$OUT/parts.tmp"
