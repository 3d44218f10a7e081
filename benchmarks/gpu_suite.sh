#!/usr/bin/env bash
# The GPU benchmarks in one command, stage by stage, each stage under its own time limit.
#
#   bash benchmarks/gpu_suite.sh                  # every stage (about 8 minutes on an H100)
#   bash benchmarks/gpu_suite.sh quick            # train + profile, torch.compile, decode (< 4 min)
#   bash benchmarks/gpu_suite.sh kernels train    # some stages
#   OUT_DIR=/tmp/gpu STEPS=10 KERNELS_ARGS=--quick bash benchmarks/gpu_suite.sh kernels train
#
# Stages:
#   env      nvidia-smi, python and package versions, jax's devices
#   kernels  every attention / ragged-dot strategy against the reference (benchmarks/kernels_check.py)
#   train    gpu-1b with attention auto (cudnn), xla_flash and tokamax ($TRAIN_IMPLS), the first
#            one profiled (kernel time by group in train.log and profile.txt); full remat + scan
#            (unless TRAIN_REMAT=0)
#   fp8      gpu-1b with qwix fp8 training against the same run in bf16
#   xlaflags gpu-1b with --xla_gpu_enable_triton_gemm=false
#   moe      moe-small and gpu-moe on the GPU (gpu-moe with bf16 weights and moments, full remat)
#   decode   benchmarks/decode.py on gpu-1b at batch 1 and 16
#   peers    the PyTorch peer ($PEER_MODES: eager and torch.compile) on gpu-1b, through --python
#   hf       benchmarks/hf_decode.py: transformers generate against maxnnx on one checkpoint
#   serving  the serving engine on gpu-1b: 16 concurrent clients, then one at a time
#   quick    env, train (auto only, profiled), peers (torch.compile only), decode
#
# Result lines go to $OUT_DIR/gpu.jsonl (compare with `python -m benchmarks.compare FILE`), logs to
# $OUT_DIR/<stage>.log. PYTHON picks the interpreter (default python3). Wheels in .whl/ (for
# packages the machine lacks) are installed into a private folder first.
set -u
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-${OUT:-benchmarks/results/gpu}}
STEPS=${STEPS:-20}
STAGE_LIMIT_S=${STAGE_LIMIT_S:-240}
mkdir -p "$OUT_DIR"
JSON="$OUT_DIR/gpu.jsonl"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" > /dev/null; then
  rm -rf /tmp/maxnnx-site
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/maxnnx-site .whl/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/maxnnx-site"
fi

run() {  # run LIMIT_S LOG CMD...: one command under a time limit, its output appended to LOG
  local limit=$1 log=$2; shift 2
  echo "+ $*" | tee -a "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && echo "  (exit $rc)" | tee -a "$log"
  tail -n 6 "$log" | sed 's/^/  | /'
}

stage_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PYTHON" - <<'EOF'
import importlib.metadata as md, platform
import jax
print('python', platform.python_version(), '| devices', jax.devices())
for name in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'grain', 'tokamax', 'qwix',
             'torch', 'transformers'):
  try:
    print(f'{name} {md.version(name)}')
  except md.PackageNotFoundError:
    print(f'{name} missing')
import maxnnx  # noqa: F401
print('maxnnx imports')
EOF
}

stage_kernels() {
  run "$STAGE_LIMIT_S" "$OUT_DIR/kernels.log" "$PYTHON" -m benchmarks.kernels_check ${KERNELS_ARGS:-}
}

stage_train() {
  local log="$OUT_DIR/train.log" profile="--profile /tmp/maxnnx-profile"
  for impl in ${TRAIN_IMPLS:-auto xla_flash tokamax}; do
    run "$STAGE_LIMIT_S" "$log" "$PYTHON" -m benchmarks.train_throughput --config gpu-1b \
      --steps "$STEPS" --attention-impl "$impl" --json "$JSON" $profile
    profile=""
  done
  grep -A40 '^profile (' "$log" > "$OUT_DIR/profile.txt" 2>/dev/null
  [ "${TRAIN_REMAT:-1}" = 0 ] && return
  run "$STAGE_LIMIT_S" "$log" "$PYTHON" -m benchmarks.train_throughput --config gpu-1b \
    --steps "$STEPS" --remat full --scan --json "$JSON"
}

