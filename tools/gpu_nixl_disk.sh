#!/bin/bash
# The NIXL transport and the disk tier on two GPUs (no network), in order of need: the NIXL
# and NCCL reshard tests on two GPUs, the disk tier's GPU tests, then the reshard benchmark
# (both transports, nb 64 then 8), the disk benchmark and the aliasing checks' GPU tests,
# each cut to the time left.
# Logs go straight to $OUT (at most 8 files come back), so what finished comes back even if the
# run is cut; the benchmarks' CSV and PNG files come in results.tgz at the end.
# Carry the slimmed NIXL wheel as .whl/nixl/ (python3 ../shared/tools/slim_wheel.py ... --drop
# nixl_ep_cu13) and run from the repository root:  BUDGET=SECONDS bash tools/gpu_nixl_disk.sh
export PYTHONUNBUFFERED=1
T0=$SECONDS; BUDGET=${BUDGET:-240}
step() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $OUT/steps.txt; }
left() { local s=$(( BUDGET - (SECONDS - T0) )); [ $s -lt $1 ] && echo $(( s > 5 ? s : 5 )) || echo $1; }
( python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nixl-site .whl/nixl/nixl_cu13-1.5.1-cp312-*.whl > /tmp/nixl.log 2>&1; step install-nixl $? ) &
( CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1; step build $? ) &
wait
export PYTHONPATH=/tmp/nixl-site
{ nvidia-smi -L; python3 -c "import torch, nixl_cu13, kvbm_ext; print(torch.__version__, kvbm_ext.build_info())"; df -h /tmp | tail -1; } >> $OUT/steps.txt 2>&1
timeout $(left 170) python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_reshard_nixl.py tests/test_reshard.py > $OUT/tests-reshard.log 2>&1
step tests-reshard $?; tail -2 $OUT/tests-reshard.log
timeout $(left 60) python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_disk_gpu.py > $OUT/tests-disk.log 2>&1
step tests-disk $?; tail -2 $OUT/tests-disk.log
timeout $(left 80) python3 benchmarks/reshard.py --device cuda --nb 64,8 --calls 5 --repeats 3 --fragment-calls 1 --out /tmp/rs > $OUT/bench-reshard.log 2>&1
step bench-reshard $?; sed -n '/^targets/,$p' $OUT/bench-reshard.log | grep -v "^log:\|^CSV" | head -30
timeout $(left 120) python3 benchmarks/disk.py --blocks ${DISK_BLOCKS:-64,512} --reps 2 --gemms 50 --out /tmp/dk > $OUT/bench-disk.log 2>&1
step bench-disk $?; grep -E "PASS|MISS|^store|^load" $OUT/bench-disk.log | head -12
rm -f /tmp/kvbm-disk-bench-*
# The aliasing and moved-storage checks of every writing path, in the GPU build.
timeout $(left 90) python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_cache_sharing.py tests/test_paged_aliasing.py tests/test_paged_resize.py > $OUT/tests-aliasing.log 2>&1
step tests-aliasing $?; tail -2 $OUT/tests-aliasing.log
tar czf $OUT/results.tgz -C /tmp rs dk 2>/dev/null
