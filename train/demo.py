"""The embedded default: tiny model + synthetic edits -> ZeRO-2 LoRA training -> export -> before/after PNG.

    python -m train.demo [--workdir demo_out] [--max_steps 200]

Builds the tiny checkpoint and dataset (train.make_tiny), trains with the deepspeed launcher on 2
processes (GPUs when present, else CPU processes), and renders reference | target | base model | with
the exported LoRA through diffusers' own edit pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def launch_training(workdir: Path, max_steps: int, num_procs: int) -> None:
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_procs),
        "--master_port", os.environ.get("MASTER_PORT", "29511"),
        str(REPO / "train" / "main.py"), "--ds_config", str(REPO / "ds_configs" / "tiny_cpu.json"),
        "--model", str(workdir / "model"), "--data", str(workdir / "data"),
        "--output_dir", str(workdir / "run"), "--max_steps", str(max_steps),
    ]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def render(workdir: Path, num_rows: int = 4, steps: int = 20) -> Path:
    """Edit the first dataset rows with the base pipeline and with the exported LoRA; save a PNG grid."""
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    from train.conditioning import pipeline_areas
    from train.config import PROJECT_KEY

    cfg = json.loads((workdir / "run" / "config.json").read_text())[PROJECT_KEY]
    rows = [json.loads(line) for line in (workdir / "data" / "metadata.jsonl").read_text().splitlines()][:num_rows]
    pipe = DiffusionPipeline.from_pretrained(workdir / "model", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)

    def edit_all() -> list[Image.Image]:
        outs = []
        for row in rows:
            refs = row["edit_image"] if isinstance(row["edit_image"], list) else [row["edit_image"]]
            images = [Image.open(workdir / "data" / r).convert("RGB") for r in refs]
            with pipeline_areas(cfg["data"]["area"], cfg["data"]["condition_area"]):
                outs.append(pipe(image=images if len(images) > 1 else images[0], prompt=row["prompt"],
                                 num_inference_steps=steps, true_cfg_scale=1.0,
                                 generator=torch.Generator().manual_seed(0)).images[0])
        return outs

    before = edit_all()
    pipe.load_lora_weights(workdir / "run" / "export", weight_name="pytorch_lora_weights.safetensors")
    after = edit_all()
    size = before[0].size
    grid = Image.new("RGB", (size[0] * 4, size[1] * len(rows)), "white")
    for i, row in enumerate(rows):
        ref = row["edit_image"] if isinstance(row["edit_image"], str) else row["edit_image"][0]
        cells = [Image.open(workdir / "data" / ref), Image.open(workdir / "data" / row["image"]), before[i], after[i]]
        for j, cell in enumerate(cells):
            grid.paste(cell.convert("RGB").resize(size), (j * size[0], i * size[1]))
    out = workdir / "before_after.png"
    grid.save(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=str(REPO / "demo_out"))
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--variant", default="edit", choices=["edit", "edit_plus"])
    args = parser.parse_args(argv)
    import torch

    from train.make_tiny import make_tiny

    workdir = Path(args.workdir).resolve()
    if not (workdir / "model" / "model_index.json").is_file():
        make_tiny(workdir, args.variant)
    num_gpus = torch.cuda.device_count()
    launch_training(workdir, args.max_steps, num_procs=min(2, num_gpus) if num_gpus else 2)
    out = render(workdir)
    print(f"wrote {out} (columns: reference | target | base model | base + exported LoRA)")


if __name__ == "__main__":
    main()
