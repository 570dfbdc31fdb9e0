#!/usr/bin/env bash
# Speed benchmark in one GPU call, one H200: the project's fastest step (docs/performance.md) against
# DiffSynth-Studio's (the peer, train/benchmarks/peer.py) and against torchao's fp8 linears on the same workload,
# the 2509 two-reference workload, micro-batch 2 in one bucket, and the 50-step loss curves of the kept levers
# against the plain bf16 loop (with the tolerance); the q21_* rows (not in the default ROWS) time Qwen-Image-2.1. Each row is one `python -m train.bench` run: its record is
# $OUT/<row>.jsonl, its log $OUT/<row>.log; $OUT/summary.txt is the table of every row.
# Rows run in the order of ROWS until the time budget is spent; a row that would not fit is skipped (and listed). A
# row named twice runs twice (ROWS="q21_fa4 q21_swiglu q21_fa4 q21_swiglu": an A/B across processes), a line each.
# Usage (repo root, on a CUDA host with the project and its bench extra installed, or a wheelhouse on PYTHONPATH
# that holds diffsynth==2.1.12, einops and torchao==0.18.0 too; this script installs nothing; where the host has no
# package index, tests/gpu_kit.sh makes that wheelhouse and `source tests/gpu_env.sh` installs it there):
#   OUT=/tmp/speed bash tests/gpu_speed.sh
#   BUDGET_S=540 STEPS=8 WARMUP=4 ROWS="peer refs2" OUT=/tmp/speed bash tests/gpu_speed.sh
# EXTRA is appended to every benchmark command (EXTRA=--tiny: a CPU dry run of the script itself).
set -uo pipefail
out=${OUT:-/tmp/gpu_speed}
budget=${BUDGET_S:-540}
steps=${STEPS:-8}
warmup=${WARMUP:-4}
rows=${ROWS:-"peer cudagraphs torchao_training torchao_inference refs2 z2511 curves microbatch2 autotune peer_more"}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
start=$(date +%s)
python - <<'PY' 2>&1 | tee "$out/versions.txt"
import importlib.metadata as md
for name in ("torch", "deepspeed", "diffusers", "peft", "torchao", "diffsynth", "einops", "comfy-kitchen"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
import torch
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PY

# The project's fastest configuration (docs/performance.md), LoRA r64 on the 8 attention projections; `exact` is it
# with the fp8 matmuls' exact accumulation (the plan turns fast accumulation on: docs/levers.md, lever 29).
exact=(--compile --fp8_base --fp8_transposed --zero_stage 1 --lora_targets attn)
fast=("${exact[@]}" --fp8_fast_accum)
timing=(--steps "$steps" --warmup "$warmup")
# Qwen-Image-2.1's fastest configuration (docs/performance.md's 2.1 rows): LoRA r64 on every linear of a block.
q21=(--variant qwen_image_21 --refs 1 --lora_targets default --lora_rank 64 --compile --fp8_base --fp8_transposed
     --fp8_fast_accum --attention segmented)

run_row() {  # NAME SECONDS_IT_NEEDS BENCH_ARGS...: run when the budget has that much left (about 1.5x the
  # seconds the row took, compilation included: q21_peer 98-133 s and the 2.1 A/B rows 100-126 s on an H100)
  local name=$1 need=$2
  shift 2
  local left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt "$need" ]; then
    echo "$name: skipped, $left s of the budget left and it needs about $need s" | tee -a "$out/skipped.txt"
    return
  fi
  local t0 rc=0
  t0=$(date +%s)
  echo "== $name: python -m train.bench $*" | tee -a "$out/commands.txt"
  # shellcheck disable=SC2086
  timeout "$left" python -m train.bench "$@" ${EXTRA:-} --json "$out/$name.jsonl" >> "$out/$name.log" 2>&1 || rc=$?
  echo "$name: rc $rc, $(( $(date +%s) - t0 )) s" | tee -a "$out/commands.txt"
  if [ "$rc" != 0 ]; then
    echo "$name: failed (rc $rc; 124 = out of budget): $(grep -E 'Error|error' "$out/$name.log" | tail -1 | cut -c1-200)" \
      | tee -a "$out/failed.txt"
  fi
}

