#!/bin/bash
# Second device run: the codec's stages, and bench step with the revised memory model.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run2.log"; }
stamp wheels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheels failed"
mkdir -p /tmp/pkgs && ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
export PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
mkdir -p $OUT/r
stamp "codec stages (JIT build first)"
timeout 200 python3 .gpu52/profile_codec.py $OUT/r/codec_stages.json > $OUT/r/codec_stages.log 2>&1
echo "profile rc=$?"; cat $OUT/r/codec_stages.log | tail -45
stamp step
timeout 200 python3 -m ray_zep.cli bench step --tokens 8192,65536 --out $OUT/r/step > $OUT/r/step.log 2>&1
echo "step rc=$?"; grep -v INFO $OUT/r/step.log | tail -10
stamp done
cd $OUT && tar czf results.tgz r && rm -rf r
