#!/usr/bin/env bash
# The GPU path in one command that fits a device loan (issue #35): versions, the GPU test
# suite, the Llama-3-8B-shaped roofline, W4A16 and FP8 matmuls beside bf16, offline
# throughput against transformers, and multi-LoRA if time remains. It keeps to its budget (320 s; 350 s at worst with the kill
# grace and the closing summary), each part under its own cap, and writes each part's
# results under $OUT as soon as the part ends, so a cut run still returns what it did.
#
# The device-tool call, when a GPU is lent (15 minutes of device time in all):
#   1. here, once:  make gpu-wheels
#      (.whl/, ~10 MB: grpcio, protobuf, structlog, pytest-asyncio, ... for the GPU
#      machine's Python 3.12; that machine has no network, so the wheels travel by carry;
#      GPU_KV_WHEELS=1 adds Mooncake's 46 MB, for tests/gpu's KV-transfer test)
#   2. run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=360)
#      360 s + ~1.5 min to start the machine leaves room for one rerun inside the 15
#      minutes. The machine stays warm 30 s after a reply: rerun at once what was cut
#      or lost, e.g. run(command="bash scripts/gpu_check.sh --parts offline,lora",
#      carry=[".whl"], timeout_s=360), else call give_back.
#   3. here:  make gpu-report IN="<files_at of run 1> [<files_at of the rerun>]"
#      writes docs/benchmarks/gpu.md from the returned files (omnibus.bench.gpu_report).
#
# Usage: scripts/gpu_check.sh [--smoke] [--parts tests,roofline,quant,offline,lora]
#   --smoke  a dry run on the CPU (no CUDA): tiny shapes through every part's code path in
#            well under a minute; the GPU tests report skipped (they need CUDA) and the
#            output says it is a smoke run everywhere. tests/bench/test_gpu_check_smoke.py
#            runs it in `make test`.
#   --parts  which of tests,roofline,quant,offline,lora to run (env and versions always run).
# Caps (GPU): env 60 s per pip command, versions 60, tests 150 (pytest-timeout 90 s per test where the
# machine has it, and a cap per test file), roofline 90, quant 60, offline 150, lora 120; each is
# cut to what is left of the budget, and a part with under 20 s left is skipped.
# Environment: OUT (default build/gpu-check), GPU_CHECK_PY (default python3 on a GPU, the
# project venv's python for --smoke), GPU_CHECK_BUDGET (seconds, default 320; smoke 300: a loaded host must not cut a dry run),
# GPU_CHECK_CAP_<part> (one part's cap in seconds), GPU_CHECK_MIN_PART (20; smoke 5),
# GPU_CHECK_REQUESTS (offline, 200), GPU_CHECK_STATIC_REQUESTS (of those, the first 64 time
# transformers' static generate), GPU_CHECK_LORA_REQUESTS (128).
#
# $OUT gets at most these 5 files (the device tool returns 8 at most, 2 folders deep):
#   versions.json  device, driver, CUDA, torch, triton, transformers; smoke or not
#   parts.jsonl    one line per part as it ends: status ok|failed|timeout|skipped, seconds, cap
#   tests.xml      the GPU tests' junit results, one suite per file (a cut file is an error)
#   bench.json     omnibus.bench.gpu's results (roofline, quant, decode, offline, hf, lora)
#   log.txt        everything printed
# The environment is built from what travels with the tree, with no network: the wheels in
# .whl/ and omnibus itself (pip install -e . --no-deps) go into the machine's own Python,
# whose torch 2.11 / triton 3.6 this run uses (the project pins triton 3.9 for the CPU
# interpreter, which this run does not use).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
SMOKE=0
PARTS=tests,roofline,quant,offline,lora
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --parts) PARTS=${2:?--parts needs a list}; shift ;;
    --parts=*) PARTS=${1#*=} ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for p in ${PARTS//,/ }; do
  case $p in tests|roofline|quant|offline|lora) ;; *) echo "gpu_check: unknown part $p" >&2; exit 2 ;; esac
done

