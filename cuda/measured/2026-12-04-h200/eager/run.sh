#!/bin/bash
# Device run, second call of the same lease: one rank's step at the 7B width, 8 layers,
# 16k tokens, eager (no torch.compile), with this tree and with the tree before lean ops
# (.prev), side by side. Wheels as in ../run.sh.
export PYTHONUNBUFFERED=1 RAY_ZEP_FLASH_IMPL=fa2
R=$OUT/r2; mkdir -p $R; trap 'tar czf $OUT/results2.tgz -C $OUT r2' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
ROOT=$PWD
S="bench step --width 7b --layers 8 --tokens 16384 --batches packed,long --loss-chunk 4096 --steps 5"
echo "== eager lean"
PYTHONPATH=$ROOT:/tmp/site timeout 110 python3 -m ray_zep.cli $S --out $R/eager_lean > $R/eager_lean.log 2>&1
echo rc=$?; grep -v INFO $R/eager_lean.log | grep "^|"
echo "== eager plain"
(cd .prev && PYTHONPATH=$ROOT/.prev:/tmp/site timeout 110 python3 -m ray_zep.cli $S --out $R/eager_plain > $R/eager_plain.log 2>&1; echo rc=$?)
grep -v INFO $R/eager_plain.log | grep "^|"
