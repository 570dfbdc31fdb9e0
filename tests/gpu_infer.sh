#!/usr/bin/env bash
# Placement benchmark of train.infer: full-size architectures at random init (no weights needed), one GPU, one run
# per memory budget (qwen_edit.memory.budget_gb in a --config; a budget below the card caps the process), each
# rendering ROWS rows of the dataset make_tiny builds (2509: two 1 MP references each) with STEPS denoising steps.
# Per budget it prints the plan's line and keeps OUT/infer_<budget>.log and OUT/infer_summary_<budget>.json:
# seconds_per_image (the first includes the warm-up; with cpu_offload "blocks" the encoders ran before, and the log's
# "encode" progress line has their time per row) and peak_memory_gb (torch's max allocated).
# docs/benchmarks.md says what it measures; docs/performance.md has the current figures.
# Usage (repo root, on a CUDA host with the project installed or a wheelhouse on PYTHONPATH):
#   OUT=/tmp/infer BUDGETS="141 24 64 48 16" STEPS=4 bash tests/gpu_infer.sh
# SET='"cpu_offload": "model"' adds keys to each run's qwen_edit.inference section (to compare a placement).
set -euo pipefail
out=${OUT:-/tmp/gpu_infer}
variant=${VARIANT:-edit_plus}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} HF_HUB_OFFLINE=1 QWEN_EDIT_RANDOM_INIT=1
data=${DATA:-/tmp/gpu_memory_data_$variant}  # the memory benchmark's directory, when it is there
if [ ! -f "$data/model/model_index.json" ]; then
  python -m train.make_tiny --out "$data" --variant "$variant" --size 1024 --num_samples 24 --full_size_configs \
    > "$out/make_tiny_$variant.log" 2>&1
fi
python - "$data" "$out/edits.jsonl" "${ROWS:-2}" <<'PY'
import json, sys
data, path, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(path, "w") as f:
    for line in [line for line in open(f"{data}/data/metadata.jsonl") if line.strip()][:rows]:
        row = json.loads(line)
        refs = row.get("edit_image", [])
        refs = [f"{data}/data/{r}" for r in ([refs] if isinstance(refs, str) else refs)]
        f.write(json.dumps({**({"edit_image": refs} if refs else {}), "prompt": row["prompt"]}) + "\n")
PY
for budget in ${BUDGETS:-141 24}; do
  cfg=$out/infer_$budget.json
  echo "{\"qwen_edit\": {\"memory\": {\"budget_gb\": $budget}, \"inference\": {\"num_inference_steps\": ${STEPS:-4}${SET:+, $SET}}}}" \
    > "$cfg"
  rm -rf "/tmp/gpu_infer_out_$budget"
  start=$(date +%s)
  rc=0
  timeout -k 10 "${RUN_TIMEOUT:-400}" python -m train.infer --model "$data/model" --input "$out/edits.jsonl" \
    --out "/tmp/gpu_infer_out_$budget" --config "$cfg" > "$out/infer_$budget.log" 2>&1 || rc=$?
  echo "budget $budget: rc $rc, $(( $(date +%s) - start )) s in all"
  grep -E "memory plan|wrote|Error|error" "$out/infer_$budget.log" | head -4 || true
  if [ -f "/tmp/gpu_infer_out_$budget/summary.json" ]; then
    cp "/tmp/gpu_infer_out_$budget/summary.json" "$out/infer_summary_$budget.json"
    python -c "import json, sys; s = json.load(open(sys.argv[1])); print({k: s[k] for k in ('seconds_per_image', 'peak_memory_gb')})" \
      "$out/infer_summary_$budget.json"
  fi
done
