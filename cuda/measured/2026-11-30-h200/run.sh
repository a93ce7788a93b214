#!/bin/bash
# Device run (sixth series): the present tree on one GPU. The GPU tests (the codec kernel
# JIT-builds first); the codec (bench codec); one rank's step at the 7B width on torch's own
# flash kernels (FA2) at 4k tokens, the per-GPU load of `bench scale`'s rows, and at 16k;
# the ring step against the kernel alone (bench calibrate) in the time left. Pure-Python
# wheels the image lacks (omegaconf, ortools, protobuf, immutabledict) travel in .whl/.
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
left() { echo $(( ${BUDGET:-500} - ($(date +%s) - T0) )); }
stamp env
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nvcc --version | tail -2
  python3 -c "import sys,torch,triton;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__,torch.cuda.get_device_name(0))"
} > $R/env.txt 2>&1
cat $R/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $R/wheels.log 2>&1 || echo "wheels failed"
mkdir -p /tmp/pkgs && ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
export PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
RZ="python3 -m ray_zep.cli"
stamp "gpu tests"
timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_merge_kernel.py tests/test_attention_kernels_gpu.py tests/test_codec_kernels.py tests/test_model.py > $R/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $R/gpu_tests.log; tail -6 $R/gpu_tests.log
stamp codec
timeout 50 $RZ bench codec --device cuda --values 134217728 --codecs zipccl,zipccl-torch --messages 64,1024,16384,262144 --out $R/codec > $R/codec.log 2>&1
echo "codec rc=$?"; grep -v INFO $R/codec.log | tail -14
stamp "step: 7B width, 8 layers, compiled blocks, loss in chunks of 4,096 (FA2)"
RAY_ZEP_FLASH_IMPL=fa2 timeout 170 $RZ bench step --width 7b --layers 8 --tokens 4096,16384 --batches packed,long --loss-chunk 4096 --compile --steps 5 --out $R/step_7b > $R/step_7b.log 2>&1
echo "step rc=$?"; grep -v INFO $R/step_7b.log | tail -12
T=$(left); stamp "calibrate, ${T}s left"
[ $T -gt 40 ] && RAY_ZEP_FLASH_IMPL=fa2 timeout $T $RZ bench calibrate model.preset=7b model.n_kv_heads=8 model.n_layers=4 --out $R/calibrate > $R/calibrate.log 2>&1
echo "calibrate rc=$?"; sed -n '/ring step against/,/^fit/p' $R/calibrate.log | head -40
stamp done
