#!/bin/bash
# Device run: GPU tests; the ring step against the kernel alone (bench calibrate); one rank's
# MFU (bench step, 3B and 7B widths, eager and with the compiled blocks and chunked loss);
# the codec (bench codec). Every result lands in $OUT/results.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
R=$OUT/r
mkdir -p $R
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/run.log"; }
stamp env
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nvcc --version | tail -2
  python3 -c "import sys,torch,triton;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__,torch.cuda.get_device_name(0),torch.cuda.get_device_capability(0))"
  python3 -c "import torch.nn.attention as a;print('flash impls:',getattr(a,'list_flash_attention_impls',lambda:'no switch')())"
  python3 -c "import flash_attn" 2>&1 | tail -1
  python3 -c "import flash_attn_interface" 2>&1 | tail -1
} > $R/env.txt 2>&1
cat $R/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheels failed"
mkdir -p /tmp/pkgs && ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
export PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
RZ="python3 -m ray_zep.cli"
stamp "install: the package builds with no compiler (no network here: its dependencies are the image's)"
python3 -m pip install --no-index --no-deps --no-build-isolation --target /tmp/inst . > $R/install.log 2>&1
echo "install rc=$?" | tee -a $R/install.log
stamp "gpu tests (the codec kernel JIT-builds first)"
timeout 110 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_merge_kernel.py tests/test_attention_kernels_gpu.py tests/test_codec_kernels.py tests/test_model.py ${GPU_TESTS_EXTRA} > $R/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $R/gpu_tests.log; tail -6 $R/gpu_tests.log
stamp calibrate
timeout 75 $RZ bench calibrate model.preset=7b model.n_kv_heads=8 model.n_layers=4 --out $R/calibrate > $R/calibrate.log 2>&1
echo "calibrate rc=$?"; sed -n '/ring step against/,/^fit/p' $R/calibrate.log | head -50
stamp "step: 3B width eager, whole-batch loss"
timeout 45 $RZ bench step --width 3b --tokens 65536 --loss-chunk 0 --steps 5 --out $R/step_3b_eager > $R/step_3b_eager.log 2>&1
echo "rc=$?"; grep -v INFO $R/step_3b_eager.log | tail -5
stamp "step: 3B width, compiled blocks, chunked loss"
timeout 70 $RZ bench step --width 3b --tokens 16384,65536 --loss-chunk 4096 --compile --steps 5 --out $R/step_3b_fast > $R/step_3b_fast.log 2>&1
echo "rc=$?"; grep -v INFO $R/step_3b_fast.log | tail -7
stamp "step: 7B width, 8 layers, compiled blocks, chunked loss"
timeout 45 $RZ bench step --width 7b --layers 8 --tokens 16384,32768 --batches packed --loss-chunk 4096 --compile --steps 5 --out $R/step_7b_fast > $R/step_7b_fast.log 2>&1
echo "rc=$?"; grep -v INFO $R/step_7b_fast.log | tail -5
stamp codec
timeout 40 $RZ bench codec --device cuda --values 134217728 --codecs zipccl,zipccl-torch --messages 64,1024,4096,16384,65536,262144 --out $R/codec > $R/codec.log 2>&1
echo "codec rc=$?"; grep -v INFO $R/codec.log | tail -16
stamp done
cd $OUT && tar czf results.tgz r && cp r/run.log run.log && rm -rf r
