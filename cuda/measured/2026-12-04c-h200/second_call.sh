#!/bin/bash
# The second call of the lease (the machine still warm): the first call's `bench step`
# ran its eight cases to the script's limit and printed nothing (its table came at the end;
# `bench step` now prints each case as it ends). This call played the long batch in all
# four modes and the packed batch in two, each as its own `bench step`.
export OUT; R=$OUT/r; mkdir -p $R
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
mkdir -p /tmp/pkgs; ln -sfn $PWD/workers /tmp/pkgs/ray_zep_workers
export RAY_ZEP_FLASH_IMPL=fa2 PYTHONPATH=$PWD:/tmp/pkgs:/tmp/site
S="bench step --width 7b --layers 8 --tokens 16384 --loss-chunk 4096 --steps 5"
date
timeout 200 python3 -m ray_zep.cli $S --batches long --checkpointing none,selective,linears,full --out $R/eager_modes_long > $R/eager_modes_long.log 2>&1
echo rc=$?; date; grep "^|" $R/eager_modes_long.log
timeout 110 python3 -m ray_zep.cli $S --batches packed --checkpointing none,selective --out $R/eager_modes_packed > $R/eager_modes_packed.log 2>&1
echo rc=$?; date; grep "^|" $R/eager_modes_packed.log
