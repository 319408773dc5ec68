set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/megatron_core-*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import megatron.core, torch; print(megatron.core.__version__, torch.__version__, torch.cuda.get_device_name(), torch.backends.cuda.matmul.allow_tf32)"
for r in gpu_plain gpu_recompute gpu_recompute_bf16; do
  timeout 170 python3 -m ttrace_megatron.cli run .gpu/$r.yaml --out /tmp/o_$r --json $OUT/$r.json > $OUT/$r.log 2>&1
  echo "$r rc=$?"; tail -25 $OUT/$r.log
done
TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 timeout 100 python3 -m ttrace_megatron.cli run .gpu/gpu_plain.yaml --out /tmp/o_tf32 > $OUT/tf32.log 2>&1
echo "tf32 rc=$?"; tail -8 $OUT/tf32.log
