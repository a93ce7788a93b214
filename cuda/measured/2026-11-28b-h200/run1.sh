#!/bin/bash
# Device run, first command: the GPU tests and one rank's step at the 7B width (8 layers,
# compiled blocks, loss in chunks of 4,096) on torch's own flash kernels (FA2), 16k-64k
# tokens, packed and long. The first part of the FlashAttention-4 libraries travels with it
# (.gpa/) and stays on the machine for the second command. Results land in $OUT/r1.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
R=$OUT/r1
mkdir -p $R
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/run.log"; }
stamp env
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys,torch,triton;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__,torch.cuda.get_device_name(0))"
  python3 -m pip list 2>/dev/null | grep -i -E "^(cuda-bindings|cuda-python|einops|protobuf|typing.extensions) "
} > $R/env.txt 2>&1
cat $R/env.txt
mkdir -p /tmp/site /tmp/pkgs
for w in .gpa/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
export PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site
RZ="python3 -m ray_zep.cli"
stamp "gpu tests (FA2)"
timeout 90 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_merge_kernel.py tests/test_attention_kernels_gpu.py tests/test_model.py > $R/gpu_tests_fa2.log 2>&1
echo "pytest rc=$?" >> $R/gpu_tests_fa2.log; tail -3 $R/gpu_tests_fa2.log
stamp "step (FA2): 7B width, 8 layers, compiled, chunked loss"
RAY_ZEP_FLASH_IMPL=fa2 timeout 170 $RZ bench step --width 7b --layers 8 --tokens 16384,32768,65536 --batches packed,long --loss-chunk 4096 --compile --steps 4 --out $R/step_7b_fa2 > $R/step_7b_fa2.log 2>&1
echo "rc=$?"; grep -v INFO $R/step_7b_fa2.log | tail -12
stamp done
ls -la .gpa
