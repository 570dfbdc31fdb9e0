"""tests/gpu_kit.sh packs wheels into size-capped folders, cutting a wheel larger than a folder, and
tests/gpu_env.sh, sourced on the host, installs each group only once all of its files have arrived (the kit carried
in several transfers, each of which may find the earlier ones' folders gone), joins the cut wheel byte for byte, and
puts FlashAttention-4's group on the import path unless KIT_FA4=0. Pure-Python wheels built here stand in for the
real ones; pip installs them offline."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def make_wheel(folder: Path, name: str, payload: bytes) -> Path:
    """A py3-none-any wheel of package `name` whose data.bin holds `payload` (stored, so its size stays)."""
    dist = f"{name}-0.1.dist-info"
    files = {
        f"{name}/__init__.py": "from pathlib import Path\nSIZE = (Path(__file__).parent / 'data.bin').stat().st_size\n",
        f"{name}/data.bin": payload,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, content in files.items():
        data = content if isinstance(content, bytes) else content.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for path, content in files.items():
            z.writestr(path, content)
    return wheel


def source_env(root: Path, kit_root: Path, probe: str, **env: str) -> subprocess.CompletedProcess:
    """`source tests/gpu_env.sh`, then run python3 -c `probe`, in `root` (which holds .kit/)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # python3 is this interpreter
    script = f'source "{TESTS / "gpu_env.sh"}" && python3 -c "{probe}"'
    return subprocess.run(["bash", "-c", script], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": path, "KIT_ROOT": str(kit_root), **env})


def test_kit_packs_cuts_and_installs_in_transfers(tmp_path):
    wheels = tmp_path / "wheels"
    big = make_wheel(wheels / "fa4", "kit_big", os.urandom(2_300_000))  # over the 1 MB cap: cut into parts
    make_wheel(wheels / "fa4", "kit_small_fa4", b"x" * 10)
    make_wheel(wheels, "kit_base", b"y" * 300_000)
    root = tmp_path / "repo"
    root.mkdir()
    packed = subprocess.run(["bash", str(TESTS / "gpu_kit.sh")], cwd=root, capture_output=True, text=True,
                            env={**os.environ, "KIT_FROM": str(wheels), "KIT_MB": "1"}, timeout=120)
    assert packed.returncode == 0, packed.stderr
    folders = sorted(p.name for p in (root / ".kit").iterdir())
    assert folders == ["1", "2", "3"], packed.stdout
    for folder in folders:
        assert sum(f.stat().st_size for f in (root / ".kit" / folder).rglob("*") if f.is_file()) <= 1_000_000
    assert (root / ".kit" / "1" / "base" / "kit_base-0.1-py3-none-any.whl").is_file()  # the base group comes first
    parts = sorted(p.name for p in (root / ".kit").glob("*/fa4/kit_big-0.1-py3-none-any.whl.part.*"))
    assert len(parts) == 5 and not list((root / ".kit").glob("*/fa4/kit_big-0.1-py3-none-any.whl"))

    # the first transfer: the base group is complete, FlashAttention-4's is not
    kit_root = tmp_path / "host"
    held = root / "held"
    held.mkdir()
    for folder in ("2", "3"):
        shutil.move(root / ".kit" / folder, held / folder)
    probe = "import kit_base, sys; print(kit_base.SIZE); import kit_big"
    first = source_env(root, kit_root, probe)
    assert "kit: base installed (1 wheels)" in first.stdout, first.stdout + first.stderr
    assert "kit: fa4 waits for" in first.stdout
    assert "300000" in first.stdout and "No module named 'kit_big'" in first.stderr

    # the rest arrives, and the first transfer's folder is gone (a device call keeps only what it carries): only
    # the fa4 group installs now, from the files each sourcing kept; the cut wheel is the original, byte for byte
    shutil.rmtree(root / ".kit" / "1")
    for folder in ("2", "3"):
        shutil.move(held / folder, root / ".kit" / folder)
    second = source_env(root, kit_root, "import kit_big; print(kit_big.SIZE)")
    assert "kit: fa4 installed (2 wheels)" in second.stdout, second.stdout + second.stderr
    assert "base installed" not in second.stdout
    assert second.stdout.split("\n")[-2] == "2300000"
    assert (kit_root / "wheels" / "fa4" / big.name).read_bytes() == big.read_bytes()
    off = source_env(root, kit_root, "import kit_big", KIT_FA4="0")
    assert off.returncode != 0 and "No module named 'kit_big'" in off.stderr
