#!/bin/bash
# Device run: the GPU tests; one rank's MFU at the 7B width (8 layers, compiled blocks,
# loss in chunks: bench step); the codec (bench codec) and where a compress call's time
# goes (codec_profile.py). Every result lands in $OUT/results.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
HERE=$ROOT/cuda/measured/2026-11-28-h200
R=$OUT/r
mkdir -p $R
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/run.log"; }
stamp env
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys,torch,triton;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__,torch.cuda.get_device_name(0))"
  python3 -c "import flash_attn" 2>&1 | tail -1
  python3 -c "import flash_attn_interface" 2>&1 | tail -1
} > $R/env.txt 2>&1
cat $R/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheels failed"
mkdir -p /tmp/pkgs && ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
export PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
RZ="python3 -m ray_zep.cli"
stamp "gpu tests (the codec kernel JIT-builds first)"
timeout 110 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_merge_kernel.py tests/test_attention_kernels_gpu.py tests/test_codec_kernels.py tests/test_model.py > $R/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $R/gpu_tests.log; tail -4 $R/gpu_tests.log
stamp "codec: where a compress call's time goes"
timeout 40 python3 $HERE/codec_profile.py > $R/codec_profile.log 2>&1
echo "rc=$?"; cat $R/codec_profile.log | tail -30
stamp codec
timeout 40 $RZ bench codec --device cuda --values 134217728 --codecs zipccl,zipccl-torch --messages 64,1024,16384,262144 --out $R/codec > $R/codec.log 2>&1
echo "codec rc=$?"; grep -v INFO $R/codec.log | tail -12
stamp "step: 7B width, 8 layers, compiled blocks, chunked loss"
timeout 220 $RZ bench step --width 7b --layers 8 --tokens 16384,32768 --batches packed --loss-chunk 4096 --compile --steps 4 --out $R/step_7b_fast > $R/step_7b_fast.log 2>&1
echo "rc=$?"; grep -v INFO $R/step_7b_fast.log | tail -6
stamp done
cd $OUT && tar czf results.tgz r && cp r/run.log run.log && rm -rf r
