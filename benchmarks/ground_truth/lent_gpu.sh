#!/usr/bin/env bash
# One prepared run on a lent GPU machine (the device tool), from the repository root: the ground-truth matrix,
# the CUDA fixtures and the fast tests under that machine's torch and transformers, all at once, each within
# its own time limit, everything packed into $OUT (the tool brings back at most 8 files of 16 MiB).
#
#     bash benchmarks/ground_truth/lent_gpu.sh [DEADLINE_S]
#
# DEADLINE_S (default 330): no ground-truth case starts after it; the whole run ends about 100 s later.
set -u
deadline=${1:-330}
out=${OUT:-/tmp/lent_gpu}
mkdir -p "$out" /tmp/gt/data /tmp/gt/fixtures
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"
} >"$out/environment.txt" 2>&1

timeout $((deadline + 60)) python3 -m benchmarks.ground_truth.record_fixtures --out /tmp/gt/fixtures \
    >/tmp/gt/fixtures.log 2>&1 &
fixtures=$!
timeout $((deadline + 60)) python3 -m pytest -m "not slow" -q -n 4 -p no:cacheprovider \
    --ignore=tests/test_cuda_fixtures.py >/tmp/gt/pytest.log 2>&1 &
tests=$!
timeout $((deadline + 90)) python3 -m benchmarks.ground_truth.collect --matrix full --jobs 6 \
    --deadline-s "$deadline" --out /tmp/gt/data >/tmp/gt/collect.log 2>&1
wait $fixtures $tests

cp /tmp/gt/*.log "$out/"
tar -C /tmp/gt -cf - data fixtures | xz -T0 -6 >/tmp/gt/measured.tar.xz
split -b 15M -d /tmp/gt/measured.tar.xz "$out/measured.tar.xz.part"
ls -la "$out"
tail -3 "$out/collect.log" "$out/fixtures.log" "$out/pytest.log"