stage_fp8() {  # qwix fp8 (e4m3 forward, e5m2 gradients) against bf16, same steps and data
  local log="$OUT_DIR/fp8.log"
  for quant in ${FP8_MODES:-fp8 none}; do
    run "$STAGE_LIMIT_S" "$log" "$PYTHON" -m benchmarks.train_throughput --config gpu-1b \
      --steps "$STEPS" --quantization "$quant" --json "$JSON"
  done
}

stage_xlaflags() {  # the default run with cuBLAS for every matmul (no Triton GEMM fusions)
  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false ${XLA_FLAGS:-}" run "$STAGE_LIMIT_S" \
    "$OUT_DIR/xlaflags.log" "$PYTHON" -m benchmarks.train_throughput --config gpu-1b \
    --steps "$STEPS" --json "$JSON"
}

stage_moe() {
  local log="$OUT_DIR/moe.log"
  [ "${MOE_SMALL:-1}" = 0 ] || run "$STAGE_LIMIT_S" "$log" "$PYTHON" -m benchmarks.train_throughput \
    --config moe-small --device gpu --steps "$STEPS" --json "$JSON"
  # lax.ragged_dot's transpose asked for 64 GiB on an H100 (jax 0.11.2); 'tiled' is exact too.
  # 5.6 B parameters: float32 weights and moments need 90 GB, so bf16 ones (45 GB) on one GPU.
  run "$STAGE_LIMIT_S" "$log" "$PYTHON" -m benchmarks.train_throughput --config gpu-moe \
    --steps "$STEPS" --ragged-dot-impl "${GPU_MOE_RAGGED:-tiled}" --param-dtype bfloat16 \
    --remat "${GPU_MOE_REMAT:-full}" --scan --json "$JSON"
}

stage_decode() {
  run "$STAGE_LIMIT_S" "$OUT_DIR/decode.log" "$PYTHON" -m benchmarks.decode --config gpu-1b \
    --batch 1 16 --prefill 512 --decode 128 --json "$OUT_DIR/decode.jsonl"
}

stage_peers() {
  local log="$OUT_DIR/peers.log"
  for mode in ${PEER_MODES:-eager compile}; do
    run "$STAGE_LIMIT_S" "$log" "$PYTHON" -m benchmarks.peers.pytorch --config gpu-1b \
      --mode "$mode" --dtype bfloat16 --device cuda --steps "$STEPS" --python "$PYTHON" \
      --json "$JSON"
  done
}

stage_hf() {
  run "$STAGE_LIMIT_S" "$OUT_DIR/hf.log" "$PYTHON" -m benchmarks.hf_decode --config gpu-1b \
    --batch 1 16 --python "$PYTHON" --json "$OUT_DIR/hf_decode.jsonl"
}

stage_serving() {  # the engine under 16 closed-loop clients, then the same engine one at a time
  local log="$OUT_DIR/serving.log"
  run "$STAGE_LIMIT_S" "$log" "$PYTHON" -m benchmarks.serving --config gpu-1b --systems engine \
    --concurrency 16 --num-requests 64 --checkpoint /tmp/maxnnx-serving-ckpt \
    --json "$OUT_DIR/serving.jsonl"
  run "$STAGE_LIMIT_S" "$log" "$PYTHON" -m benchmarks.serving --config gpu-1b --systems engine \
    --concurrency 1 --num-requests 16 --checkpoint /tmp/maxnnx-serving-ckpt \
    --json "$OUT_DIR/serving.jsonl"
}

stage_quick() {
  stage_env
  TRAIN_IMPLS=auto TRAIN_REMAT=0 stage_train
  PEER_MODES=compile stage_peers
  stage_decode
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env train peers fp8 decode moe serving kernels xlaflags hf)
for stage in "${stages[@]}"; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  "stage_$stage"
done
[ -f "$JSON" ] && "$PYTHON" -m benchmarks.compare "$JSON" 2>&1 | tee "$OUT_DIR/compare.md"
