"""The embedded default: tiny model + synthetic edits -> ZeRO-2 LoRA training -> export -> before/after PNG.

    python -m train.demo [--workdir demo_out] [--max_steps 600]
        [--variant edit|edit_plus|edit_plus_2511|t2i|qwen_image_21]

Builds the tiny checkpoint and dataset (train.make_tiny: the pooling VAE, the demo's transformer) and pre-trains
its base on identity edits, so that the base copies its reference (train/trainer/pretrain.py; not for t2i), trains
a LoRA with the deepspeed launcher on 2 processes (GPUs when present, else CPU processes), and renders reference |
target | base model | with the exported LoRA through diffusers' own pipeline (the edit pipelines; QwenImagePipeline
for t2i, whose rows are prompts without a reference: that column is left out), for two training rows and two new
scenes that nothing was trained on. It prints each column's distance to the targets over the whole image and over
the pixels the edit changes, beside the unedited reference's (what a model that ignores the prompt scores).

Qwen-Image-2.1 (`--variant qwen_image_21`): the tiny 2.1 checkpoint (train/model/qwen_image21/tiny.py) stays random,
its VAE too, so its renders are noise and show only that the export changes them; it trains on the same recolour
edits (one reference each), encoding online (its family has no latent cache yet).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import train.runtime.quiet  # noqa: F401  (first: it quiets the libraries before they are imported)

REPO = Path(__file__).resolve().parent.parent
DEMO_VAE = "pooling"  # qwen_image.tiny's averaging autoencoder: the decoded images show what the model learnt
DEMO_TRANSFORMER = "demo"  # qwen_image.tiny.TRANSFORMER_SIZES: wider heads whose RoPE tells positions apart
TINY_INFO = "tiny.json"  # train.model.qwen_image.tiny.TINY_INFO (not imported here: it pulls in torch)
QWEN_IMAGE_21 = "qwen_image_21"
# What a demo model of each kind is built with (tiny.json's keys): the MMDiT's averaging VAE and wider transformer;
# Qwen-Image-2.1's tiny checkpoint as the tests build it (no averaging VAE of its own yet).
DEMO_BUILDS = {"qwen_image": {"vae": DEMO_VAE, "transformer": DEMO_TRANSFORMER},
               "qwen_image21": {"vae": "random", "transformer": "tests"}}


# The demo's changes to ds_configs/tiny_cpu.json (the tests' config): latents and prompt embeddings are encoded
# once into a cache (data.cache "auto"), which makes a CPU step ~7x faster; LoRA rank 64 (on the earlier random
# base rank 16 levelled off at a loss of ~0.5 where 64 went on falling); and 8 rows per micro-batch (16 per step
# over the 2 processes): a CPU step's cost is mostly fixed, so 8 rows cost ~2.3x a row's step time. On the
# pre-trained base, 600 steps (100 s with launch and cache on 2 CPU cores) bring the loss from 0.31 to 0.021 and
# the edited pixels' distance to the targets on new scenes from the base's 76.0 to 22.6 (docs/performance.md, the demo).
DEMO_DS_CHANGES = {"train_micro_batch_size_per_gpu": 8}
DEMO_CHANGES = {"data": {"cache": "auto"}, "lora": {"rank": 64, "alpha": 64}}
# Qwen-Image-2.1 on top: its family's LoRA targets (tiny_cpu.json names the MMDiT's) and online encoding (no latent
# cache yet); 600 steps take ~5 min with launch on 2 CPU cores (0.5 s a step).
DEMO_21_CHANGES = {"data": {"cache": "off"}, "lora": {"target_modules": None}}


def demo_config(workdir: Path, variant: str = "edit") -> Path:
    """WORKDIR/demo_config.json: ds_configs/tiny_cpu.json with DEMO_DS_CHANGES, and DEMO_CHANGES (for Qwen-Image-2.1
    then DEMO_21_CHANGES) merged into its qwen_edit section."""
    cfg = json.loads((REPO / "ds_configs" / "tiny_cpu.json").read_text())
    cfg.update(DEMO_DS_CHANGES)
    for changes in [DEMO_CHANGES] + ([DEMO_21_CHANGES] if variant == QWEN_IMAGE_21 else []):
        for section, values in changes.items():
            cfg["qwen_edit"].setdefault(section, {}).update(values)
    path = workdir / "demo_config.json"
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def launch_training(workdir: Path, max_steps: int, num_procs: int, variant: str = "edit") -> None:
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_procs),
        "--master_port", os.environ.get("MASTER_PORT", "29511"),
        "--log_level", "error",  # the launcher's own lines (its command, world info): its errors still show
        str(REPO / "train" / "main.py"), "--ds_config", str(demo_config(workdir, variant)),
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


def edit_all(pipe, variant: str, rows: list[dict], references: list[list], area: int, condition_area: int,
             steps: int = 20, desc: str = "rendering") -> list:
    """Each row rendered by `pipe` through its family's sample (seed 0, no classifier-free guidance) at the training
    areas (a text-to-image row: a square of `area`), as an RGB picture (an RGBA render over white)."""
    from train.config import InferenceConfig
    from train.model import family
    from train.model.images import to_rgb
    from train.runtime.console import progress

    sample = family.variant_family(variant).sample
    settings = InferenceConfig(num_inference_steps=steps, true_cfg_scale=1.0, area=area, condition_area=condition_area)
    return [to_rgb(sample(pipe, variant, images, row["prompt"], 0, settings))
            for row, images in progress(list(zip(rows, references, strict=True)), desc=desc, unit="image",
                                        file=sys.stdout)]


NEW_SCENES_SEED = 2  # make_tiny's rows are drawn with seed 0 and pre-training's scenes with seed 1: neither saw these


def new_scenes(workdir: Path, num_rows: int) -> Path:
    """WORKDIR/new_scenes: `num_rows` edits of the demo's kind and size that neither pre-training nor the LoRA saw,
    so that the picture shows the edit learnt rather than rows remembered."""
    import shutil

    from train.model.images import shown_size
    from train.model.qwen_image.tiny import make_dataset

    first = json.loads((workdir / "data" / "metadata.jsonl").read_text().splitlines()[0])
    size = shown_size(workdir / "data" / first["image"])[0]
    shutil.rmtree(workdir / "new_scenes", ignore_errors=True)  # an earlier demo's, perhaps of another variant
    make_dataset(workdir / "new_scenes", data_variant(model_variant(workdir / "model")), num_rows, size,
                 NEW_SCENES_SEED)
    return workdir / "new_scenes"


def model_variant(model_dir: Path) -> str:
    """The variant of the tiny model in `model_dir` (any family's)."""
    from train.model import family

    return family.detect(model_dir)[1]


def data_variant(variant: str) -> str:
    """The MMDiT tiny dataset's kind of rows a demo of `variant` trains on: Qwen-Image-2.1 takes v1's (one
    reference each; the dataset format is every family's)."""
    return "edit" if variant == QWEN_IMAGE_21 else variant


def edited_pixels(references: list[list], targets: list) -> list | None:
    """Per row, a mask of the pixels where the target differs from its (first) reference: what the edit changes;
    None for text-to-image rows (no reference)."""
    import numpy as np

    if not all(references):
        return None
    return [np.abs(np.asarray(refs[0].resize(t.size), np.int16) - np.asarray(t, np.int16)).max(axis=-1) > 0
            for refs, t in zip(references, targets, strict=True)]


def distance(images: list, targets: list, masks: list | None = None) -> float:
    """Mean absolute pixel distance (0-255) of `images` to `targets` (each resized to its target's size); over the
    pixels of `masks` alone when given."""
    import numpy as np

    errors = [np.abs(np.asarray(im.resize(t.size), dtype=np.float64) - np.asarray(t, np.float64)).mean(axis=-1)
              for im, t in zip(images, targets, strict=True)]
    return float(np.mean([e[m].mean() for e, m in zip(errors, masks, strict=True)] if masks is not None
                         else [e.mean() for e in errors]))


def figures(columns: dict[str, list], references: list[list], targets: list) -> dict[str, tuple[float, float | None]]:
    """{column: (distance to the targets over the whole image, over the edited pixels alone or None)}, with the
    unedited reference as the do-nothing baseline: most of a scene is background that every column copies, so the
    whole-image figure alone makes a model that ignores the edit look close."""
    masks = edited_pixels(references, targets)
    if masks is not None:
        columns = {"reference (unedited)": [refs[0] for refs in references], **columns}
    return {name: (distance(images, targets), None if masks is None else distance(images, targets, masks))
            for name, images in columns.items()}


def render(workdir: Path, num_rows: int = 4, steps: int = 20) -> tuple[Path, dict[str, dict]]:
    """Edit the first half of `num_rows` from the training rows and the other half from new scenes (new_scenes),
    with the base pipeline and with the exported LoRA; save a labelled PNG grid (reference | target | base model |
    base + exported LoRA, each row under its prompt, marked [trained] or [new scene]). Returns the grid's path and,
    for the rows trained on and for the new scenes, each column's figures (see figures): the picture's claim in
    numbers."""
    from diffusers import DiffusionPipeline

    from train.config import PROJECT_KEY
    from train.trainer.grid import make_grid

    data = json.loads((workdir / "run" / "config.json").read_text())[PROJECT_KEY]["data"]
    variant = model_variant(workdir / "model")
    num_trained = num_rows // 2
    trained = read_rows(workdir / "data", num_trained)
    new = read_rows(new_scenes(workdir, num_rows - num_trained), num_rows - num_trained)
    rows, references, targets = (a + b for a, b in zip(trained, new, strict=True))  # trained rows first
    pipe = DiffusionPipeline.from_pretrained(workdir / "model", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    areas = (data["area"], data["condition_area"])
    columns = {"target": targets, "base model": edit_all(pipe, variant, rows, references, *areas, steps,
                                                          "rendering the base model's edits")}
    pipe.load_lora_weights(workdir / "run" / "export", weight_name="pytorch_lora_weights.safetensors")
    columns["base + exported LoRA"] = edit_all(pipe, variant, rows, references, *areas, steps,
                                               "rendering the edits with the exported LoRA")
    out = workdir / "before_after.png"
    marks = ["[trained]"] * num_trained + ["[new scene]"] * (num_rows - num_trained)
    make_grid(references, columns, [f"{m} {row['prompt']}" for m, row in zip(marks, rows, strict=True)]).save(out)
    models = ("base model", "base + exported LoRA")
    part = {"rows trained on": slice(0, num_trained), "new scenes": slice(num_trained, num_rows)}
    return out, {group: figures({name: columns[name][s] for name in models}, references[s], targets[s])
                 for group, s in part.items()}


def figures_lines(found: dict[str, dict]) -> list[str]:
    """render()'s figures as the demo prints them."""
    lines = ["mean absolute distance to the targets (0-255), over the whole image / over the edited pixels alone "
             "(where the target differs from its reference):"]
    for group, columns in found.items():
        lines.append(f"  {group}: " + ", ".join(f"{name} {whole:.1f}" + ("" if edited is None else f" / {edited:.1f}")
                                               for name, (whole, edited) in columns.items()))
    return lines


def unlike_the_demo(model_dir: Path, variant: str) -> str | None:
    """What makes a tiny model built before other than the demo's (of `variant`), None when nothing does."""
    from train.model import family

    fam, built = family.detect(model_dir)
    info = json.loads((model_dir / TINY_INFO).read_text()) if (model_dir / TINY_INFO).is_file() else {}
    wanted = DEMO_BUILDS[fam.name]
    if built != variant:
        return f"a tiny {built!r} model, not {variant!r}"
    if info.get("vae", "random") != wanted["vae"]:
        return f"a {info.get('vae', 'random')!r} tiny VAE"
    if info.get("transformer", "tests") != wanted["transformer"]:
        return "the tests' tiny transformer"
    if variant not in ("t2i", QWEN_IMAGE_21) and "pretrained" not in info:
        return "a base that was not pre-trained"
    return None


class WorkdirError(ValueError):
    """The work directory holds a model the demo did not build; the message names the fix."""


def prepare_workdir(workdir: Path, variant: str) -> None:
    """Keep a tiny model built before only when it is the demo's, of the asked variant; otherwise clear model/,
    data/ and run/ (saying so), so that `--variant edit_plus` never trains a v1 model left by an earlier demo.
    A model without make_tiny's tiny.json (e.g. real weights copied there) is never deleted: WorkdirError."""
    import shutil

    if not (workdir / "model" / "model_index.json").is_file():
        return
    if not (workdir / "model" / TINY_INFO).is_file():
        raise WorkdirError(
            f"{workdir / 'model'} holds a model that train.make_tiny did not write (it has no {TINY_INFO}), so the "
            f"demo leaves it alone; pass --workdir with another folder, or remove {workdir / 'model'} yourself")
    what = unlike_the_demo(workdir / "model", variant)
    if what is not None:
        print(f"{workdir / 'model'} holds {what}: rebuilding {workdir}/model, data and run", flush=True)
        for name in ("model", "data", "run"):
            shutil.rmtree(workdir / name, ignore_errors=True)


def build_model_21(workdir: Path) -> None:
    """The tiny Qwen-Image-2.1 checkpoint (random) and the recolour edits, with the tiny.json of a demo model."""
    from train.model.qwen_image.tiny import make_dataset
    from train.model.qwen_image21.tiny import make_tiny_model

    make_tiny_model(workdir / "model")
    make_dataset(workdir / "data", data_variant(QWEN_IMAGE_21), 32, 128)
    (workdir / "model" / TINY_INFO).write_text(json.dumps({"variant": QWEN_IMAGE_21, **DEMO_BUILDS["qwen_image21"]}))
    print("qwen_image_21: the tiny base stays random, its VAE too (no averaging VAE for 2.1 yet): the renders are "
          "noise; the loss curve and the change the exported LoRA makes are what this demo shows", flush=True)


def build_model(workdir: Path, variant: str) -> None:
    """The demo's tiny model and data (train.make_tiny), its base pre-trained on identity edits
    (train/trainer/pretrain.py; a text-to-image base has no reference to copy and stays random; Qwen-Image-2.1:
    build_model_21)."""
    import time

    from train.model.qwen_image.tiny import make_tiny
    from train.trainer.pretrain import Pretraining, final_loss, pretrain

    if variant == QWEN_IMAGE_21:
        build_model_21(workdir)
        return
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
    from train.model.qwen_image.tiny import VARIANTS

    parser.add_argument("--variant", default="edit", choices=[*VARIANTS, QWEN_IMAGE_21])
    args = parser.parse_args(argv)
    import torch

    from train.runtime.console import prefix_rank_output

    prefix_rank_output()  # off a terminal, the libraries' own bars stay out of the log
    workdir = Path(args.workdir).resolve()
    try:
        prepare_workdir(workdir, args.variant)
    except WorkdirError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if not (workdir / "model" / "model_index.json").is_file():
        build_model(workdir, args.variant)
    num_gpus = torch.cuda.device_count()
    launch_training(workdir, args.max_steps, num_procs=min(2, num_gpus) if num_gpus else 2, variant=args.variant)
    out, found = render(workdir)
    print(f"wrote {out} (columns: reference | target | base model | base + exported LoRA; each row under its "
          "prompt, from the training rows [trained] or from new scenes [new scene]) and "
          f"{workdir / 'run' / 'loss.png'} (the loss curve)")
    print("\n".join(figures_lines(found)))


if __name__ == "__main__":
    main()
