#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheels failed"
export PYTHONPATH=$ROOT:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
git log -1 --format=%H > $OUT/head.txt 2>/dev/null
timeout 200 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_codec_kernels.py tests/test_attention_kernels_gpu.py tests/test_model.py > $OUT/gpu_tests_head.log 2>&1
echo "pytest rc=$?" >> $OUT/gpu_tests_head.log; tail -4 $OUT/gpu_tests_head.log
timeout 120 python3 .gpu52/exp/exp.py $OUT/tables_variants.json > $OUT/tables_variants.log 2>&1
echo "exp rc=$?"; tail -8 $OUT/tables_variants.log
