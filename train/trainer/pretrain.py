"""The demo's base model: the tiny transformer pre-trained on identity edits (the target is the first reference),
so that the base "edits" by copying its reference, as an edit model keeps what an instruction it does not know
leaves alone, and the demo's LoRA then has only the recolouring to learn.

Seeded, in-process and on the CPU, with the trainer's own pieces: make_tiny's scenes (drawn with another seed than
the demo's rows), the dataset's resizing (train/data/pairs.py), the checkpoint's frozen encoders and the training
loop's flow-matching loss (train/trainer/loop.forward_loss). Every transformer weight is trained (AdamW, torch's
one-cycle learning rate), and the result replaces MODEL/transformer in the released diffusers layout; MODEL/tiny.json
records what it was trained on.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from train.config import TrainConfig
from train.config.files import transformer_class
from train.data import pairs
from train.data.rows import read_rows
from train.model import family, loading
from train.model.interface import TINY_INFO, Batch
from train.runtime.console import progress
from train.trainer import loop

MIN_STEPS = 10


@dataclass
class Pretraining:
    """What the demo's base is pre-trained on and how long (35 s on 2 CPU cores, encoding included)."""

    steps: int = 300
    scenes: int = 64  # identity edits; with 128 the base copied the demo's rows no better, at twice the encoding
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 1  # of the scenes, the noise and the order; make_tiny's rows use seed 0


def identity_rows(directory: Path, variant: str, num_scenes: int, side: int, seed: int) -> list:
    """make_tiny's recolouring scenes written to `directory`, each made an identity edit: the target is the first
    reference and the prompt stays (an instruction the base learns to leave unfollowed)."""
    family.variant_family(variant).make_dataset(directory, variant, num_scenes, side, seed)
    rows, _ = read_rows(directory)
    return [replace(row, target=row.references[0]) for row in rows]


@torch.no_grad()
def encode_identity(model_dir: Path, directory: Path, rows: list, variant: str, area: int,
                    condition_area: int) -> Batch:
    """Every row encoded by the checkpoint's frozen encoders, as the training loop takes it (the clean target is
    the first reference's image, so its latents are that reference's)."""
    fam = family.variant_family(variant)
    encoders = fam.load_encoders(model_dir, torch.float32, torch.device("cpu"))
    dataset = pairs.EditDataset(directory, rows, variant, area, condition_area)
    return fam.encode_batch(pairs.collate([dataset[i] for i in range(len(dataset))]), encoders, variant)


def take(batch: Batch, index: torch.Tensor) -> Batch:
    """The micro-batch of `batch`'s samples at `index`."""
    return Batch(batch.x0[index], batch.target_hw, batch.cond.select(index))


def fit(transformer, data: Batch, p: Pretraining, scheduler_cfg: dict) -> list[float]:
    """Full-parameter training of `transformer` on `data` (random micro-batches of p.batch_size); the losses."""
    transformer.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=p.lr, weight_decay=0.0)
    # warm-up over 5% of the steps (at least 2: OneCycleLR needs a warm-up of one step or more)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=p.lr, total_steps=p.steps,
                                                   pct_start=max(0.05, 2 / p.steps))
    t = TrainConfig(mode="full", seed=p.seed)
    generator = torch.Generator().manual_seed(p.seed)
    losses = []
    bar = progress(total=p.steps, desc="pre-training", unit="step", file=sys.stdout)  # minutes on a busy machine
    for _ in range(p.steps):
        index = torch.randperm(data.x0.shape[0], generator=generator)[: p.batch_size]
        loss = loop.forward_loss(transformer, take(data, index), t, generator, scheduler_cfg, torch.float32,
                                 family.transformer_family(transformer))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        bar.update()
    bar.close()
    return losses


def final_loss(losses: list[float]) -> float:
    """The mean loss of the last 20 steps (one step's loss depends on its noise levels)."""
    tail = losses[-20:]
    return sum(tail) / len(tail)


def pretrain(model_dir: str | Path, variant: str, area: int, condition_area: int,
             p: Pretraining | None = None) -> list[float]:
    """Pre-train MODEL/transformer on p.scenes identity edits at `area` (a square side of sqrt(area) px) and
    save it in place; returns the losses. Text-to-image models have no reference to copy: ValueError."""
    p, model_dir = p or Pretraining(), Path(model_dir)
    if family.variant_family(variant).variant(variant).max_references == 0:
        raise ValueError("pretrain: a text-to-image model has no reference to copy; pre-train an edit variant")
    if p.steps < MIN_STEPS:
        raise ValueError(f"pretrain: {p.steps} steps; pre-train for at least {MIN_STEPS} (the demo's base: 300)")
    torch.manual_seed(p.seed)
    with tempfile.TemporaryDirectory() as tmp:
        rows = identity_rows(Path(tmp), variant, p.scenes, round(area**0.5), p.seed)
        data = encode_identity(model_dir, Path(tmp), rows, variant, area, condition_area)
    transformer = transformer_class(model_dir / "transformer").from_pretrained(model_dir, subfolder="transformer",
                                                                               local_files_only=True)
    losses = fit(transformer, data, p, loading.scheduler_config(model_dir))
    transformer.eval().save_pretrained(model_dir / "transformer")
    info_path = model_dir / TINY_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    info["pretrained"] = {"on": "identity edits (target = first reference)", **asdict(p),
                          "first_loss": round(losses[0], 4), "final_loss": round(final_loss(losses), 4)}
    info_path.write_text(json.dumps(info) + "\n")
    return losses
