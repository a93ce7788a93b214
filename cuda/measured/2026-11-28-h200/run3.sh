#!/bin/bash
# Third command: the 7B width again with AdamW fused on the GPU (bench step, as in run.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
R=$OUT/run3
mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheels failed"
mkdir -p /tmp/pkgs && ln -sfn $ROOT/workers /tmp/pkgs/ray_zep_workers
export PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site
timeout 150 python3 -m ray_zep.cli bench step --width 7b --layers 8 --tokens 16384,32768 --batches packed --loss-chunk 4096 --compile --steps 4 --out $R/step_7b_fused > $R/step_7b_fused.log 2>&1
echo "rc=$?"; grep -v INFO $R/step_7b_fused.log | tail -5
cd $OUT && tar czf results3.tgz run3
