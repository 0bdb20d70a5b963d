#!/usr/bin/env bash
# The runtime's GPU checks, for one GPU host (about 9 minutes; every step has a time limit,
# 17 minutes in all at most for 1-5, 2 more on one GPU for 6, 6 more with several GPUs). Not
# run by `make test`: CI and this repository's machines have no GPU. Run from anywhere:
#     bash benchmarks/gpu_check.sh            # every step
#     MESH_ONLY=1 bash benchmarks/gpu_check.sh   # step 6 only (about 1 minute on one GPU)
#
#   1. the CUDA tests (pytest -m gpu): one rank on the GPU over NCCL, V-shape hand-offs and
#      fused F&B on two CUDA streams, the overlap hook, tuple boundaries, split backward on
#      the GPU; NCCL between two ranks when there are two GPUs;
#   2. split backward on the GPU: I + W against B, walk and contract, MLP and GPT block
#      (benchmarks/split_backward.py);
#   3. `pipecc run --check --profile` on the GPU: every gradient against the single-process
#      reference, and measured per-op costs (P=1 on one GPU, P=2 on two);
#   4. the GPT of examples/gpt.py on the GPU with --check: tied embeddings (the shared-
#      parameter sum), dropout (the per-forward RNG states derived on CUDA, the reference on
#      the same device type), bf16 autocast (real-run shape inference, the bf16 tolerance),
#      and the step's shape gather over NCCL; then full and selective recomputation
#      (`--recompute full`, `attn`: the forward replayed under the CUDA RNG state it drew)
#      with --check and --memory (the CUDA allocator's peak beside the prediction);
#   5. no host sync in a warm step (benchmarks/gpu_sync_check.py): after two warm-up steps,
#      one step under torch.cuda.set_sync_debug_mode("error") (any .item(), .cpu(), blocking
#      copy or synchronize raises), running the static plan bound on the first step (bound
#      once, the same receive buffers on CUDA at every step: runtime/engine/bound.py), on P=1
#      programs with fused F&B on two CUDA streams and,
#      with two GPUs, P=2 over NCCL whose groups must go through batch_isend_irecv's
#      coalescing branch (on CPU, tests/runtime/test_posting.py emulates that branch on gloo);
#   6. the mesh (docs/parallelism.md): on any GPU, FSDP2 stages under split backward (ZB-H1,
#      DualPipeV) with the tied embedding's sharded copies summed, on a mesh of one shard
#      (benchmarks/gpu_mesh_check.py: gradients against one process, no FSDP collective
#      beyond the program's); with 2 or more GPUs, `pipecc run --mesh` over NCCL with
#      --check for dp_shard=2 (FSDP2), dp_replicate=2 and tp=2, the tied GPT (ZBV on pp=2
#      with 4 GPUs, DualPipeV on pp=1 with 2 or 3); with one GPU that part is skipped and
#      says so (NCCL puts each rank on a GPU of its own).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
PIPECC="${PIPECC:-.venv/bin/pipecc}"
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"

nvidia-smi -L || true
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -lt 1 ]; then
    echo "no CUDA device: nothing to check" >&2
    exit 1
fi

if [ -z "${MESH_ONLY:-}" ]; then
echo "== 1. CUDA tests"
timeout 240 "$PY" -m pytest -q -m gpu tests/runtime -p no:cacheprovider

echo "== 2. split backward on the GPU (target: I+W <= 1.10 x B)"
timeout 90 "$PY" benchmarks/split_backward.py --device cuda --rounds 10

echo "== 3. pipecc run on the GPU"
if [ "$GPUS" -ge 2 ]; then SCHEDULE=zbv; RANKS=2; else SCHEDULE=dualpipev; RANKS=1; fi
PIPECC_MLP_HIDDEN=1024 timeout 120 "$PIPECC" run "$SCHEDULE" --nproc "$RANKS" -M 8 \
    --model examples/mlp.py --check --steps 10 --warmup 2 --json --profile "$OUT/costs.toml" \
    --allow-noisy-profile | tee "$OUT/run.json"  # the spread is in run.json and costs.toml
cat "$OUT/costs.toml"

echo "== 4. the GPT on the GPU: tied embeddings, dropout, bf16 autocast"
PIPECC_GPT_TIED=1 PIPECC_GPT_DROPOUT=0.1 PIPECC_GPT_DIM=256 PIPECC_GPT_SEQ=128 \
    timeout 120 "$PIPECC" run "$SCHEDULE" --nproc "$RANKS" -M 8 --model examples/gpt.py \
    --check --steps 3 --warmup 1 --json | tee "$OUT/gpt.json"
PIPECC_GPT_TIED=1 PIPECC_GPT_DROPOUT=0.1 PIPECC_GPT_DIM=256 PIPECC_GPT_SEQ=128 \
    timeout 120 "$PIPECC" run "$SCHEDULE" --nproc "$RANKS" -M 8 --model examples/gpt.py \
    --check --steps 3 --warmup 1 --autocast bf16 --json | tee "$OUT/gpt_bf16.json"
for MODE in full attn; do  # the CUDA RNG state replayed; CUDA's allocator peak vs predicted
    PIPECC_GPT_DROPOUT=0.1 PIPECC_GPT_DIM=256 PIPECC_GPT_SEQ=128 \
        timeout 120 "$PIPECC" run "$SCHEDULE" --nproc "$RANKS" -M 8 --model examples/gpt.py \
        --recompute "$MODE" --check --memory --steps 3 --warmup 1 --json \
        | tee "$OUT/gpt_recompute_$MODE.json"
done
echo "== 5. no host sync in a warm step; NCCL's coalesced posting"
timeout 180 "$PY" benchmarks/gpu_sync_check.py | tee "$OUT/sync.txt"
fi

echo "== 6. the mesh: FSDP2 stages under split backward, tied; NCCL between GPUs"
timeout 120 "$PY" benchmarks/gpu_mesh_check.py | tee "$OUT/mesh_one_gpu.txt"
if [ "$GPUS" -ge 4 ]; then MESH_SCHEDULE=zbv; MESH_NPROC=4; else MESH_SCHEDULE=dualpipev; MESH_NPROC=2; fi
if [ "$GPUS" -ge 2 ]; then
    for MESH in dp_shard=2 dp_replicate=2 tp=2; do
        PIPECC_GPT_TIED=1 PIPECC_GPT_DIM=256 PIPECC_GPT_SEQ=128 timeout 120 "$PIPECC" run \
            "$MESH_SCHEDULE" --nproc "$MESH_NPROC" -M 8 --mesh "$MESH" --model examples/gpt.py \
            --check --steps 3 --warmup 1 --json | tee "$OUT/mesh_${MESH%%=*}.json"
    done
else
    echo "skipped: pipecc run --mesh over NCCL needs 2 GPUs or more (one rank per GPU); this host has $GPUS"
fi
echo "gpu check: ok"
