#!/bin/bash
# Device run (seventh series): blocks whose RMSNorm and SwiGLU keep only their inputs
# (ray_zep.lean_ops) on one GPU. The GPU tests (lean ops on CUDA among them: values, and
# the bytes a 7B-width block keeps per token against the memory model); one rank's step at
# the 7B width (8 layers, compiled blocks, FA2), 4k and 16k tokens, with this tree and,
# side by side in the same lease, with the tree before lean ops (.prev: `git archive` of
# the commit before them), so that their cost in time and their saving in memory are
# measured on the same machine. Pure-Python wheels the image lacks travel in .whl/.
# Results land in $OUT/results.tgz (a command returns at most 8 files).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
R=$OUT/r
mkdir -p $R
trap 'tar czf $OUT/results.tgz -C $OUT r && rm -rf $R' EXIT
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/run.log"; }
left() { echo $(( ${BUDGET:-470} - ($(date +%s) - T0) )); }
stamp env
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nvcc --version | tail -2
  python3 -c "import sys,torch,triton;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__,torch.cuda.get_device_name(0))"
} > $R/env.txt 2>&1
cat $R/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $R/wheels.log 2>&1 || echo "wheels failed"
mkdir -p /tmp/pkgs /tmp/pkgs_prev
ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
ln -sfn $ROOT/.prev/workers /tmp/pkgs_prev/ray_zep_workers
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
STEP="bench step --width 7b --layers 8 --tokens 4096,16384 --batches packed,long --loss-chunk 4096 --compile --steps 5"
stamp "gpu tests"
PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site timeout 130 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_lean_ops.py tests/test_merge_kernel.py tests/test_attention_kernels_gpu.py tests/test_codec_kernels.py tests/test_model.py > $R/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $R/gpu_tests.log; grep -E "FAIL|Error|assert|passed|failed" $R/gpu_tests.log | tail -12
stamp "step, lean ops (this tree)"
PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site RAY_ZEP_FLASH_IMPL=fa2 timeout 170 python3 -m ray_zep.cli $STEP --out $R/step_lean > $R/step_lean.log 2>&1
echo "step rc=$?"; grep -v INFO $R/step_lean.log | tail -9
T=$(left); stamp "step, plain ops (.prev), ${T}s left"
[ $T -gt 60 ] && (cd .prev && PYTHONPATH=$ROOT/.prev:/tmp/pkgs_prev:/tmp/site RAY_ZEP_FLASH_IMPL=fa2 timeout $T python3 -m ray_zep.cli $STEP --out $R/step_plain > $R/step_plain.log 2>&1)
echo "step rc=$?"; grep -v INFO $R/step_plain.log | tail -9
stamp done
