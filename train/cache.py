"""Build the latent/embedding cache of a training config (train/data/latent_cache.py), so that training loads only
the transformer.

    python -m train.cache --ds_config CFG --model M --data D --output_dir O             # one process
    deepspeed --num_gpus N train/cache.py --ds_config CFG --model M --data D --output_dir O   # N ranks

(the same arguments as train/main.py). `qwen_edit.data.cache = "auto"` runs the same stage inside
train/main.py when the cache is missing. The cache lives in `data.cache_dir` ("" = OUTPUT/cache).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (the deepspeed launcher): make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import train.runtime.quiet  # noqa: F401  (first: it quiets the libraries before they are imported)
from model_parallel.plan import check_parallel
from train import config
from train.data import pairs
from train.data.latent_cache import CacheError, cache_dir, ensure, read_index
from train.model import family, support
from train.runtime import engine
from train.runtime.console import prefix_rank_output, print0
from train.trainer import build

DESCRIPTION = (
    "Build the latent and prompt-embedding cache of a training run of Qwen-Image-Edit (v1, 2509, 2511) or Qwen-Image "
    "(2512) (the arguments of train/main.py), so that training loads only the transformer"
)


def main(argv: list[str] | None = None) -> int:
    """Build (or rebuild, when stale) the cache for a training config; 0 done, 2 bad configuration or data."""
    prefix_rank_output()
    args = config.parse_args(argv, description=DESCRIPTION)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        engine.check_processes(rank)
        cfg = config.load_config(args, world_size, has_gpu=torch.cuda.is_available(), check_parallel=check_parallel)
    except (engine.TooManyProcessesError, config.ConfigError) as e:
        return engine.refuse_early(e, rank)
    try:
        d = engine.init_distributed(cfg.project.parallel.collective_timeout_s)
    except engine.PortInUseError as e:
        return engine.refuse_early(e, rank)
    code = 0
    try:
        fam, variant = family.detect(cfg.project.model.path, cfg.project.model.variant)
        support.check_supported(fam, cfg.project, support.CACHE)
        rows, loader = build.build_data(cfg, d, variant)  # training's data pipeline: the cache holds what it reads
        before = read_index(cache_dir(cfg))
        index = ensure(cfg, d, variant, rows, loader.dataset, rebuild_stale=True)
        verb = "up to date" if index == before else "written"
        print0(f"cache {verb}: {cache_dir(cfg)} ({index['num_samples']} samples)", rank=d.rank)
    except (pairs.BadRowsError, CacheError, family.ModelError) as e:
        print0(f"error: {e}", rank=d.rank, file=sys.stderr)
        code = 2
    engine.teardown()
    return code


if __name__ == "__main__":
    engine.exit_with(main)
