"""The embedded default: tiny model + synthetic edits -> ZeRO-2 LoRA training -> export -> before/after PNG.

    python -m train.demo [--workdir demo_out] [--max_steps 600] [--variant edit|edit_plus|edit_plus_2511|t2i]

Builds the tiny checkpoint and dataset (train.make_tiny: the pooling VAE, the demo's transformer) and pre-trains
its base on identity edits, so that the base copies its reference (train/trainer/pretrain.py; not for t2i), trains
a LoRA with the deepspeed launcher on 2 processes (GPUs when present, else CPU processes), and renders reference |
target | base model | with the exported LoRA through diffusers' own pipeline (the edit pipelines; QwenImagePipeline
for t2i, whose rows are prompts without a reference: that column is left out).
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
DEMO_TRANSFORMER = "demo"  # train.model.tiny.TRANSFORMER_SIZES: wider heads whose RoPE tells positions apart
TINY_INFO = "tiny.json"  # train.model.tiny.TINY_INFO (not imported here: it pulls in torch)


# The demo's changes to ds_configs/tiny_cpu.json (the tests' config): latents and prompt embeddings are encoded
# once into a cache (data.cache "auto"), which makes a CPU step ~7x faster; LoRA rank 64 (on the earlier random
# base rank 16 levelled off at a loss of ~0.5 where 64 went on falling); and 8 rows per micro-batch (16 per step
# over the 2 processes): a CPU step's cost is mostly fixed, so 8 rows cost ~2.3x a row's step time. On the
# pre-trained base, 600 steps (100 s with launch and cache on 2 CPU cores) bring the loss from 0.31 to 0.021 and
# the distance to the targets from the base's 18.8 to 6.2 (README "The two commands").
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


def read_rows(data_dir: Path, num_rows: int) -> tuple[list[dict], list[list], list]:
    """The first `num_rows` rows of DATA/metadata.jsonl: (rows, each row's reference images (none for a
    text-to-image row), targets)."""
    from train.model.images import open_rgb

    rows = [json.loads(line) for line in (data_dir / "metadata.jsonl").read_text().splitlines()][:num_rows]
    names = [row.get("edit_image") or [] for row in rows]
    references = [[open_rgb(data_dir / r) for r in ([n] if isinstance(n, str) else n)] for n in names]
    return rows, references, [open_rgb(data_dir / row["image"]) for row in rows]


def edit_all(pipe, rows: list[dict], references: list[list], targets: list, area: int, condition_area: int,
             steps: int = 20) -> list:
    """Each row edited by `pipe` (seed 0, no classifier-free guidance) at the training areas; a text-to-image row
    (QwenImagePipeline) is generated at its target's size."""
    import torch

    from train.model.conditioning import pipeline_areas

    outs = []
    for row, images, target in zip(rows, references, targets, strict=True):
        common = dict(prompt=row["prompt"], num_inference_steps=steps, true_cfg_scale=1.0,
                      generator=torch.Generator().manual_seed(0))
        if not images:
            outs.append(pipe(height=target.height, width=target.width, **common).images[0])
            continue
        with pipeline_areas(area, condition_area):
            outs.append(pipe(image=images if len(images) > 1 else images[0], **common).images[0])
    return outs


def distance(images: list, targets: list) -> float:
    """Mean absolute pixel distance (0-255) of `images` to `targets` (each resized to its target's size)."""
    import numpy as np

    return float(np.mean([np.abs(np.asarray(im.resize(t.size), dtype=np.float64) - np.asarray(t, np.float64)).mean()
                          for im, t in zip(images, targets, strict=True)]))


