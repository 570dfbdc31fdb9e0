"""Build a tiny random Qwen-Image-Edit checkpoint and a synthetic edit dataset, offline (train/model/tiny.py).

    python -m train.make_tiny --out DIR [--variant edit|edit_plus|edit_plus_2511|t2i] [--num_samples N] [--size PX]

writes DIR/model (the diffusers layout of Qwen/Qwen-Image-Edit, -2509 or -2511; of Qwen/Qwen-Image for t2i) and
DIR/data (images + metadata.jsonl).
"""

from __future__ import annotations

import argparse

from train.model.tiny import VAE_KINDS, VARIANTS, make_tiny, write_full_size_configs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory to write model/ and data/ into")
    parser.add_argument("--variant", default="edit", choices=VARIANTS)
    parser.add_argument("--num_samples", type=int, default=32)
    parser.add_argument("--size", type=int, default=128, help="side of the square synthetic images, px")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae", default="random", choices=VAE_KINDS,
                        help="random weights, or pooling: an 8x8 average-pooling autoencoder whose decoded images "
                             "show the latents (the demo's)")
    parser.add_argument("--full_size_configs", action="store_true",
                        help="write the released architectures' configs and no weights (load with "
                             "QWEN_EDIT_RANDOM_INIT=1; for GPU measurements)")
    args = parser.parse_args(argv)
    out = make_tiny(args.out, args.variant, args.num_samples, args.size, args.seed, args.vae)
    if args.full_size_configs:
        write_full_size_configs(out / "model")
    print(f"wrote {out / 'model'} and {out / 'data'}")


if __name__ == "__main__":
    main()