OUT=${OUT:-$ROOT/build/gpu-check}
mkdir -p "$OUT"
rm -f "$OUT"/versions.json "$OUT"/parts.jsonl "$OUT"/tests.xml "$OUT"/bench.json "$OUT"/bench.json.tmp "$OUT"/log.txt
if [ "$SMOKE" = 1 ]; then
  BUDGET=${GPU_CHECK_BUDGET:-300}; MIN_PART=${GPU_CHECK_MIN_PART:-5}; PER_TEST=60; MIN_FILE=10
  if [ -z "${GPU_CHECK_PY:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then GPU_CHECK_PY=$ROOT/.venv/bin/python; fi
  BENCH=(--smoke --kv-cache-gib 0.0625)  # the GPU run's flags, at a tiny size
  BATCHES=1,2,4; REQUESTS=2; STATIC_REQUESTS=1; LORA_REQUESTS=2
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # tiny shapes: threads only contend on a shared CPU
else
  BUDGET=${GPU_CHECK_BUDGET:-320}; MIN_PART=${GPU_CHECK_MIN_PART:-20}; PER_TEST=90; MIN_FILE=40
  BENCH=(--kv-cache-gib 24)  # a fixed KV pool: same on H100 and H200, room for transformers beside it
  BATCHES=1,32,256; REQUESTS=${GPU_CHECK_REQUESTS:-200}; LORA_REQUESTS=${GPU_CHECK_LORA_REQUESTS:-128}
  # static generate runs batch after batch (16 each, ~400 eager steps apiece): four of them
  # measure its tokens/s as well as thirteen, in a third of the time
  STATIC_REQUESTS=${GPU_CHECK_STATIC_REQUESTS:-64}
fi
PY=${GPU_CHECK_PY:-python3}
RESERVE=10  # seconds kept for the closing summary
DEADLINE=$((SECONDS + BUDGET))
export PYTHONUNBUFFERED=1
STATUS=0

log() { printf '%s\n' "$*" | tee -a "$OUT/log.txt"; }

# One line of parts.jsonl: part status rc seconds cap note (the note without quotes).
record() {
  local note=${6//[\"\\]/}
  printf '{"part": "%s", "status": "%s", "rc": %s, "seconds": %s, "cap": %s, "smoke": %s, "note": "%s"}\n' \
    "$1" "$2" "$3" "$4" "$5" "$([ "$SMOKE" = 1 ] && echo true || echo false)" "$note" >>"$OUT/parts.jsonl"
  [ "$2" = ok ] || STATUS=1
  log "== $1: $2 (rc $3, ${4}s of ${5}s)${note:+ -- $note}"
}

status_of() { case $1 in 0) echo ok ;; 124|137) echo timeout ;; *) echo failed ;; esac; }

# The cap a part gets: its own (GPU_CHECK_CAP_<part> overrides), never past the budget.
cap_for() {
  local var="GPU_CHECK_CAP_$1" cap=$2 left=$((DEADLINE - SECONDS - RESERVE))
  cap=${!var:-$cap}
  [ "$cap" -gt "$left" ] && cap=$left
  echo "$cap"
}

# run_part NAME CAP NOTE CMD...: CMD under `timeout`, its output to the log, one record.
run_part() {
  local name=$1 cap note=$3 t0=$SECONDS rc
  cap=$(cap_for "$1" "$2"); shift 3
  if [ "$cap" -lt "$MIN_PART" ]; then record "$name" skipped null 0 "$cap" "no time left in the ${BUDGET}s budget"; return; fi
  log "== $name (cap ${cap}s): $*"
  timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$OUT/log.txt"
  rc=${PIPESTATUS[0]}
  record "$name" "$(status_of $rc)" "$rc" $((SECONDS - t0)) "$cap" "$note"
}

wants() { [[ ",$PARTS," == *",$1,"* ]]; }

log "gpu_check: $( [ "$SMOKE" = 1 ] && echo 'CPU SMOKE RUN (tiny shapes, not GPU numbers)' || echo 'GPU run' ); parts $PARTS; budget ${BUDGET}s; OUT=$OUT; python $PY"

