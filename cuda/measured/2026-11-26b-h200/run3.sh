#!/bin/bash
# Third device run: the vectorised codec kernels: GPU tests, bench codec, stages.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run3.log"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheels failed"
export PYTHONPATH=$ROOT:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
mkdir -p $OUT/r
stamp "build + codec gpu tests"
timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_codec_kernels.py > $OUT/r/gpu_tests_codec.log 2>&1
echo "pytest rc=$?" >> $OUT/r/gpu_tests_codec.log; tail -4 $OUT/r/gpu_tests_codec.log
stamp codec
timeout 120 python3 -m ray_zep.cli bench codec --device cuda --values 134217728 --codecs zipccl,zipccl-torch --messages 64,1024,4096,16384,65536,262144 --out $OUT/r/codec > $OUT/r/codec.log 2>&1
echo "codec rc=$?"; grep -v INFO $OUT/r/codec.log | tail -14
stamp stages
timeout 60 python3 .gpu52/profile_codec.py $OUT/r/codec_stages.json > $OUT/r/codec_stages.log 2>&1
echo "profile rc=$?"; grep -E "tables|encode|decode|compress" $OUT/r/codec_stages.log
stamp done
cd $OUT && tar czf results.tgz r && rm -rf r
