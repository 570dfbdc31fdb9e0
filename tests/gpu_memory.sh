#!/usr/bin/env bash
# Memory benchmark of the real entry point: the shipped default config with only qwen_edit.memory.budget_gb
# changed, on full-size architectures at random init (no weights needed), one GPU. For each budget it records the
# memory plan (choice, predicted peak), the measured peak (torch's max allocated, from metrics.jsonl; and its max
# reserved, what the caching allocator held, which the budget's margin must cover), the step-time summary of the steps
# after the warm-up (train/runtime/steptime.py: the mean, its samples/s, the median, the slowest step and how many
# took over 1.5x the median; from metrics.jsonl's per-step times, and the run's own from summary.json as
# summary_step_time), and per step its time, the allocator's cache flushes so far (alloc_retries), torch.compile's
# graphs so far (compiled_graphs), the share of the step spent waiting for data (data_wait), the seconds spent in
# Python's garbage collector (gc_s), the GPU's lowest SM clock and mean power sampled once a second during the step
# (sm_clock_mhz, power_w), the process's host RSS (host_rss_gb) and the pinned host memory torch's allocator holds
# (host_pinned_gb), to check the plan's
# predicted_host_pinned_gb (buffers pinned in place with cudaHostRegister show in the RSS only), and over the whole
# run the GPU's mean SM clock and power while busy beside its maximum clock (summary.json's gpus; its busy samples
# include the plan's measurement and the first step's compile, so rows compare by median_step_sm_clock_mhz, the
# median over the timed steps of each step's lowest clock).
# docs/benchmarks.md says what it measures; docs/performance.md has the current figures.
# Usage (repo root, on a CUDA host with the project installed or a wheelhouse on PYTHONPATH):
#   OUT=/tmp/mem VARIANT=edit_plus CACHE="auto off" BUDGETS="141 80 48 24 16" STEPS=8 bash tests/gpu_memory.sh
# CONFIG=ds_configs/lora_fast.json starts from another shipped config (default zero2.json).
# RUN_TIMEOUT (420 s) limits each run; on a fresh machine the first row needs ~230-260 s for 8 steps (the plan's
# measurement compiles for ~65 s, the first step for ~70 s; an online first row had not reached step 1 after 200 s
# once, its plan alone 76 s), later rows ~145-225 s. A run still going at the limit
# gets SIGTERM, then SIGKILL 20 s later: a SIGTERM during a compile can hang torch 2.11 (docs/benchmarks.md).
# SET="train.kept_attention_blocks=0 ..." also sets these qwen_edit keys (JSON values) in every generated config, for
# a same-call comparison with a lever off; TAG=name is added to the records' names.
# REFS=N (VARIANT=qwen_image_21 only) gives every row N references (make_tiny --references; 0 = text-to-image), in
# its own data directory, for a row of one slot layout; without it the rows mix 0, 1 and 2 references.
# LAYERS=N builds the full-size transformer with N blocks (make_tiny --num_layers) in its own data directory: with
# SET='train.mode="full"' it measures the deepest full fine-tune a budget fits (docs/benchmarks.md).
# VALIDATION=1 adds validation renders: a validation file of the first VAL_ROWS (2) rows of the dataset (their
# references, their prompts) in the generated config, rendered before step 1 and after the last step with
# VAL_STEPS (4) denoising steps (the memory does not depend on their number); the record then has the plan's
# predicted_render_peak_gb and the renders' measured_render_peak_gb (summary.json; torch's max allocated while the
# renders ran, the largest of them).
set -euo pipefail
out=${OUT:-/tmp/gpu_memory}
variant=${VARIANT:-edit_plus}
steps=${STEPS:-8}
config=${CONFIG:-ds_configs/zero2.json}
config_name=$(basename "$config" .json)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} HF_HUB_OFFLINE=1 QWEN_EDIT_RANDOM_INIT=1
layers=${LAYERS:-0}
data=${DATA:-/tmp/gpu_memory_data_$variant${LAYERS:+_L$LAYERS}${REFS:+_R$REFS}}
if [ ! -f "$data/model/model_index.json" ]; then
  python -m train.make_tiny --out "$data" --variant "$variant" --size 1024 --num_samples 24 --full_size_configs \
    --num_layers "$layers" ${REFS:+--references "$REFS"} > "$out/make_tiny_$variant.log" 2>&1
fi
for cache in ${CACHE:-auto}; do
  for budget in ${BUDGETS:-141 80 48 24}; do
    name=${config_name}_${variant}${LAYERS:+_L$LAYERS}${REFS:+_R$REFS}_${cache}_${budget}${TAG:+_$TAG}
    cfg=$out/$name.json
    python - "$cfg" "$budget" "$cache" "$steps" "$data" "$config" "${VALIDATION:-0}" "${VAL_ROWS:-2}" \
      "${VAL_STEPS:-4}" "${SET:-}" <<'PY'
import json, sys
path, budget, cache, steps, data, config, validate, val_rows, val_steps, sets = sys.argv[1:]
c = json.load(open(config))
q = c["qwen_edit"]
q["memory"] = {"budget_gb": float(budget)}
for item in sets.split():  # section.key=JSON value
    dotted, value = item.split("=", 1)
    section, key = dotted.split(".")
    q.setdefault(section, {})[key] = json.loads(value)