# --- env: the wheels and omnibus itself, installed into the machine's own Python ----------
# The lent machine is bare and thrown away after the loan, and its python3 is a venv
# (/opt/torch/.venv) that holds torch: a venv made over it would not see torch
# (--system-site-packages reaches the base interpreter's packages), so the wheels and
# omnibus (editable, as `make setup` installs it) go into that Python. A smoke run leaves
# the project venv alone: it already has omnibus, and pip only dry-runs the install.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS; rc=0; note=""
wheels=()
for w in .whl/*.whl; do [ -e "$w" ] && wheels+=("$w"); done
PIP=("$PY" -m pip install -q --no-index --no-deps --no-cache-dir --disable-pip-version-check)
if [ ${#wheels[@]} = 0 ]; then
  note="no .whl/ carried: the machine's own packages only (structlog, pytest-asyncio may be missing; make gpu-wheels here)"
elif [ "$SMOKE" = 1 ]; then
  note="smoke: ${#wheels[@]} wheels in .whl/ not installed (the project venv has them)"
else
  log "== env: pip install of ${#wheels[@]} wheels"
  timeout -k 5 "$(cap_for env 60)" "${PIP[@]}" --no-compile "${wheels[@]}" 2>&1 | tee -a "$OUT/log.txt"
  rc=${PIPESTATUS[0]}
  note="${#wheels[@]} wheels installed"
fi
if [ "$rc" = 0 ]; then
  if [ "$SMOKE" = 1 ]; then EDITABLE=(--dry-run -e .); note="$note; smoke: pip install -e . dry-run only"
  else EDITABLE=(-e .); fi
  log "== env: pip install ${EDITABLE[*]} (no deps, no build isolation)"
  timeout -k 5 "$(cap_for env 60)" "${PIP[@]}" --no-build-isolation "${EDITABLE[@]}" 2>&1 | tee -a "$OUT/log.txt"
  rc=${PIPESTATUS[0]}
fi
record env "$(status_of "$rc")" "$rc" $((SECONDS - t0)) 60 "$note"

# --- 1. versions (and whether omnibus' engine imports over this Python) -------------------
SMOKE_FLAG=(); [ "$SMOKE" = 1 ] && SMOKE_FLAG=(--smoke)
run_part versions 60 "" "$PY" -m omnibus.bench.gpu_check versions --out "$OUT/versions.json" \
  "${SMOKE_FLAG[@]}" --budget "$BUDGET" --parts "$PARTS"

# --- 2. the GPU test suite: per-file caps, per-test timeout where pytest-timeout is there ---
# (tests/gpu/test_engine_gpu.py holds TP=2 over NCCL against TP=1 and transformers; on a host
# with one GPU, the lent one, it reports skipped: "tensor parallelism needs 2 CUDA devices")
if wants tests; then
  t0=$SECONDS; part_cap=$(cap_for tests 150); rc=0
  files=(tests/gpu/test_kernels_gpu.py)
  for f in tests/gpu/test_*.py; do [ "$f" = "${files[0]}" ] || files+=("$f"); done
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST_FLAGS=(--timeout="$PER_TEST"); note="pytest-timeout ${PER_TEST}s per test"
  else
    PYTEST_FLAGS=(); note="pytest-timeout not installed: per-file caps only"
  fi
  if ! "$PY" -c "import pytest_asyncio.plugin" 2>/dev/null; then
    PYTEST_FLAGS+=(-p no:asyncio); note="$note; pytest-asyncio does not load here: its async test fails"
  fi
  [ "$SMOKE" = 1 ] && note="$note; smoke: no CUDA, so every GPU test reports skipped (needs a CUDA device)"
  specs=(); mkdir -p "$WORK/junit"
  if [ "$part_cap" -lt "$MIN_PART" ]; then
    record tests skipped null 0 "$part_cap" "no time left in the ${BUDGET}s budget"
  else
    for i in "${!files[@]}"; do
      f=${files[$i]}; later=$(( ${#files[@]} - i - 1 ))
      # what the part has left, less MIN_FILE for each later file, but MIN_FILE at least,
      # and never past the part's cap or the budget
      fcap=$(( part_cap - (SECONDS - t0) - later * MIN_FILE ))
      [ "$fcap" -lt "$MIN_FILE" ] && fcap=$MIN_FILE
      left=$(( part_cap - (SECONDS - t0) )); [ "$fcap" -gt "$left" ] && fcap=$left
      left=$(( DEADLINE - SECONDS - RESERVE )); [ "$fcap" -gt "$left" ] && fcap=$left
      junit="$WORK/junit/$i.xml"; ft0=$SECONDS
      if [ "$fcap" -lt 1 ]; then frc=124; junit=""
      else
        log "== tests: $f (cap ${fcap}s)"
        timeout -k 10 "$fcap" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs "${PYTEST_FLAGS[@]}" \
          --junitxml="$junit" "$f" 2>&1 | tee -a "$OUT/log.txt"
        frc=${PIPESTATUS[0]}
      fi
      specs+=("$f=$frc:$((SECONDS - ft0)):$junit")
      case $frc in 0|5) ;; 124|137) rc=124 ;; *) [ "$rc" = 0 ] && rc=$frc ;; esac
    done
    "$PY" -m omnibus.bench.gpu_check junit --out "$OUT/tests.xml" "${specs[@]}" 2>&1 | tee -a "$OUT/log.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || { [ "$rc" = 0 ] && rc=1; }
    record tests "$(status_of "$rc")" "$rc" $((SECONDS - t0)) "$part_cap" "$note"
  fi
fi

# --- 3. roofline: decode at batch 1/32/256 vs (weights + KV) / copy bandwidth; idle share ---
if wants roofline; then
  note="Llama-3-8B shape, bf16, random weights; batches $BATCHES"
  [ "$SMOKE" = 1 ] && note="smoke: tiny shape on the CPU in float32; batches $BATCHES; no CUDA events, so no idle share"
  run_part roofline 90 "$note" "$PY" -m omnibus.bench.gpu "${BENCH[@]}" --sections roofline,decode \
    --batches "$BATCHES" --json "$OUT/bench.json"
fi

# --- 4. W4A16 decode and FP8 GEMMs beside bf16 dense at Llama-3-8B's projection shapes ------
if wants quant; then
  note="4096x4096 and 14336x4096; W4A16 (Triton, group 128) at T 1/16/64, FP8 _scaled_mm at T 16/256/2048"
  [ "$SMOKE" = 1 ] && note="smoke: tiny shapes on the CPU in float32, the Triton kernel interpreted"
  run_part quant 60 "$note" "$PY" -m omnibus.bench.gpu "${BENCH[@]}" --sections quant --json "$OUT/bench.json"
fi

# --- 5. offline throughput vs transformers (continuous batching, static generate) ---------
if wants offline; then
  note="$REQUESTS ShareGPT-shaped requests; transformers in the same process (static generate timed on the first $STATIC_REQUESTS)"
  [ "$SMOKE" = 1 ] && note="smoke: $REQUESTS requests at a tiny shape on the CPU"
  run_part offline 150 "$note" "$PY" -m omnibus.bench.gpu "${BENCH[@]}" --sections offline,hf \
    --requests "$REQUESTS" --hf-static-requests "$STATIC_REQUESTS" --json "$OUT/bench.json"
fi

# --- 6. if time remains: 8 and 32 LoRA adapters vs base ----------------------------------
if wants lora; then
  note="$LORA_REQUESTS requests per run, rank 16 on q/k/v/o"
  [ "$SMOKE" = 1 ] && note="smoke: $LORA_REQUESTS requests at a tiny shape on the CPU, rank 8"
  run_part lora 120 "$note" "$PY" -m omnibus.bench.gpu "${BENCH[@]}" --sections lora \
    --requests "$LORA_REQUESTS" --json "$OUT/bench.json"
fi

# --- the short table the device tool's output tail carries ---------------------------------
log "== summary ($((SECONDS))s in all)"
timeout -k 5 "$((RESERVE + 10))" "$PY" -m omnibus.bench.gpu_report --in "$OUT" --summary 2>&1 | tee -a "$OUT/log.txt"
exit $STATUS
