"""Entry point of training.

    deepspeed --num_gpus N train/main.py --ds_config ds_configs/zero2.json --model M --data D --output_dir O


Also runs as one process without the launcher (`python train/main.py ...`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import train.runtime.quiet  # noqa: F401  (first: it quiets the libraries before they are imported)
from model_parallel.plan import check_parallel
from train import config
from train.data import latent_cache, pairs
from train.model import family, lora_io, streaming, support
from train.plan.explain import PlanError
from train.runtime import checkpoint, engine, outdir, preempt, write_failures
from train.runtime.console import prefix_rank_output, print0
from train.trainer import build, loop


def main(argv: list[str] | None = None) -> int:
    """Returns the process exit code: 0 done, 2 bad configuration, data, cache or resume point, 1 a stop the run
    decided (too many non-finite steps) or a failed write."""
    prefix_rank_output()
    args = config.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        engine.check_processes(rank)
        cfg = config.load_config(args, world_size, has_gpu=torch.cuda.is_available(),
                                 num_gpus=torch.cuda.device_count(), check_parallel=check_parallel)
    except (engine.TooManyProcessesError, config.ConfigError) as e:
        return engine.refuse_early(e, rank)
    try:  # fail before any process starts
        fam, _ = family.detect(cfg.project.model.path, cfg.project.model.variant)
        support.check_supported(fam, cfg.project, support.TRAIN, gpu=torch.cuda.is_available())
    except family.ModelError as e:
        return engine.refuse_early(e, rank)
    cfg = build.with_family_defaults(cfg, fam)
    try:
        if cfg.project.parallel.mode == "model_parallel":  # stages in separate processes: model_parallel/
            import model_parallel

            return model_parallel.main(cfg, args.resume, args.overwrite)
        d = engine.init_distributed(cfg.project.parallel.collective_timeout_s)
    except engine.PortInUseError as e:  # raised before the ranks connect (model_parallel: by its worlds)
        return engine.refuse_early(e, rank)
    code = 0
    try:
        with outdir.claim(cfg.project.output.dir, args.resume is not None, args.overwrite,
                          outdir.is_holder(cfg.deepspeed, d)):
            build.run(cfg, d, args.resume, args.overwrite)
    except (pairs.BadRowsError, latent_cache.CacheError, checkpoint.ResumeError, lora_io.LoraFileError,
            outdir.OutputDirError, PlanError, streaming.WeightsError) as e:  # on all ranks
        print0(f"error: {e}", rank=d.rank, file=sys.stderr)
        code = 2
    except loop.NonFiniteError as e:  # on all ranks at the same step
        print0(f"error: {e}", rank=d.rank, file=sys.stderr)
        code = 1
    except preempt.Preempted as e:  # on all ranks, after their save
        print0(str(e), rank=d.rank, file=sys.stderr)
        code = preempt.EXIT_CODE
    except checkpoint.SaveError as e:  # perhaps on some ranks only: no collective teardown, the launcher ends the rest
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # any other write that a full or unwritable disk stopped: the same, on this rank
        failure = write_failures.disk_failure(e, cfg.project.output.dir)
        if failure is None:
            raise
        print(f"error: {failure}", file=sys.stderr, flush=True)
        return 1
    engine.teardown()
    return code


if __name__ == "__main__":
    engine.exit_with(main)
