"""Build a tiny random checkpoint and a synthetic edit dataset, offline (train/model/qwen_image/tiny.py,
train/model/qwen_image21/tiny.py).

    python -m train.make_tiny --out DIR [--variant edit|edit_plus|edit_plus_2511|t2i|qwen_image_21] [--num_samples N]
        [--size PX] [--demo | --vae random|pooling --transformer tests|demo --pretrain_steps N] [--references N]
        [--full_size_configs [--num_layers N]]

writes DIR/model (the diffusers layout of Qwen/Qwen-Image-Edit, -2509 or -2511; of Qwen/Qwen-Image for t2i; of
Qwen-Image-2.1 for qwen_image_21) and DIR/data (images + metadata.jsonl; qwen_image_21's rows have 0, 1 or 2
references, some RGBA, or all --references N). The demo's model is `--demo`: `--vae pooling --transformer
demo --pretrain_steps 300`.
"""

from __future__ import annotations

import argparse

import train.runtime.quiet  # noqa: F401  (first: it quiets the libraries before they are imported)
from train.model.qwen_image import tiny
from train.model.qwen_image.tiny import TRANSFORMER_SIZES, VAE_KINDS, VARIANTS
from train.model.qwen_image21 import tiny as tiny21
from train.model.qwen_image21.variant import VARIANT as QWEN_IMAGE_21
from train.runtime.console import prefix_rank_output
from train.trainer.pretrain import MIN_STEPS, Pretraining, final_loss, pretrain


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its combinations checked (argparse's usage error names the flag and the fix)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory to write model/ and data/ into")
    parser.add_argument("--variant", default="edit", choices=[*VARIANTS, QWEN_IMAGE_21])
    parser.add_argument("--num_samples", type=int, default=32)
    parser.add_argument("--size", type=int, default=128, help="side of the square synthetic images, px")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae", default="random", choices=VAE_KINDS,
                        help="random weights, or pooling: an 8x8 average-pooling autoencoder whose decoded images "
                             "show the latents (the demo's)")
    parser.add_argument("--transformer", default="tests", choices=list(TRANSFORMER_SIZES),
                        help="the tests' tiny transformer (width 64), or the demo's (width 128, finer RoPE)")
    parser.add_argument("--demo", action="store_true",
                        help="the demo's base, which a LoRA trained on one's own data can change visibly: "
                             "--vae pooling --transformer demo --pretrain_steps 300 (not pre-trained for t2i, "
                             "which has no reference to copy)")
    parser.add_argument("--pretrain_steps", type=int, default=0,
                        help="pre-train the transformer for N full-parameter steps on identity edits (target = "
                             "reference), as the demo's base is (train/trainer/pretrain.py); 0: random; edit "
                             "variants only")
    parser.add_argument("--references", type=int, default=None,
                        help="qwen_image_21 only: every row with this many references (0-10, 0 = text-to-image), "
                             "for a benchmark of one slot layout; default: rows of 0, 1 and 2 references")
    parser.add_argument("--full_size_configs", action="store_true",
                        help="write the released architectures' configs and no weights (load with "
                             "QWEN_EDIT_RANDOM_INIT=1; for GPU measurements)")
    parser.add_argument("--num_layers", type=int, default=0,
                        help="with --full_size_configs: the transformer's number of blocks at the released width "
                             "(0 = the released 60; 32 for Qwen-Image-2.1), for the deepest full fine-tune a memory "
                             "budget fits")
    args = parser.parse_args(argv)
    if args.demo and args.variant == QWEN_IMAGE_21:
        parser.error(f"--demo builds Qwen-Image's pre-trained tiny base; --variant {QWEN_IMAGE_21}'s tiny model is "
                     "random: leave --demo out")
    if args.demo:
        args.vae, args.transformer = "pooling", "demo"
        args.pretrain_steps = args.pretrain_steps or (0 if args.variant == "t2i" else Pretraining().steps)
    if args.num_layers and not args.full_size_configs:
        parser.error("--num_layers sets the full-size transformer's depth; add --full_size_configs")
    if args.num_layers < 0:
        parser.error(f"--num_layers must be 0 (the released depth) or a number of blocks, not {args.num_layers}")
    if args.pretrain_steps and (args.pretrain_steps < MIN_STEPS or args.variant == "t2i"):
        parser.error(f"--pretrain_steps must be 0 or at least {MIN_STEPS}, and 0 for --variant t2i (a "
                     "text-to-image model has no reference to copy)")
    if args.pretrain_steps and args.full_size_configs:
        parser.error("--pretrain_steps trains the tiny weights that --full_size_configs removes; use one of them")
    if args.variant == QWEN_IMAGE_21 and (args.vae, args.transformer, args.pretrain_steps) != ("random", "tests", 0):
        parser.error("--vae, --transformer and --pretrain_steps build Qwen-Image's tiny models; leave them out for "
                     f"--variant {QWEN_IMAGE_21}")
    if args.references is not None and (args.variant != QWEN_IMAGE_21 or not 0 <= args.references <= 10):
        parser.error(f"--references is 0-10 and for --variant {QWEN_IMAGE_21} only (the other variants' rows have "
                     "their variant's references)")
    return args


def main(argv: list[str] | None = None) -> None:
    prefix_rank_output()  # off a terminal, the libraries' own bars (writing the model's shards) stay out of the log
    args = parse_args(argv)
    if args.variant == QWEN_IMAGE_21:
        out = tiny21.make_tiny(args.out, args.variant, args.num_samples, args.size, args.seed, args.references)
    else:
        out = tiny.make_tiny(args.out, args.variant, args.num_samples, args.size, args.seed, args.vae,
                             args.transformer)
    if args.pretrain_steps:
        print(f"pre-training {out / 'model' / 'transformer'} for {args.pretrain_steps} steps on identity edits "
              "(target = reference) ...", flush=True)
        losses = pretrain(out / "model", args.variant, args.size**2, (args.size // 2) ** 2,
                          Pretraining(steps=args.pretrain_steps))
        print(f"pre-trained {out / 'model' / 'transformer'}: loss {losses[0]:.2f} -> {final_loss(losses):.3f}")
    if args.full_size_configs:
        builder = tiny21 if args.variant == QWEN_IMAGE_21 else tiny
        builder.write_full_size_configs(out / "model", args.num_layers or None)
    print(f"wrote {out / 'model'} and {out / 'data'}")


if __name__ == "__main__":
    main()
