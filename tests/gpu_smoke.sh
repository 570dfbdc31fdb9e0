#!/usr/bin/env bash
# GPU smoke run of the real entry point on the tiny model: ZeRO-2, bf16, nccl, N GPUs (default 2).
# Usage (repo root, on a CUDA host with the project installed or a wheelhouse on PYTHONPATH):
#   OUT=/tmp/smoke bash tests/gpu_smoke.sh [NUM_GPUS]
set -euo pipefail
n=${1:-2}
out=${OUT:-/tmp/gpu_smoke}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} HF_HUB_OFFLINE=1
python - <<'PY' 2>&1 | tee "$out/versions.txt"
import importlib
for m in ("torch", "torchvision", "transformers", "tokenizers", "peft", "diffusers", "deepspeed", "datasets",
          "pyarrow", "tensorboard", "safetensors"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # report every missing package, not just the first
        print(m, "MISSING", type(e).__name__, e)
import torch
print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
python -m train.make_tiny --out "$out/tiny" > "$out/make_tiny.log" 2>&1
cfg=ds_configs/zero2.json
if ! python -c "import tensorboard" 2>/dev/null; then
  python - "$out/zero2_notb.json" <<'PY'
import json, sys
c = json.load(open("ds_configs/zero2.json")); c["qwen_edit"]["output"]["tensorboard"] = False
json.dump(c, open(sys.argv[1], "w"))
PY
  cfg=$out/zero2_notb.json
fi
start=$(date +%s)
deepspeed --num_gpus "$n" train/main.py --ds_config "$cfg" --model "$out/tiny/model" --data "$out/tiny/data" \
  --output_dir "$out/run" --max_steps 20 > "$out/train.log" 2>&1 || { tail -60 "$out/train.log"; exit 1; }
echo "train wall $(( $(date +%s) - start )) s"
tail -3 "$out/run/metrics.jsonl"
cat "$out/run/summary.json"
