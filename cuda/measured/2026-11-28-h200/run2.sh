#!/bin/bash
# Second command: the codec's single-chunk host path after its trim (GPU codec tests,
# codec_profile.py, bench codec); where the 7B step's time goes (step_profile.py); the
# 7B width at 64k tokens, packed and long. Results in $OUT/results2.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
HERE=$ROOT/cuda/measured/2026-11-28-h200
R=$OUT/run2
mkdir -p $R
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/run.log"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheels failed"
mkdir -p /tmp/pkgs && ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
export PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
RZ="python3 -m ray_zep.cli"
stamp "codec gpu tests (the kernel JIT-builds first)"
timeout 100 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_codec_kernels.py > $R/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $R/gpu_tests.log; tail -2 $R/gpu_tests.log
stamp "codec: where a compress call's time goes"
timeout 30 python3 $HERE/codec_profile.py > $R/codec_profile.log 2>&1
echo "rc=$?"; grep -v Warn $R/codec_profile.log | tail -9
stamp codec
timeout 30 $RZ bench codec --device cuda --values 16777216 --codecs zipccl --messages 64,1024,16384,262144 --out $R/codec > $R/codec.log 2>&1
echo "codec rc=$?"; grep "message\|goal" $R/codec.log | tail -6
stamp "step profile: 7B width x 8, 16k packed"
timeout 100 python3 $HERE/step_profile.py > $R/step_profile.log 2>&1
echo "rc=$?"; grep -v "INFO\|USDT" $R/step_profile.log | tail -36
stamp "step: 7B width x 8 at 64k, packed and long"
timeout 150 $RZ bench step --width 7b --layers 8 --tokens 65536 --batches packed,long --loss-chunk 4096 --compile --steps 4 --out $R/step_7b_64k > $R/step_7b_64k.log 2>&1
echo "rc=$?"; grep -v INFO $R/step_7b_64k.log | tail -5
stamp done
cd $OUT && tar czf results2.tgz run2 && cp run2/run.log run2.log && rm -rf run2
