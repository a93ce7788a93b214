#!/bin/bash
# Device run (ninth series), one command in one lease:
# 1. the GPU tests on this tree;
# 2. one rank's eager step at the 7B width, 8 layers, 16k tokens, packed and long batches,
#    with each activation checkpointing mode on every block (`bench step --checkpointing`):
#    the measured step and its cost over `none`, beside the simulator's step and its
#    recomputation at the H200 preset's rates;
# 3. if time is left, the same compiled (`--compile`), none and selective, long batches.
# Pure-Python wheels and ortools, which the image lacks, travel in .whl/.
# Results land in $OUT/results.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
R=$OUT/r
mkdir -p $R
trap 'tar czf $OUT/results.tgz -C $OUT r && rm -rf $R' EXIT
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/run.log"; }
left() { echo $(( ${BUDGET:-480} - ($(date +%s) - T0) )); }
stamp env
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import sys,torch,triton,numpy,numba;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__,'numpy',numpy.__version__,'numba',numba.__version__,torch.cuda.get_device_name(0))"
} > $R/env.txt 2>&1
cat $R/env.txt
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/wheels.log 2>&1 || echo "wheels failed"
PYTHONPATH=/tmp/site python3 -c "import omegaconf,ortools;print('omegaconf',omegaconf.__version__,'ortools',ortools.__version__)" 2>&1 | tee -a $R/env.txt
mkdir -p /tmp/pkgs
ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
export RAY_ZEP_FLASH_IMPL=fa2
P=$ROOT:/tmp/pkgs:/tmp/site
stamp "gpu tests"
[ -z "$SKIP_TESTS" ] && PYTHONPATH=$P timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_lean_ops.py tests/test_merge_kernel.py tests/test_attention_kernels_gpu.py tests/test_codec_kernels.py tests/test_model.py > $R/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $R/gpu_tests.log; grep -E "FAIL|Error|assert|passed|failed" $R/gpu_tests.log | tail -12
S="bench step --width 7b --layers 8 --tokens 16384 --loss-chunk 4096 --steps 5"
T=$(left); stamp "eager step, four checkpointing modes, ${T}s left"
PYTHONPATH=$P timeout $(( T - 20 )) python3 -m ray_zep.cli $S --batches packed,long --checkpointing none,selective,linears,full --out $R/eager_modes > $R/eager_modes.log 2>&1
echo "rc=$?"; grep -v INFO $R/eager_modes.log | grep "^|"
T=$(left); stamp "compiled step, none and selective, ${T}s left"
[ $T -gt 130 ] && PYTHONPATH=$P timeout $(( T - 10 )) python3 -m ray_zep.cli $S --batches long --compile --checkpointing none,selective --out $R/compiled_modes > $R/compiled_modes.log 2>&1
echo "rc=$?"; grep -v INFO $R/compiled_modes.log | grep "^|"
stamp done
