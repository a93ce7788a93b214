#!/bin/bash
# Device run, third command on the same machine (run1.sh's step on FA2 ran past its time slot):
# one rank's step on FA2 at 16k and 64k packed, as run2.sh's on FA4. Needs /tmp/site from run1.sh.
export PYTHONPATH=$PWD:/tmp/pkgs:/tmp/site PYTHONUNBUFFERED=1
RAY_ZEP_FLASH_IMPL=fa2 timeout 140 python3 -m ray_zep.cli bench step --width 7b --layers 8 --tokens 16384,65536 --batches packed --loss-chunk 4096 --compile --steps 4 --out $OUT/step_7b_fa2 2>&1 | grep -v INFO | tail -8
