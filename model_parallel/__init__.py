"""The model-parallel mode: frozen encoders on one GPU, the transformer being trained on the next (or cut over
several), micro-batches pipelined between them; pipelines replicate over the remaining GPUs.

    plan.py       which process runs which stage on which device (pure, validated)
    worlds.py     process groups: one world per role, gloo links along each pipeline, DeepSpeed's mpu
    transport.py  messages between stages (shape header, then tensors)
    stages.py     the encoder stage's loop and the decoder's receiving source (the bounded queue)
    validation.py validation images: conditioning recorded on the encoder stage, rendered on the decoder
    runner.py     the entry point train/main.py dispatches to
See docs/model_parallel.md.
"""


def main(cfg, resume: str | None, overwrite: bool = False) -> int:
    """Run this process's stage of the model-parallel mode; returns the process exit code."""
    from model_parallel.runner import main as run

    return run(cfg, resume, overwrite)