q["data"].update(cache=cache, cache_dir=f"{data}/cache", num_workers=2)  # one cache for every budget
q["train"]["max_steps"] = int(steps)
q["output"].update(save_every_steps=0, log_every_steps=1, tensorboard=False, gpu_monitor_interval_s=1)
if validate == "1":  # validation.file rows: {"edit_image": path or [paths], "prompt": ...}, paths made absolute
    rows = [json.loads(line) for line in open(f"{data}/data/metadata.jsonl") if line.strip()][:int(val_rows)]
    edits = path[:-len(".json")] + "_validation.jsonl"
    with open(edits, "w") as f:
        for row in rows:
            refs = row.get("edit_image", [])
            refs = [f"{data}/data/{r}" for r in ([refs] if isinstance(refs, str) else refs)]
            f.write(json.dumps({**({"edit_image": refs} if refs else {}), "prompt": row["prompt"]}) + "\n")
    q["validation"] = {"file": edits, "every_steps": 0}  # before step 1 and after the last step
    q.setdefault("inference", {})["num_inference_steps"] = int(val_steps)
json.dump(c, open(path, "w"), indent=1)
PY
    run=/tmp/gpu_memory_run_$name
    rm -rf "$run"
    start=$(date +%s)
    rc=0
    timeout -k 20 "${RUN_TIMEOUT:-420}" python train/main.py --ds_config "$cfg" --model "$data/model" \
      --data "$data/data" --output_dir "$run" > "$out/$name.log" 2>&1 || rc=$?
    python - "$run" "$name" "$rc" "$(( $(date +%s) - start ))" "$cfg" >> "$out/memory.jsonl" <<'PY'
import json, statistics, sys
from pathlib import Path
from train.runtime.steptime import step_time_stats, timed
run, name, rc, wall = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = json.load(open(sys.argv[5]))
rec = {"run": name, "rc": rc, "wall_s": wall}
m = run / "metrics.jsonl"
if m.is_file():
    rows = [json.loads(line) for line in m.read_text().splitlines() if line.strip()]
    rec["measured_peak_gb"] = max((r.get("peak_memory_gb", 0) for r in rows), default=None)
    rec["measured_reserved_gb"] = max((r.get("peak_reserved_gb", 0) for r in rows), default=None)
    rec["step_times_s"] = [round(r["step_time_s"], 3) for r in rows]  # every step's, the first (compiling) included
    rec["alloc_retries"] = [r.get("alloc_retries") for r in rows]  # the allocator's cache flushes so far, per step
    rec["compiled_graphs"] = [r.get("compiled_graphs") for r in rows]  # torch.compile's graphs so far, per step
    rec["data_wait"] = [r.get("data_wait_fraction") for r in rows]  # the step's share spent waiting for its batch
    rec["gc_s"] = [r.get("gc_s") for r in rows]  # seconds in Python's garbage collector during the step
    rec["sm_clock_mhz"] = [r.get("gpu0_sm_clock_mhz") for r in rows]  # the lowest SM clock sampled in the step
    rec["power_w"] = [r.get("gpu0_power_w") for r in rows]  # the mean board power sampled in the step
    rec["host_rss_gb"] = [r.get("host_rss_gb") for r in rows]  # the process's resident host memory, per step
    rec["host_pinned_gb"] = [r.get("host_pinned_gb") for r in rows]  # torch's pinned host pool, per step
    samples = cfg["train_micro_batch_size_per_gpu"] * cfg.get("gradient_accumulation_steps", 1)  # one GPU
    rec.update(step_time_stats([r["step_time_s"] for r in rows], samples) or {})  # a record per step, step 1 first
    clocks = [r["gpu0_sm_clock_mhz"] for r in timed(rows) if r.get("gpu0_sm_clock_mhz")]
    rec["median_step_sm_clock_mhz"] = statistics.median(clocks) if clocks else None  # the same steps' lowest clocks
s = run / "summary.json"
if s.is_file():
    summary = json.loads(s.read_text())
    plan = summary.get("memory_plan") or {}
    rec.update({k: plan.get(k) for k in ("choice", "predicted_peak_gb", "budget_gb", "tokens", "offload_optimizer",
                                        "predicted_host_step_s", "predicted_host_pinned_gb", "render_tokens",
                                        "vae_tiling", "predicted_render_peak_gb")})
    rec["measured_render_peak_gb"] = summary.get("measured_render_peak_gb")
    rec["summary_step_time"] = summary.get("step_time")  # the run's own: each step timed by CUDA events
    rec["gpus"] = summary.get("gpus")  # per GPU: mean utilisation, busy SM clock and power, maximum SM clock
    rec["plan_measured"] = plan.get("measured")  # A, S, T, ...: the prediction recomputes from these and the sizes
print(json.dumps(rec))
PY
    tail -n 1 "$out/memory.jsonl"
    grep -E "memory plan|render peaked|renders peaked|error|Error" "$out/$name.log" | head -8 || true
    rm -rf "$run"
  done
done
