#!/usr/bin/env bash
# The runtime's checks on a GPU machine as it is: its own `python3` (or $PYTHON) and the
# packages it has (torch with CUDA, networkx, pytest), nothing installed, no virtual
# environment, pipecc imported from this working tree. Not run by `make test` (CI has no
# GPU); tests/runtime/test_gpu_check.py runs it without CUDA.
#
#     bash benchmarks/gpu_check.sh [--lark DIR]      # from anywhere; OUT=folder (out/gpu_check)
#
# pipecc comes from the tree through benchmarks/tree_site/sitecustomize.py (on PYTHONPATH:
# it maps pipecc.runtime to runtime/, pipecc.grammars to grammars/, pipecc.schedules to
# schedules/, as pyproject.toml's package-dir does when installed), in every process,
# spawned ranks included. lark, pure Python, is the one package such a machine may lack: it
# comes from a folder beside the tree, `--lark DIR` or $LARK_DIR (default shared/wheels/lark,
# inside the working tree so that it travels with it), made where an index is reachable:
#
#     pip download lark==1.3.1 --no-deps -d /tmp/lark && mkdir -p shared/wheels/lark \
#         && unzip -q -o /tmp/lark/lark-1.3.1-py3-none-any.whl -d shared/wheels/lark
#
# (a .whl left in that folder is put on the path too). Every step is its own process under
# its own `timeout`; a step runs whatever failed before it; the steps share a budget of 7
# minutes ($GPU_CHECK_BUDGET seconds): once it is spent the rest are skipped, and say so.
# Output is unbuffered (a killed step's lines are kept). $OUT gets summary.txt (one verdict
# line per step: PASS, FAIL, SKIP or TIMEOUT, and its seconds), log.txt (everything printed)
# and costs.toml (the profile): 3 files. Without CUDA every GPU step is skipped, and the
# check exits 0. Exit 1 when a step failed or timed out. In order of value:
#
#   versions   Python, torch (CUDA, NCCL, devices), lark; pipecc from this tree; torch 2.11-2.13
#   compat     runtime/compat.py's tests on this torch (2.11 on the GPU machine; 2.13 in CI)
#   gpu-tests  pytest -m gpu: one rank over NCCL, V shapes and fused F&B on two streams
#   sync       no host sync of any kind in a warm step: it returns while 2 s of queued GPU
#              work still runs (benchmarks/gpu_sync_check.py)
#   streams    the two halves of every fused op on different streams (a profiler trace), and
#              a no-gradient hand-off read late across the streams (gpu_streams_check.py)
#   gpt-*      the GPT with --check: tied + dropout; bf16; --recompute full and attn with --memory
#   fsdp       FSDP2 stages on a mesh of one shard under split backward (gpu_mesh_check.py)
#   nccl-2     2+ GPUs: pipecc run --nproc 2 over NCCL with --check
#   mesh-2     2+ GPUs: the tied GPT on a mesh, dp_shard=2 (FSDP2 over NCCL), with --check
#   nccl-4     4+ GPUs: the aligned zb_h1 at P=4 over NCCL with --check
#   ep-4       4+ GPUs: PP=2 x EP=2, DualPipeV's MoE all-to-alls over NCCL with --check
#   ep-overlap 4+ GPUs: benchmarks/ep_overlap.py over NCCL, overlapped against sequential
#   sanitizer  warm steps under torch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1)
#   split      measurement: split backward, I + W against B (benchmarks/split_backward.py)
#   profile    measurement: pipecc run --profile, the cost file into $OUT/costs.toml
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
OUT="${OUT:-out/gpu_check}"
LARK_DIR="${LARK_DIR:-shared/wheels/lark}"
BUDGET="${GPU_CHECK_BUDGET:-420}"
while [ $# -gt 0 ]; do
    case "$1" in
        --lark) LARK_DIR="$2"; shift 2 ;;
        *) echo "usage: bash benchmarks/gpu_check.sh [--lark DIR]" >&2; exit 2 ;;
    esac
