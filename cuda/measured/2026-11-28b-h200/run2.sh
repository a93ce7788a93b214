#!/bin/bash
# Device run, second command on the same machine: FlashAttention-4 (flash-attn-4 on the CuTe
# DSL, no compiler at install) assembled from the two parts of its libraries, routed through
# torch's flash ops (RAY_ZEP_FLASH_IMPL=fa4): parity and rates against FA2 (fa4_check.py),
# the GPU tests on it, one rank's step (as run1.sh) and the ring step against the kernel
# alone (bench calibrate). Results land in $OUT/r2.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?}
ROOT=$PWD
HERE=$ROOT/cuda/measured/2026-11-28b-h200
R=$OUT/r2
mkdir -p $R
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/run.log"; }
left() { echo $(( ${BUDGET:-480} - ($(date +%s) - T0) )); }
[ -f /tmp/parts/cu13.tar.xz.a ] && [ -d /tmp/site ] || { echo "first command's files are gone (a fresh machine)"; exit 3; }
stamp assemble
mkdir -p /tmp/fa4
cat /tmp/parts/cu13.tar.xz.a .gpb/cu13.tar.xz.b | xz -d | tar x -C /tmp/fa4 || { echo "assembly failed"; exit 4; }
for w in .gpb/*.whl; do python3 -m zipfile -e "$w" /tmp/fa4; done
# torch 2.11's FA4 glue takes two values from _flash_attn_fwd; flash-attn-4 4.0.0b36 returns five
printf '\n_fwd_all = _flash_attn_fwd\n\n\ndef _flash_attn_fwd(*args, **kwargs):\n    return _fwd_all(*args, **kwargs)[:2]\n\n\n_flash_attn_fwd.compile_cache = _fwd_all.compile_cache\n' >> /tmp/fa4/flash_attn/cute/interface.py
export PYTHONPATH=$ROOT:/tmp/pkgs:/tmp/site:/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages
RZ="python3 -m ray_zep.cli"
python3 -c "import flash_attn.cute.interface as m; print('flash_attn.cute.interface', m.__file__)" 2>&1 | tail -3 | tee $R/import.log
stamp "fa4_check: parity and rates, FA4 against FA2"
timeout 150 python3 $HERE/fa4_check.py > $R/fa4_check.log 2>&1
rc=$?; echo "rc=$rc" >> $R/fa4_check.log; tail -40 $R/fa4_check.log
grep -q "^parity" $R/fa4_check.log || { stamp "FA4 did not run: stop"; exit 5; }
stamp "gpu tests (FA4)"
RAY_ZEP_FLASH_IMPL=fa4 timeout 110 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_attention_kernels_gpu.py tests/test_merge_kernel.py tests/test_model.py > $R/gpu_tests_fa4.log 2>&1
echo "pytest rc=$?" >> $R/gpu_tests_fa4.log; tail -8 $R/gpu_tests_fa4.log
stamp "step (FA4)"
RAY_ZEP_FLASH_IMPL=fa4 timeout 200 $RZ bench step --width 7b --layers 8 --tokens 16384,65536 --batches packed,long --loss-chunk 4096 --compile --steps 4 --out $R/step_7b_fa4 > $R/step_7b_fa4.log 2>&1
echo "rc=$?"; grep -v INFO $R/step_7b_fa4.log | tail -12
T=$(left); stamp "calibrate (FA4), ${T}s left"
[ $T -gt 40 ] && RAY_ZEP_FLASH_IMPL=fa4 timeout $T $RZ bench calibrate model.preset=7b model.n_kv_heads=8 model.n_layers=4 --out $R/calibrate_fa4 > $R/calibrate_fa4.log 2>&1
echo "calibrate rc=$?"; sed -n '/ring step against/,/^fit/p' $R/calibrate_fa4.log | head -40
stamp done