def render(workdir: Path, num_rows: int = 4, steps: int = 20) -> tuple[Path, dict[str, float]]:
    """Edit the first dataset rows with the base pipeline and with the exported LoRA; save a labelled PNG grid
    (reference | target | base model | base + exported LoRA, each row under its prompt). Returns the grid's path
    and each column's mean absolute pixel distance to the targets (0-255), the picture's claim in numbers."""
    from diffusers import DiffusionPipeline

    from train.config import PROJECT_KEY
    from train.trainer.validation import make_grid

    data = json.loads((workdir / "run" / "config.json").read_text())[PROJECT_KEY]["data"]
    rows, references, targets = read_rows(workdir / "data", num_rows)
    pipe = DiffusionPipeline.from_pretrained(workdir / "model", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    areas = (data["area"], data["condition_area"])
    columns = {"target": targets, "base model": edit_all(pipe, rows, references, targets, *areas, steps)}
    pipe.load_lora_weights(workdir / "run" / "export", weight_name="pytorch_lora_weights.safetensors")
    columns["base + exported LoRA"] = edit_all(pipe, rows, references, targets, *areas, steps)
    out = workdir / "before_after.png"
    make_grid(references, columns, [row["prompt"] for row in rows]).save(out)
    return out, {name: distance(columns[name], targets) for name in ("base model", "base + exported LoRA")}


def unlike_the_demo(model_dir: Path, variant: str) -> str | None:
    """What makes a tiny model built before other than the demo's (of `variant`), None when nothing does."""
    from train.model.components import detect_variant

    built = detect_variant(model_dir, "auto")
    info = json.loads((model_dir / TINY_INFO).read_text()) if (model_dir / TINY_INFO).is_file() else {}
    if built != variant:
        return f"a tiny {built!r} model, not {variant!r}"
    if info.get("vae", "random") != DEMO_VAE:
        return f"a {info.get('vae', 'random')!r} tiny VAE"
    if info.get("transformer", "tests") != DEMO_TRANSFORMER:
        return "the tests' tiny transformer"
    if variant != "t2i" and "pretrained" not in info:
        return "a base that was not pre-trained"
    return None


def prepare_workdir(workdir: Path, variant: str) -> None:
    """Keep a tiny model built before only when it is the demo's, of the asked variant; otherwise clear model/,
    data/ and run/ (saying so), so that `--variant edit_plus` never trains a v1 model left by an earlier demo."""
    import shutil

    if not (workdir / "model" / "model_index.json").is_file():
        return
    what = unlike_the_demo(workdir / "model", variant)
    if what is not None:
        print(f"{workdir / 'model'} holds {what}: rebuilding {workdir}/model, data and run", flush=True)
        for name in ("model", "data", "run"):
            shutil.rmtree(workdir / name, ignore_errors=True)


def build_model(workdir: Path, variant: str) -> None:
    """The demo's tiny model and data (train.make_tiny), its base pre-trained on identity edits
    (train/trainer/pretrain.py; a text-to-image base has no reference to copy and stays random)."""
    import time

    from train.model.tiny import make_tiny
    from train.trainer.pretrain import Pretraining, final_loss, pretrain

    make_tiny(workdir, variant, vae=DEMO_VAE, transformer=DEMO_TRANSFORMER)
    if variant == "t2i":
        print("t2i: the tiny base stays random (pre-training copies a reference; text-to-image rows have none)")
        return
    p, data = Pretraining(), json.loads((REPO / "ds_configs" / "tiny_cpu.json").read_text())["qwen_edit"]["data"]
    print(f"pre-training the tiny base: {p.steps} full-parameter steps on {p.scenes} identity edits "
          "(target = reference) ...", flush=True)
    start = time.perf_counter()
    losses = pretrain(workdir / "model", variant, data["area"], data["condition_area"], p)
    print(f"pre-trained in {time.perf_counter() - start:.0f} s: loss {losses[0]:.2f} -> {final_loss(losses):.3f}",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=str(REPO / "demo_out"))
    parser.add_argument("--max_steps", type=int, default=600)
    from train.model.tiny import VARIANTS

    parser.add_argument("--variant", default="edit", choices=VARIANTS)
    args = parser.parse_args(argv)
    import torch

    workdir = Path(args.workdir).resolve()
    prepare_workdir(workdir, args.variant)
    if not (workdir / "model" / "model_index.json").is_file():
        build_model(workdir, args.variant)
    num_gpus = torch.cuda.device_count()
    launch_training(workdir, args.max_steps, num_procs=min(2, num_gpus) if num_gpus else 2)
    out, distances = render(workdir)
    print(f"wrote {out} (columns: reference | target | base model | base + exported LoRA; each row under its "
          f"prompt) and {workdir / 'run' / 'loss.png'} (the loss curve)")
    print("mean absolute distance to the targets (0-255): " + ", ".join(f"{k} {v:.1f}" for k, v in distances.items()))


if __name__ == "__main__":
    main()
