"""Benchmark of the training input path: online encoding vs the latent/embedding cache (train/data/latent_cache.py).

    python -m train.bench_data --tiny                      # CPU: the tiny model of train.make_tiny, fp32
    python -m train.bench_data --train_step                # GPU: full-size architectures at random init, bf16
    python -m train.bench_data --train_step --json runs/bench_data.jsonl
    python -m train.bench_data --variant edit_plus --vae_2d_frames off   # the phases on diffusers' own VAE path

How the two phases are timed: train/benchmarks/inputs.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import train.runtime.quiet  # noqa: F401  (first: it quiets the libraries before they are imported)
from train.benchmarks.inputs import format_report, parse_args, run
from train.benchmarks.report import append_json
from train.runtime import engine
from train.runtime.console import prefix_rank_output


def main(argv: list[str] | None = None) -> int:
    prefix_rank_output()
    args = parse_args(argv)
    d = engine.init_distributed()
    with tempfile.TemporaryDirectory(prefix="bench_data_") as work:
        record = run(args, d, Path(work))
    print(format_report(record), flush=True)
    if args.json:
        append_json(args.json, record)
    engine.teardown()
    return 0


if __name__ == "__main__":
    engine.exit_with(main)