for row in $rows; do
  case "$row" in
    peer)  # the comparison itself: ours and the peer's fastest candidates in one process, same workload
      run_row peer 200 "${fast[@]}" "${timing[@]}" --peer diffsynth --peer_variants bf16:compile,bf16:eager ;;
    cudagraphs)  # the fastest configuration with each compiled block replayed as a CUDA graph (reduce-overhead)
      run_row cudagraphs 150 "${fast[@]}" --compile_mode reduce-overhead "${timing[@]}" ;;
    fast)  # the fastest configuration alone (docs/performance.md), the reference for single-lever rows
      run_row fast 130 "${fast[@]}" "${timing[@]}" ;;
    autotune)  # inductor's max-autotune (no CUDA graphs): tuned Triton templates for the fused elementwise kernels
      run_row autotune 240 "${fast[@]}" --compile_mode max-autotune-no-cudagraphs "${timing[@]}" ;;
    torchao_training)  # torchao.float8 rowwise training linears in place of train/fp8.py
      run_row torchao_training 110 --compile --fp8_base --fp8_impl torchao_training --zero_stage 1 \
        --lora_targets attn "${timing[@]}" ;;
    torchao_inference)  # torchao's fp8 inference linears (W8A8 dynamic rowwise): does it train at all?
      run_row torchao_inference 90 --compile --fp8_base --fp8_impl torchao_inference --zero_stage 1 \
        --lora_targets attn "${timing[@]}" ;;
    refs2)  # the 2509 workload: two 1 MP references (12.5k tokens)
      run_row refs2 200 "${fast[@]}" --refs 2 "${timing[@]}" --peer diffsynth --peer_variants bf16:compile ;;
    z2511)  # Qwen-Image-Edit-2511 (zero_cond_t): the doubled timestep batch, against the peer's 2511 path
      run_row z2511 200 "${fast[@]}" --zero_cond_t "${timing[@]}" --peer diffsynth --peer_variants bf16:compile ;;
    curves)  # 50 steps of the kept levers against the plain bf16 compiled loop, same seeds: the loss tolerance
      run_row curves 200 "${fast[@]}" --baseline --steps 45 --warmup 5 ;;
    floor)  # the fastest configuration, then its attention and matmul kernels alone at its shapes (--floor), and
      # its kernels by category under the profiler ($OUT/floor.project.txt): the step's distance to the floor
      run_row floor 200 "${fast[@]}" "${timing[@]}" --floor --profile "$out/floor" ;;
    floor_refs2)  # the same on the 2509 workload (two 1 MP references)
      run_row floor_refs2 220 "${fast[@]}" --refs 2 "${timing[@]}" --floor --profile "$out/floor_refs2" ;;
    exact_accum)  # the fastest configuration with the fp8 matmuls' exact accumulation: with `fast`, lever 29's A/B
      run_row exact_accum 130 "${exact[@]}" "${timing[@]}" ;;
    microbatch2)  # two samples of one shape bucket per step
      run_row microbatch2 100 "${fast[@]}" --micro_batch 2 "${timing[@]}" ;;
    peer_more)  # the peer's other candidates: its compile_pipeline default (dynamic), fp8 and int8 weight-only.
      # Last: the fp8 weight-only variant once took over 6 minutes for 12 steps (docs/results/peer_h200_2026-12-01.md).
      run_row peer_more 200 "${fast[@]}" "${timing[@]}" --peer diffsynth \
        --peer_variants bf16:compile_dynamic,torchao_fp8_w8a16:compile,torchao_int8_w8a16:compile ;;
    q21_peer)  # Qwen-Image-2.1, one reference, FlashAttention-4: against the peer on SDPA and on its own pick
      run_row q21_peer 200 "${q21[@]}" --attention_kernel fa4 "${timing[@]}" --peer diffsynth \
        --peer_variants bf16:compile:torch,bf16:compile ;;
    q21_peer_swiglu)  # the same with levers 39's fused SwiGLU on our side
      run_row q21_peer_swiglu 200 "${q21[@]}" --attention_kernel fa4 --fused_swiglu "${timing[@]}" --peer diffsynth \
        --peer_variants bf16:compile:torch,bf16:compile ;;
    q21_fa4)  # the same step alone: the reference for the 2.1 single-lever rows
      run_row q21_fa4 150 "${q21[@]}" --attention_kernel fa4 "${timing[@]}" ;;
    q21_swiglu)  # levers 39: the SwiGLU backward as one Triton kernel (train/model/swiglu.py), against q21_fa4
      run_row q21_swiglu 150 "${q21[@]}" --attention_kernel fa4 --fused_swiglu "${timing[@]}" ;;
    q21_swiglu_profile)  # the same under the profiler: the kernel's own time per block ($OUT/q21_swiglu.project.txt)
      run_row q21_swiglu_profile 200 "${q21[@]}" --attention_kernel fa4 --fused_swiglu "${timing[@]}" \
        --profile "$out/q21_swiglu" ;;
    q21_swiglu_ab)  # levers 39 in one process: the fused SwiGLU off and on in three alternating rounds (ab.py)
      run_row q21_swiglu_ab 170 "${q21[@]}" --attention_kernel fa4 --fused_swiglu --ab_rounds 3 "${timing[@]}" ;;
    q21_text_calls_ab)  # a later text run as one FlashAttention-4 call (bottom-right causal) or two merged calls,
      # in three alternating rounds in one process (ab.py)
      run_row q21_text_calls_ab 170 "${q21[@]}" --attention_kernel fa4 --ab_rounds 3 --ab_lever text_calls \
        "${timing[@]}" ;;
    q21_lean_step_ab)  # the ZeRO step's lighter host work (train/runtime/ds_patches.py) or DeepSpeed's own methods,
      # in three alternating rounds in one process (ab.py)
      run_row q21_lean_step_ab 170 "${q21[@]}" --attention_kernel fa4 --ab_rounds 3 --ab_lever lean_step \
        "${timing[@]}" ;;
    q21_fa4_into_ab)  # FlashAttention-4 writing the segmented op's outputs in place, or returning new tensors copied
      # where they belong, in three alternating rounds in one process (ab.py)
      run_row q21_fa4_into_ab 170 "${q21[@]}" --attention_kernel fa4 --ab_rounds 3 --ab_lever fa4_into "${timing[@]}" ;;
    lean_step_ab)  # the lean step on the MMDiT's fastest configuration (ZeRO stage 1, 960 LoRA tensors; an H200's memory)
      run_row lean_step_ab 260 "${fast[@]}" --ab_rounds 3 --ab_lever lean_step "${timing[@]}" ;;
    q21_cudagraphs)  # each compiled block replayed as a CUDA graph (reduce-overhead): the host's launches on 2.1
      run_row q21_cudagraphs 180 "${q21[@]}" --attention_kernel fa4 --compile_mode reduce-overhead "${timing[@]}" ;;
    *) echo "unknown row $row (rows: peer cudagraphs fast torchao_training torchao_inference refs2 z2511" \
            "curves exact_accum microbatch2 autotune peer_more floor floor_refs2 q21_peer q21_peer_swiglu q21_fa4" \
            "q21_swiglu q21_swiglu_ab q21_text_calls_ab q21_lean_step_ab q21_fa4_into_ab lean_step_ab q21_cudagraphs" \
            "q21_swiglu_profile)" ;;
  esac
