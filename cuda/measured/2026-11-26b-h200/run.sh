#!/bin/bash
# Device run: GPU tests, codec, attention calibration, one-rank bf16 training steps.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }
stamp env
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,temperature.gpu,power.limit --format=csv
  nvcc --version | tail -2
  python3 -c "import torch,sys;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,torch.cuda.get_device_name(0),torch.cuda.get_device_capability(0))"
  python3 -c "import flash_attn" 2>&1 | tail -1
  git -C $ROOT log -1 --format=%H 2>/dev/null
} > $OUT/env.txt 2>&1
cat $OUT/env.txt
stamp wheels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> $OUT/run.log 2>&1 || echo "wheels failed"
mkdir -p /tmp/pkgs && ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
export PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
RZ="python3 -m ray_zep.cli"
stamp "build + gpu tests"
timeout 240 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_codec_kernels.py tests/test_attention_kernels_gpu.py tests/test_model.py > $OUT/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $OUT/gpu_tests.log
tail -8 $OUT/gpu_tests.log
stamp codec
timeout 150 $RZ bench codec --device cuda --values 134217728 --codecs zipccl,zipccl-torch --messages 64,1024,4096,16384,65536,262144 --out $OUT/codec > $OUT/codec.log 2>&1
echo "codec rc=$?"; tail -22 $OUT/codec.log
stamp calibrate
timeout 200 $RZ bench calibrate model.preset=7b model.n_kv_heads=8 model.n_layers=4 --out $OUT/calibrate > $OUT/calibrate.log 2>&1
echo "calibrate rc=$?"; grep -v INFO $OUT/calibrate.log | tail -45
stamp step
timeout 240 $RZ bench step --out $OUT/step > $OUT/step.log 2>&1
echo "step rc=$?"; grep -v INFO $OUT/step.log | tail -16
stamp done
