#!/bin/bash
# Device run (eighth series), one command in one lease:
# 1. the GPU tests on this tree (one cast per norm, the compiled planner beside them);
# 2. one rank's eager step at the 7B width, 8 layers, 16k tokens, with this tree (a norm's
#    output cast once for all its projections) and, side by side, with the tree before that
#    change (.prev: `git archive` of the commit before it; ray_zep, workers, conf);
# 3. plan_step on this machine's processor (the compiled planner; its kernels compile here
#    first), 1,024 and 4,096 GPUs, bench scale's eight 4k rows.
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
left() { echo $(( ${BUDGET:-440} - ($(date +%s) - T0) )); }
stamp env
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)|MHz"
  python3 -c "import sys,torch,triton,numpy,numba;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__,'numpy',numpy.__version__,'numba',numba.__version__,torch.cuda.get_device_name(0))"
} > $R/env.txt 2>&1
cat $R/env.txt
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/wheels.log 2>&1 || echo "wheels failed"
PYTHONPATH=/tmp/site python3 -c "import omegaconf,ortools;print('omegaconf',omegaconf.__version__,'ortools',ortools.__version__)" 2>&1 | tee -a $R/env.txt
mkdir -p /tmp/pkgs /tmp/pkgs_prev
ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
ln -sfn $ROOT/.prev/workers /tmp/pkgs_prev/ray_zep_workers
export RAY_ZEP_FLASH_IMPL=fa2
stamp "gpu tests"
[ -z "$SKIP_TESTS" ] && PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site timeout 140 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_lean_ops.py tests/test_merge_kernel.py tests/test_attention_kernels_gpu.py tests/test_codec_kernels.py tests/test_model.py > $R/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $R/gpu_tests.log; grep -E "FAIL|Error|assert|passed|failed" $R/gpu_tests.log | tail -12
S="bench step --width 7b --layers 8 --tokens 16384 --batches packed,long --loss-chunk 4096 --steps 5"
stamp "eager step, one cast per norm (this tree)"
PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site timeout 110 python3 -m ray_zep.cli $S --out $R/eager_one_cast > $R/eager_one_cast.log 2>&1
echo "rc=$?"; grep -v INFO $R/eager_one_cast.log | grep "^|"
T=$(left); stamp "eager step, a cast per projection (.prev), ${T}s left"
[ $T -gt 150 ] && (cd .prev && PYTHONPATH=$ROOT/.prev:/tmp/pkgs_prev:/tmp/site timeout 110 python3 -m ray_zep.cli $S --out $R/eager_per_projection > $R/eager_per_projection.log 2>&1; echo "rc=$?")
grep -v INFO $R/eager_per_projection.log | grep "^|"
PS=cuda/measured/2026-12-04-cpu-compiled-planner/plan_step_times.py
ROWS=cuda/measured/2026-12-04-cpu-scale-one-cast
stamp "the planner's first plan_step in a fresh process, twice (kernels compile, then load)"
FP=cuda/measured/2026-12-04b-h200/first_plan.py
for i in 1 2; do PYTHONPATH=$ROOT:/tmp/site timeout 120 python3 $FP 1024 >> $R/first_plan.txt 2>&1; echo "rc=$?"; done; tail -4 $R/first_plan.txt
T=$(left); stamp "plan_step 1,024 GPUs, ${T}s left"
[ $T -gt 20 ] && PYTHONPATH=$ROOT:/tmp/site timeout $T python3 $PS 1024 7 $ROWS/model_4k_1024.json > $R/plan_step_1024.txt 2>&1; echo "rc=$?"; tail -10 $R/plan_step_1024.txt
T=$(left); stamp "plan_step 4,096 GPUs, ${T}s left"
[ $T -gt 20 ] && PYTHONPATH=$ROOT:/tmp/site timeout $T python3 $PS 4096 5 $ROWS/model_4k_4096.json > $R/plan_step_4096.txt 2>&1; echo "rc=$?"; tail -10 $R/plan_step_4096.txt
stamp done
