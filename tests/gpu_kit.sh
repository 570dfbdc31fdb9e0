#!/usr/bin/env bash
# Wheels for a CUDA host that has PyTorch, transformers, peft and accelerate but no package index (Python 3.12,
# x86-64): the project's other dependencies, the bench extra (diffsynth, einops, torchao), pytest, and with --fa4
# FlashAttention-4 with its CuTe DSL for CUDA 13. They are packed into folders .kit/1, .kit/2, ... of at most KIT_MB
# MB each (default 58), the base wheels in the first; a wheel larger than a folder is cut into parts
# (NAME.part.00, ...), which tests/gpu_env.sh joins on the host; .kit/1/manifest.txt lists them all.
# Usage (repo root, on a machine with pip access):
#   bash tests/gpu_kit.sh [--fa4]
#   KIT_FROM=DIR KIT_MB=N bash tests/gpu_kit.sh    # pack DIR's wheels (DIR/fa4/: FlashAttention-4's) instead
# Copy or carry every folder to the host (one at a time where a transfer is limited, its files kept between
# transfers), then `source tests/gpu_env.sh` there before the GPU scripts.
set -euo pipefail
cap_mb=${KIT_MB:-58}
fa4=0
[ "${1:-}" = "--fa4" ] && fa4=1
out=.kit
rm -rf "$out" && mkdir -p "$out/wheels"
[ ! -d .git ] || grep -qx '/.kit/' .git/info/exclude 2>/dev/null || echo '/.kit/' >> .git/info/exclude
if [ -n "${KIT_FROM:-}" ]; then  # pack the wheels of this folder (FlashAttention-4's in its fa4/) instead
  cp -r "$KIT_FROM"/. "$out/wheels/"
else
  plat=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
  base=(diffusers==0.42.1 datasets==5.2.0 dill multiprocess hjson pydantic==2.14.3 pydantic-core==2.50.4
        annotated-types typing-inspection typing-extensions importlib-metadata diffsynth==2.1.12 einops
        torchao==0.18.0 pytest pytest-timeout pluggy iniconfig pygments)
  python3 -m pip download -q "${plat[@]}" -d "$out/wheels" "${base[@]}"
  # deepspeed publishes only a source archive; without prebuilt ops its wheel is pure Python
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8
  python3 -m pip wheel -q --no-deps -w "$out/wheels" "$tmp"/deepspeed-*.tar.gz
  rm -rf "$tmp"
  if [ "$fa4" = 1 ]; then  # the versions of the fa4 extra (setup.cfg) and what they need, for torch's CUDA 13 builds
    mkdir -p "$out/wheels/fa4"
    python3 -m pip download -q "${plat[@]}" -d "$out/wheels/fa4" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
      nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
      quack-kernels==0.6.5 apache-tvm-ffi torch-c-dlpack-ext cuda-bindings cuda-pathfinder protobuf
  fi
fi
python3 - "$out" "$cap_mb" <<'PY'
"""First-fit packing of the wheels into numbered folders, base wheels first; a wheel over the cap is cut."""
import shutil
import sys
from pathlib import Path

out, cap = Path(sys.argv[1]), int(sys.argv[2]) * 1_000_000
pieces, manifest = [], []  # (file name, group, bytes); "group wheel parts" lines
for path in sorted((out / "wheels").rglob("*.whl"), key=lambda p: ("fa4" in p.parts, -p.stat().st_size)):
    group = "fa4" if "fa4" in path.parts else "base"
    data = path.read_bytes()
    step = cap // 2 if len(data) > cap else len(data)
    parts = [(f"{path.name}.part.{i:02d}", group, data[o:o + step]) for i, o in enumerate(range(0, len(data), step))]
    pieces += [(path.name, group, data)] if len(parts) == 1 else parts
    manifest.append(f"{group} {path.name} {len(parts) if len(parts) > 1 else 0}")
folders: list[int] = []
for name, group, data in pieces:
    k = next((i for i, used in enumerate(folders) if used + len(data) <= cap), None)
    if k is None:
        folders.append(0)
        k = len(folders) - 1
    folders[k] += len(data)
    dest = out / str(k + 1) / group
    dest.mkdir(parents=True, exist_ok=True)
    (dest / name).write_bytes(data)
shutil.rmtree(out / "wheels")
(out / "1" / "manifest.txt").write_text("\n".join(manifest) + "\n")
for i, used in enumerate(folders):
    print(f"{out}/{i + 1}: {used / 1e6:.1f} MB")
PY
