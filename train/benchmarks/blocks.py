"""The memory plan's block measurement alone (train/plan/measure.py `measure`), with and without kept attention.

    python -m train.bench --block_probe [--image_tokens 12288 --target 64x64 --text_tokens 696] [--json J]

One- and two-block transformers of the released width (Qwen-Image-Edit's), prepared as training prepares them
(LoRA r64 on the default targets, fp8 base, compiled), run forward and backward at one micro-batch's tokens, plain
and checkpointed, as the plan measures them at the start of a run: first with checkpointed blocks that keep their
attention output (train.kept_attention_blocks, train/model/kept_attention.py), then with blocks that recompute it.
The report gives the plan's figures for both, so the lever's memory (X) and the recomputation it saves come from one
process on one GPU. The default workload is the 2509 one of docs/performance.md (a 1024^2 target, two 1 MP
references, the text bound: 12,984 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import tempfile
from pathlib import Path

import torch

from train.config import LoraConfig
from train.plan.measure import measure
from train.plan.workload import Workload


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.bench --block_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--image_tokens", type=int, default=3 * 4096, help="target + reference tokens (2x2 patches)")
    p.add_argument("--target", default="64x64", help="the target's latent patch grid, HxW (its tokens count in "
                   "image_tokens)")
    p.add_argument("--text_tokens", type=int, default=696)
    p.add_argument("--rank", type=int, default=64, help="LoRA rank on the default targets")
    p.add_argument("--json", default="", help="append the result as one JSON line to this file")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    from train.benchmarks.build import build_full_transformer
    from train.benchmarks.workload import FAMILY

    if not torch.cuda.is_available():
        raise SystemExit("--block_probe needs a CUDA GPU (the plan measures nothing on the CPU)")
    device = torch.device("cuda", torch.cuda.current_device())
    h, w = (int(n) for n in args.target.lower().split("x"))
    work = Workload(1, args.image_tokens, (2 * h, 2 * w), args.text_tokens)
    lora = LoraConfig(rank=args.rank, alpha=float(args.rank), target_modules=list(FAMILY.lora.targets))
    record = {"benchmark": "block_probe", "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "tokens": work.image_tokens + work.text_tokens, "rank": args.rank}
    with tempfile.TemporaryDirectory(prefix="block_probe_") as model_dir:
        build_full_transformer(None, "meta", torch.bfloat16).save_config(Path(model_dir) / "transformer")
        for kept in (True, False):
            m = measure(model_dir, work, torch.bfloat16, device, "lora", lora, True, True, kept=kept)
            record["kept" if kept else "recomputed"] = dataclasses.asdict(m)
    return record


def format_report(r: dict) -> str:
    kept, plain = r["kept"], r["recomputed"]
    saved = plain["fwd_s"] - (kept["kept_recompute_s"] or plain["fwd_s"])
    return "\n".join([
        f"== block probe: {r['gpu']}, torch {r['torch']}, {r['date']}; {r['tokens']} tokens, LoRA r{r['rank']}, "
        "fp8 base, compiled ==",
        f"plain block      A {plain['act_bytes'] / 1e9:.3f} GB, forward {plain['fwd_s'] * 1e3:.2f} ms, "
        f"forward+backward {plain['fwd_bwd_s'] * 1e3:.2f} ms (the run with kept attention: {kept['fwd_s'] * 1e3:.2f} / "
        f"{kept['fwd_bwd_s'] * 1e3:.2f} ms)",
        f"checkpointed     S {plain['ckpt_bytes'] / 1e9:.3f} GB (kept run: {kept['ckpt_bytes'] / 1e9:.3f} GB + X), "
        f"recomputation = its forward {plain['fwd_s'] * 1e3:.2f} ms",
        f"kept attention   X {kept['kept_bytes'] / 1e6:.1f} MB, recomputation "
        f"{(kept['kept_recompute_s'] or 0) * 1e3:.2f} ms: {saved * 1e3:.2f} ms saved per checkpointed block",
    ])
