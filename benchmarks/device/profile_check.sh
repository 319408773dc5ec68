#!/usr/bin/env bash
# Where a check's processes spend their time at the scale ladder's 50M rung (gpt_tp2_sp, fp32), on a
# many-core host: py-spy samples every process of `ttrace run --reference-in memory` (the reference,
# then the candidate's ranks judging online). The working tree travels; megatron-core's and py-spy's
# wheels for that machine's Python travel in .whl/ (carry it). At e9dbf77 it also took --judge-threads
# (23979f8's judging threads, reverted: benchmarks/results/history/issue35_costs.md).
#   OUT=/tmp/x RECIPE_WIDE=0 bash benchmarks/device/profile_check.sh   # a smoke run anywhere
OUT=${OUT:?}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=
python3 -c "import sys, yaml; sys.path.insert(0, 'benchmarks'); from margins import recipe; \
yaml.safe_dump(recipe('gpt_tp2_sp', 'fp32', 1, bool(int('${RECIPE_WIDE:-1}'))).to_json(), open('/tmp/rung.yaml', 'w'))" || exit 1
timeout ${PROFILE_S:-100} py-spy record --subprocesses -r ${RATE:-50} -f raw -o $OUT/held.txt -- \
  python3 -m ttrace_megatron.cli run /tmp/rung.yaml --cpu --reference-in memory \
  --out /tmp/profiled --json $OUT/report.json --quiet > $OUT/run.log 2>&1
echo "rc=$?"
python3 -c "import json; r = json.load(open('$OUT/report.json')); print(r['verdict'], r.get('timings_s'))"
rm -rf /tmp/profiled; gzip -f $OUT/held.txt
