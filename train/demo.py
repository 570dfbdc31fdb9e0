"""The embedded default: tiny model + synthetic edits -> ZeRO-2 LoRA training -> export -> before/after PNG.

    python -m train.demo [--workdir demo_out] [--max_steps 600] [--variant edit|edit_plus|edit_plus_2511|t2i]

Builds the tiny checkpoint and dataset (train.make_tiny), trains with the deepspeed launcher on 2
processes (GPUs when present, else CPU processes), and renders reference | target | base model | with
the exported LoRA through diffusers' own pipeline (the edit pipelines; QwenImagePipeline for t2i, whose rows are
prompts without a reference: that column is left out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_VAE = "pooling"  # train.model.tiny's averaging autoencoder: the decoded images show what the model learnt
TINY_INFO = "tiny.json"  # train.model.tiny.TINY_INFO (not imported here: it pulls in torch)


# The demo's changes to ds_configs/tiny_cpu.json (the tests' config): latents and prompt embeddings are encoded
# once into a cache (data.cache "auto"), which makes a CPU step ~7x faster, so 600 steps fit in the minutes 200
# took; LoRA rank 64, the tiny transformer's width (rank 16 levels off at a loss of ~0.5, rank 64 reaches ~0.26
# in 600 steps); and 8 rows per micro-batch (16 per step over the 2 processes): a CPU step's cost is mostly fixed,
# so 8 rows cost ~2.3x a row's step time and bring the loss to 0.19 and the LoRA column's distance to the targets
# from 44.8 to 35.8 (base model 56.2; 600 steps, 87 s of training on 2 CPU cores).
DEMO_DS_CHANGES = {"train_micro_batch_size_per_gpu": 8}
DEMO_CHANGES = {"data": {"cache": "auto"}, "lora": {"rank": 64, "alpha": 64}}


def demo_config(workdir: Path) -> Path:
    """WORKDIR/demo_config.json: ds_configs/tiny_cpu.json with DEMO_DS_CHANGES, and DEMO_CHANGES merged into its
    qwen_edit section."""
    cfg = json.loads((REPO / "ds_configs" / "tiny_cpu.json").read_text())
    cfg.update(DEMO_DS_CHANGES)
    for section, changes in DEMO_CHANGES.items():
        cfg["qwen_edit"].setdefault(section, {}).update(changes)
    path = workdir / "demo_config.json"
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def launch_training(workdir: Path, max_steps: int, num_procs: int) -> None:
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_procs),
        "--master_port", os.environ.get("MASTER_PORT", "29511"),
        str(REPO / "train" / "main.py"), "--ds_config", str(demo_config(workdir)),
        "--model", str(workdir / "model"), "--data", str(workdir / "data"),
        "--output_dir", str(workdir / "run"), "--max_steps", str(max_steps),
        "--overwrite",  # every demo is a fresh run: an earlier demo's run/ is replaced, not refused
    ]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def render(workdir: Path, num_rows: int = 4, steps: int = 20) -> tuple[Path, dict[str, float]]:
    """Edit the first dataset rows with the base pipeline and with the exported LoRA; save a labelled PNG grid
    (reference | target | base model | base + exported LoRA, each row under its prompt). Returns the grid's path
    and each column's mean absolute pixel distance to the targets (0-255), the picture's claim in numbers."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from train.config import PROJECT_KEY
    from train.model.conditioning import pipeline_areas
    from train.model.images import open_rgb
    from train.trainer.validation import make_grid

    cfg = json.loads((workdir / "run" / "config.json").read_text())[PROJECT_KEY]
    rows = [json.loads(line) for line in (workdir / "data" / "metadata.jsonl").read_text().splitlines()][:num_rows]
    names = [row.get("edit_image") or [] for row in rows]  # none: a text-to-image row
    references = [[open_rgb(workdir / "data" / r) for r in ([n] if isinstance(n, str) else n)] for n in names]
    targets = [open_rgb(workdir / "data" / row["image"]) for row in rows]
    pipe = DiffusionPipeline.from_pretrained(workdir / "model", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)

    def edit_all() -> list:
        outs = []
        for row, images, target in zip(rows, references, targets, strict=True):
            if not images:  # text-to-image (QwenImagePipeline), at the target's size
                outs.append(pipe(prompt=row["prompt"], height=target.height, width=target.width,
                                 num_inference_steps=steps, true_cfg_scale=1.0,
                                 generator=torch.Generator().manual_seed(0)).images[0])
                continue
            with pipeline_areas(cfg["data"]["area"], cfg["data"]["condition_area"]):
                outs.append(pipe(image=images if len(images) > 1 else images[0], prompt=row["prompt"],
                                 num_inference_steps=steps, true_cfg_scale=1.0,
                                 generator=torch.Generator().manual_seed(0)).images[0])
        return outs

    columns = {"target": targets, "base model": edit_all()}
    pipe.load_lora_weights(workdir / "run" / "export", weight_name="pytorch_lora_weights.safetensors")
    columns["base + exported LoRA"] = edit_all()

    def distance(images: list) -> float:
        return float(np.mean([np.abs(np.asarray(im.resize(t.size), dtype=np.float64) - np.asarray(t, np.float64)).mean()
                              for im, t in zip(images, targets, strict=True)]))

    out = workdir / "before_after.png"
    make_grid(references, columns, [row["prompt"] for row in rows]).save(out)
    return out, {name: distance(columns[name]) for name in ("base model", "base + exported LoRA")}


def prepare_workdir(workdir: Path, variant: str) -> None:
    """Keep a tiny model built before only when it is of the asked variant; otherwise clear model/, data/ and run/
    (saying so), so that `--variant edit_plus` never trains a v1 model left by an earlier demo."""
    import shutil

    from train.model.components import detect_variant

    if not (workdir / "model" / "model_index.json").is_file():
        return
    built = detect_variant(workdir / "model", "auto")
    info = workdir / "model" / TINY_INFO
    vae = json.loads(info.read_text()).get("vae") if info.is_file() else "random"
    if built != variant or vae != DEMO_VAE:
        what = f"a tiny {built!r} model, not {variant!r}" if built != variant else f"a {vae!r} tiny VAE"
        print(f"{workdir / 'model'} holds {what}: rebuilding {workdir}/model, data and run", flush=True)
        for name in ("model", "data", "run"):
            shutil.rmtree(workdir / name, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=str(REPO / "demo_out"))
    parser.add_argument("--max_steps", type=int, default=600)
    from train.model.tiny import VARIANTS, make_tiny

    parser.add_argument("--variant", default="edit", choices=VARIANTS)
    args = parser.parse_args(argv)
    import torch

    workdir = Path(args.workdir).resolve()
    prepare_workdir(workdir, args.variant)
    if not (workdir / "model" / "model_index.json").is_file():
        make_tiny(workdir, args.variant, vae=DEMO_VAE)
    num_gpus = torch.cuda.device_count()
    launch_training(workdir, args.max_steps, num_procs=min(2, num_gpus) if num_gpus else 2)
    out, distances = render(workdir)
    print(f"wrote {out} (columns: reference | target | base model | base + exported LoRA; each row under its "
          f"prompt) and {workdir / 'run' / 'loss.png'} (the loss curve)")
    print("mean absolute distance to the targets (0-255): " + ", ".join(f"{k} {v:.1f}" for k, v in distances.items()))


if __name__ == "__main__":
    main()
