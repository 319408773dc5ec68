#!/usr/bin/env bash
# Issue #35's costs on a lent GPU machine, in one call of the device tool (benchmarks/README: what
# each part measures). The working tree travels; megatron-core's wheel for that machine's Python
# travels in .whl/ (carry it). Each part writes under $OUT; a part that fails does not stop the next.
#   SMALL=1 bash benchmarks/device/issue35_costs.sh   # a smoke run anywhere, OUT=/tmp/x
set -x
OUT=${OUT:?}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TTRACE_COMMIT=$(git log -1 --format=%h 2>/dev/null)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; free -g; df -h /tmp;
  lscpu | grep 'Model name'; git log -1 --format=%h 2>/dev/null; } > $OUT/machine.txt 2>&1
python3 -c "import megatron.core, torch, xxhash, rich, yaml, safetensors; print(megatron.core.__version__, torch.__version__)" >> $OUT/machine.txt 2>&1 || exit 1
cat $OUT/machine.txt
if [ -n "$SMALL" ]; then dev="--device cpu --small"; wide=""; workers="1 2"; else dev="--repeats 3"; wide="--wide"; workers="1 $(nproc)"; fi
PARTS=${PARTS:-"table record"}
modes=${MODES:-"online recorded"}
# 0. the cost table at the ladder's 50M rung on every core of the host (gloo: one GPU cannot hold
#    the TP2 candidate): the whole check, the recorded iterations, compare on 1 and N workers, the floors
[[ $PARTS == *table* ]] && timeout ${TABLE_S:-360} python3 benchmarks/cost_table.py --cpu --dir /tmp \
  --out $OUT/cost_table.md --json $OUT/cost_table.json > $OUT/cost_table.log 2>&1
echo "cost_table rc=$?"; cat $OUT/cost_table.md
# 1. a recorded iteration from device memory against its write time (TraceWriter)
[[ $PARTS == *record* ]] && timeout ${RECORD_S:-150} python3 benchmarks/gpu_roundoff.py --sections record $dev --workdir /tmp --jsonl $OUT/record.jsonl > $OUT/record.log 2>&1
echo "record rc=$?"; tail -5 $OUT/record.log
# 2. the whole check against plain training at the ladder's 50M rung (gloo on the host's cores:
#    one GPU cannot hold a TP2 candidate), the reference through the page cache and with O_DIRECT
[[ $PARTS == *whole* ]] && timeout 240 python3 benchmarks/online_bytes.py --recipe gpt_tp2_sp $wide --dtypes fp32 --plain --cpu \
  --modes $modes --reference-io page-cache direct --dir /tmp --out $OUT/online_bytes.jsonl > $OUT/online_bytes.log 2>&1
echo "online_bytes rc=$?"; tail -3 $OUT/online_bytes.log
[[ $PARTS == *whole* ]] && python3 -c "
import json
for l in open('$OUT/online_bytes.jsonl'):
    r = json.loads(l); print(r['mode'], r.get('reference_io'), r.get('verdict'), r.get('wall_s'), r.get('seconds') or r.get('timings_s'), r.get('bytes_total'))"
# 3. the costs table: step overhead, recorded iteration, compare throughput on 1 and every core, peak
[[ $PARTS == *costs* ]] && timeout 270 python3 benchmarks/costs.py --no-scale --workers $workers > $OUT/costs.md 2> $OUT/costs.log
echo "costs rc=$?"; cat $OUT/costs.md