done

python - "$out" <<'PY' | tee "$out/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'row':18s} {'configuration':54s} {'s/step':>8s} {'MFU':>6s} {'GB':>6s}  note")
records = [(p, line) for p in sorted(out.glob("*.jsonl")) for line in p.read_text().splitlines() if line.strip()]
for path, line in records:  # a row run twice (ROWS="a b a b") has a line per run
    r = json.loads(line)
    opts = [f"refs {r['refs']}", f"mb {r['micro_batch']}"]
    fp8 = f"fp8 {r['fp8_impl']}" + ("+T" if r["fp8_transposed"] else "") + ("+F" if r.get("fp8_fast_accum") else "")
    fp8 += "+S" if r.get("fused_swiglu") else ""
    opts += [fp8] if r["fp8_base"] else ["bf16"]  # T: the stored transposed copy, F: fast accumulation, S: fused SwiGLU
    opts += [(f"compiled {r['compile_mode']}" if r.get("compile_mode") else "compiled") if r["compile"] else "eager",
             f"ZeRO-{r['zero_stage']}"]
    print(f"{path.stem:18s} {'project: ' + ', '.join(opts):54s} {r['s_per_step']:8.4f} {100 * r['mfu']:5.1f}% "
          f"{r['peak_memory_gb']:6.1f}  {r['tokens_per_sample']} tokens/sample")
    if "ratio" in r:
        ok = "within" if r["loss_within_tolerance"] else "OUTSIDE"
        print(f"{'':18s} {'plain PyTorch loop, bf16':54s} {r['baseline_s_per_step']:8.4f} {100 * r['baseline_mfu']:5.1f}% "
              f"{r['baseline_peak_memory_gb']:6.1f}  plain/project {r['ratio']:.3f}; {len(r['losses'])}-step loss "
              f"curves: max rel diff {r['loss_max_rel_diff']:.2e}, tolerance {r['loss_tolerance']:.0e}: {ok}")
    for p in r.get("peer_rows", []):
        if "error" in p:
            print(f"{'':18s} {'peer ' + p['variant']:54s} {'-':>8s} {'-':>6s} {'-':>6s}  {p['error'][:90]}")
        else:
            print(f"{'':18s} {'peer ' + p['variant']:54s} {p['s_per_step']:8.4f} {100 * p['mfu']:5.1f}% "
                  f"{p['peak_memory_gb']:6.1f}  project is {p['s_per_step'] / r['s_per_step']:.3f}x faster")
    if "ab_rounds" in r:
        label = f"the same without {r['ab_lever']} ({r['ab_rounds']} alternating rounds)"
        flag = " (RECOMPILED: not the lever alone)" if r["ab_recompiled"] else ""
        print(f"{'':18s} {label:54s} {r['ab_off_s_per_step']:8.4f}   on - off {r['ab_on_minus_off_ms']:+.1f} ms{flag}")
    if "floor_s" in r:
        print(f"{'':18s} {'floor: attention + fp8 + dense matmuls alone':54s} {r['floor_s']:8.4f}   step/floor "
              f"{r['floor_ratio']:.3f} (mean), {r['floor_ratio_median']:.3f} (median {r['floor_step_median_s']:.4f} s)")
    if "peer_ratio" in r:
        print(f"{'':18s} peer's fastest ({r['peer_fastest']}) / project = {r['peer_ratio']:.3f} (goal >= 1.3)")
for name in ("failed.txt", "skipped.txt"):
    if (out / name).is_file():
        print((out / name).read_text().strip())
PY
echo "total $(( $(date +%s) - start )) s of the $budget s budget"
