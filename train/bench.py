"""Benchmark of the project's real training step: step time, throughput, MFU and peak memory.

    python -m train.bench [--tiny] [--mode lora|full] [--checkpointing none|full] [--compile] [--baseline] ...
    python -m train.bench --variant qwen_image_21 --refs 0|1..10 [...]   # Qwen-Image-2.1's step (text-to-image: 0)
    deepspeed --num_gpus N train/bench.py ...          # data parallel over N GPUs (ZeRO-2)
    python -m train.bench --block_probe [...]          # the memory plan's block measurement, kept attention or not
    python -m train.bench --gemm_probe [...]           # one block's fp8 matmuls, fast accumulation off and on
    python -m train.bench --floor [...]                # + the step's attention and matmuls alone: its floor ratio
    python -m train.bench --attention_kernel_probe [...]  # 2.1's attention calls with each fused kernel (sdpa, fa4)
    python -m train.bench --swiglu_probe [...]         # the fused SwiGLU backward's kernel against inductor's
    python -m train.bench --scaling --model M --data D [...]  # train/main.py on 1 and N GPUs, three ZeRO settings

What is timed: train/benchmarks/step.py (its options: options.py); how MFU is counted: train/benchmarks/flops.py
(Qwen-Image-2.1: flops21.py); the block probe: train/benchmarks/blocks.py; the matmul probe:
train/benchmarks/gemms.py; the floor: train/benchmarks/floor.py; the scaling harness: train/benchmarks/scaling.py;
the attention kernels: train/benchmarks/attention_kernels.py; the SwiGLU kernel: train/benchmarks/swiglu_probe.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (the deepspeed launcher): make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train.runtime.quiet  # noqa: F401  (first: it quiets the libraries before they are imported)
from train.benchmarks import attention_kernels, blocks, gemms, scaling, swiglu_probe
from train.benchmarks.options import parse_args
from train.benchmarks.report import append_json, format_report
from train.benchmarks.step import run
from train.runtime import engine
from train.runtime.console import prefix_rank_output

BLOCK_PROBE = "--block_probe"
GEMM_PROBE = "--gemm_probe"
SCALING = "--scaling"
ATTENTION_KERNEL_PROBE = "--attention_kernel_probe"
SWIGLU_PROBE = "--swiglu_probe"


def main(argv: list[str] | None = None) -> int:
    """Parse, run, report on rank 0; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if BLOCK_PROBE in argv:
        return probe(blocks, [a for a in argv if a != BLOCK_PROBE])
    if GEMM_PROBE in argv:
        return probe(gemms, [a for a in argv if a != GEMM_PROBE])
    if ATTENTION_KERNEL_PROBE in argv:
        return probe(attention_kernels, [a for a in argv if a != ATTENTION_KERNEL_PROBE])
    if SWIGLU_PROBE in argv:
        return probe(swiglu_probe, [a for a in argv if a != SWIGLU_PROBE])
    if SCALING in argv:  # launches train/main.py itself: no process group here
        return probe(scaling, [a for a in argv if a != SCALING])
    prefix_rank_output()  # as train/main.py: other ranks' lines carry their rank
    args = parse_args(argv)
    d = engine.init_distributed()
    record = run(args, d)  # a failure skips the teardown barrier: the launcher ends the other ranks
    if d.is_main:
        print(format_report(record), flush=True)
        if args.json:
            append_json(args.json, record)
    engine.teardown()
    return 0


def probe(module, argv: list[str]) -> int:
    """A one-process probe, run, reported, its JSON appended: --block_probe (train/benchmarks/blocks.py, the memory
    plan's block measurement with and without kept attention), --gemm_probe (train/benchmarks/gemms.py),
    --attention_kernel_probe (train/benchmarks/attention_kernels.py), --swiglu_probe (train/benchmarks/swiglu_probe.py)
    or --scaling (train/benchmarks/scaling.py); exit code 1 when the record counts failed runs."""
    args = module.parse_args(argv)
    record = module.run(args)
    print(module.format_report(record), flush=True)
    if args.json:
        append_json(args.json, record)
    return 1 if record.get("failed") else 0


if __name__ == "__main__":
    engine.exit_with(main)
