# Sourced on a CUDA host without a package index, in the repository root: installs the wheels that
# tests/gpu_kit.sh packed into .kit/N, each group (base, fa4) into $KIT_ROOT/GROUP (default /tmp/kit) once every file
# of the group that .kit/1/manifest.txt lists has arrived, and sets the environment the GPU scripts expect. Each
# sourcing first copies what .kit/ holds to $KIT_ROOT/arrived, since a later device call need not keep the folders an
# earlier one carried; so a kit carried in several transfers is sourced after each, and installs what is complete.
#   source tests/gpu_env.sh && OUT=/tmp/speed bash tests/gpu_speed.sh
# KIT_FA4=0 leaves FlashAttention-4 off the import path although installed.
export KIT_ROOT=${KIT_ROOT:-/tmp/kit}
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
python3 - <<'PY'
import os
import shutil
import subprocess
import sys
from pathlib import Path

root = Path(os.environ["KIT_ROOT"])
arrived = root / "arrived"
for f in Path(".kit").glob("*/**/*"):  # N/manifest.txt and N/GROUP/FILE, kept as manifest.txt and GROUP/FILE
    to = arrived / f.relative_to(Path(".kit", f.relative_to(".kit").parts[0]))
    if f.is_file() and (f.name == "manifest.txt" or not to.is_file()):
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, to)
if not (arrived / "manifest.txt").is_file():
    sys.exit("kit: no manifest has arrived (make the kit with tests/gpu_kit.sh and carry .kit/1 first)")
groups: dict[str, list[tuple[str, int]]] = {}
for line in (arrived / "manifest.txt").read_text().split("\n"):
    if line.strip():
        group, name, parts = line.split()
        groups.setdefault(group, []).append((name, int(parts)))
for group, wheels in groups.items():
    target = root / group
    if (target / ".installed").is_file():
        continue
    files = {f"{name}.part.{i:02d}" if parts else name for name, parts in wheels for i in range(max(parts, 1))}
    found = {p.name: p for p in (arrived / group).glob("*") if p.name in files}
    if len(found) < len(files):
        print(f"kit: {group} waits for {len(files) - len(found)} of its {len(files)} files")
        continue
    joined = root / "wheels" / group
    joined.mkdir(parents=True, exist_ok=True)
    for name, parts in wheels:
        names = [f"{name}.part.{i:02d}" for i in range(parts)] if parts else [name]
        (joined / name).write_bytes(b"".join(found[n].read_bytes() for n in names))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
           str(target), *(str(joined / name) for name, _ in wheels)]
    if subprocess.run(cmd).returncode == 0:
        (target / ".installed").touch()
        print(f"kit: {group} installed ({len(wheels)} wheels)")
PY
export PYTHONPATH=$KIT_ROOT/base:$PWD
if [ -f "$KIT_ROOT/fa4/.installed" ] && [ "${KIT_FA4:-1}" != 0 ]; then
  export PYTHONPATH=$PYTHONPATH:$KIT_ROOT/fa4:$KIT_ROOT/fa4/nvidia_cutlass_dsl/dsl_packages
fi
export PATH=$KIT_ROOT/base/bin:$PATH
if ! command -v python > /dev/null; then  # the scripts call `python`: a new file, never one written through a link
  mkdir -p "$KIT_ROOT/bin" && rm -f "$KIT_ROOT/bin/python"
  printf '#!/bin/sh\nexec python3 "$@"\n' > "$KIT_ROOT/bin/python"
  chmod +x "$KIT_ROOT/bin/python" && export PATH=$KIT_ROOT/bin:$PATH
fi
python3 -c "from importlib.metadata import version as v; import torch; print('kit: torch', torch.__version__,
'diffusers', v('diffusers'), 'deepspeed', v('deepspeed'), 'cuda', torch.cuda.is_available())" 2>&1 | tail -1