done
case "$LARK_DIR" in /*) ;; *) LARK_DIR="$ROOT/$LARK_DIR" ;; esac
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
LOG="$OUT/log.txt"
: > "$SUMMARY"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

LARK_PATH="$LARK_DIR"
for wheel in "$LARK_DIR"/*.whl; do
    [ -e "$wheel" ] && LARK_PATH="$LARK_PATH:$wheel"
done
export PYTHONPATH="$ROOT/benchmarks/tree_site:$LARK_PATH${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
FAILED=0

verdict() {  # VERDICT NAME SECONDS [WHY]
    printf '%-7s %-20s %4ss%s\n' "$1" "$2" "$3" "${4:+  $4}" | tee -a "$SUMMARY"
}

step() {  # NAME LIMIT COMMAND...: the command under `timeout`, within what the budget leaves
    local name=$1 limit=$2 left
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 10 ]; then
        verdict SKIP "$name" 0 "the budget of ${BUDGET}s is spent"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit}s): $*"
    local began=$SECONDS rc
    timeout -k 5 "$limit" "$@"
    rc=$?
    local took=$((SECONDS - began))
    case $rc in
        0) verdict PASS "$name" "$took" ;;
        124 | 137) verdict TIMEOUT "$name" "$took" "killed at ${limit}s"; FAILED=1 ;;
        *) verdict FAIL "$name" "$took" "exit $rc"; FAILED=1 ;;
    esac
}

gpu_step() {  # as `step`, skipped without CUDA
    if [ "$GPUS" -lt 1 ]; then
        verdict SKIP "$1" 0 "no CUDA device"
    else
        step "$@"
    fi
}

gpus_step() {  # COUNT NAME LIMIT COMMAND...: as `step`, skipped with fewer than COUNT GPUs
    local need=$1
    shift
    if [ "$GPUS" -lt "$need" ]; then
        verdict SKIP "$1" 0 "needs $need GPUs (one rank per GPU), this host has $GPUS"
    else
        step "$@"
    fi
}

PIPECC=("$PY" -u -m pipecc.cli)
GPT=(env PIPECC_GPT_DIM=256 PIPECC_GPT_SEQ=128)
RUN=(run dualpipev --nproc 1 -M 8 --steps 3 --warmup 1 --timeout 60)

(command -v nvidia-smi >/dev/null && nvidia-smi -L) || echo "nvidia-smi: not here"
GPUS="$(timeout 60 "$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)"
GPUS="${GPUS:-0}"
echo "python: $PY; CUDA devices: $GPUS; lark from: $LARK_DIR; out: $OUT"
[ "$GPUS" -lt 1 ] && echo "no CUDA device: every GPU step is skipped"
GPU_TESTS=$(grep -l "pytest.mark.gpu" tests/runtime/test_*.py | tr '\n' ' ')

step versions 60 "$PY" -u benchmarks/gpu_versions.py
step compat 120 "$PY" -u -m pytest -q -p no:cacheprovider tests/runtime/test_compat.py
# shellcheck disable=SC2086  # the test files, one word each
gpu_step gpu-tests 150 "$PY" -u -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS
gpu_step sync 90 "$PY" -u benchmarks/gpu_sync_check.py
gpu_step streams 90 "$PY" -u benchmarks/gpu_streams_check.py
gpu_step gpt-tied-dropout 90 "${GPT[@]}" PIPECC_GPT_TIED=1 PIPECC_GPT_DROPOUT=0.1 \
    "${PIPECC[@]}" "${RUN[@]}" --model examples/gpt.py --check
gpu_step gpt-bf16 90 "${GPT[@]}" PIPECC_GPT_TIED=1 PIPECC_GPT_DROPOUT=0.1 \
    "${PIPECC[@]}" "${RUN[@]}" --model examples/gpt.py --check --autocast bf16
gpu_step gpt-recompute-full 90 "${GPT[@]}" PIPECC_GPT_DROPOUT=0.1 \
    "${PIPECC[@]}" "${RUN[@]}" --model examples/gpt.py --check --recompute full --memory
gpu_step gpt-recompute-attn 90 "${GPT[@]}" PIPECC_GPT_DROPOUT=0.1 \
    "${PIPECC[@]}" "${RUN[@]}" --model examples/gpt.py --check --recompute attn --memory
gpu_step fsdp 90 "$PY" -u benchmarks/gpu_mesh_check.py
gpus_step 2 nccl-2 120 "${PIPECC[@]}" run zbv --nproc 2 -M 4 --model examples/mlp.py \
    --check --steps 3 --warmup 1 --timeout 60
gpus_step 2 mesh-2 120 env PIPECC_GPT_TIED=1 PIPECC_GPT_DIM=256 PIPECC_GPT_SEQ=128 \
    "${PIPECC[@]}" run dualpipev --nproc 2 -M 8 --mesh dp_shard=2 --model examples/gpt.py \
    --check --steps 3 --warmup 1 --timeout 60
gpus_step 4 nccl-4 120 "${PIPECC[@]}" run zb_h1 --nproc 4 -M 8 --align \
    --cost F=1,B=2,I=1,W=1,comm=0.1 --model examples/mlp.py --check --steps 3 --warmup 1 \
    --timeout 60
gpus_step 4 ep-4 120 "${PIPECC[@]}" run dualpipev --nproc 4 -M 8 --mesh pp=2,ep=2 --moe 2 \
    --model examples/moe_ep.py --check --steps 3 --warmup 1 --timeout 60
gpus_step 4 ep-overlap 150 "$PY" -u benchmarks/ep_overlap.py --device cuda --rounds 3 \
    --size 1024,1024,2048 --size 2048,2048,4096
gpu_step sanitizer 120 env TORCH_CUDA_SANITIZER=1 "$PY" -u benchmarks/gpu_streams_check.py \
    --sanitize
gpu_step split 60 "$PY" -u benchmarks/split_backward.py --device cuda --rounds 5
gpu_step profile 90 env PIPECC_MLP_HIDDEN=1024 "${PIPECC[@]}" run dualpipev --nproc 1 -M 8 \
    --model examples/mlp.py --steps 10 --warmup 2 --timeout 60 --profile "$OUT/costs.toml" \
    --allow-noisy-profile

echo "== summary ($((SECONDS - START))s of ${BUDGET}s)"
cat "$SUMMARY"
if [ "$FAILED" -ne 0 ]; then
    echo "gpu check: FAILED"
    exit 1
fi
echo "gpu check: ok"
