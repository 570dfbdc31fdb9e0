"""Pairs whose reference cannot land pixel for pixel on its target's resized lattice: found by the pre-flight
(train/data/pairs.py) from the image sizes it read, named on the console (the first ten) and listed in full in
misaligned_rows.txt next to the bad-rows report. They still train: a reframing edit (F2P's face crop -> photo) is
legitimate; otherwise the model learns the shift or zoom as part of the edit."""

from __future__ import annotations

from pathlib import Path

from train.data.rows import Row
from train.model.interface import ModelFamily
from train.runtime.console import print0


def report_alignment(found: list[str], report_path: Path | None, rank: int) -> None:
    """Name the pairs that cannot align on the console; rank 0 writes all of them next to the bad-rows report
    (`report_path`), and removes an earlier run's list when every pair aligns."""
    path = None if report_path is None else report_path.parent / MISALIGNED_REPORT
    if path is not None and rank == 0:
        if found:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(found) + "\n")
        else:
            path.unlink(missing_ok=True)
    for line in alignment_report(found, path):
        print0(f"data: {line}", rank=rank)


ALIGN_TOLERANCE = 0.01  # aspect ratios this far apart shift the far edge by 1% of the side (10 px at 1024)
MISALIGNED_REPORT = "misaligned_rows.txt"  # next to the bad-rows report: every pair that cannot align


def misfit(
    target: tuple[int, int], reference: tuple[int, int], area: int | None, steps: int = 0, *, fam: ModelFamily
) -> str | None:
    """Why a reference (width, height) cannot land pixel for pixel on its target's resized lattice, or None.

    Both are resized to about `area` keeping their own aspect ratio, sides rounded to multiples of 32 (the
    pipelines' sizing; at inference the output takes the reference's size). They align when the ratios agree and
    the two roundings give one size: a same-size pair always does, and so does a reference of the same ratio at
    another resolution. Ratios more than ALIGN_TOLERANCE apart stretch one against the other; ratios that round
    to different sizes (near a rounding step) differ by one 32-px step in a side, a shift of up to 32 px at the
    far edge. With `steps` (data.bucket_aspect_steps) the sizes are those of the snapped ratios; `fam` sizes
    them (the model's family)."""
    ratio = (reference[0] / reference[1]) / (target[0] / target[1]) - 1
    if abs(ratio) > ALIGN_TOLERANCE:
        return f"aspect ratio {ratio:+.1%} off the target's"
    if area is None:
        return None
    resized, target_resized = fam.image_size(area, *reference, steps), fam.image_size(area, *target, steps)
    if resized != target_resized:
        return (
            f"resizes to {resized[0]}x{resized[1]}, the target to {target_resized[0]}x{target_resized[1]} "
            "(their aspect ratios round to different sizes)"
        )
    return None


def misaligned(rows: list[Row], fam: ModelFamily, area: int | None = None, steps: int = 0) -> list[str]:
    """One line per row whose target and a reference cannot align (see `misfit`; the lattice is compared when
    `area`, data.area, is given): the model would learn a shift or zoom as part of the edit. Expected when the
    edit changes the framing (F2P: a face crop -> a full photo); otherwise crop or pad the pair to one size."""
    found = []
    for row in rows:
        if not row.sizes:  # unchecked here: another rank's share when no process group is up
            continue
        (tw, th), *refs = row.sizes
        for k, (name, size) in enumerate(zip(row.references, refs, strict=True)):
            why = misfit((tw, th), size, area, steps, fam=fam)
            if why:
                found.append(
                    f"row {row.line} ({row.target} {tw}x{th}): reference {k + 1} {name} {size[0]}x{size[1]}: {why}"
                )
    return found


def alignment_report(found: list[str], report_path: Path | None, limit: int = 10) -> list[str]:
    """Console lines naming the first `limit` misaligned pairs and where the full list is; [] when none."""
    if not found:
        return []
    where = f"; all listed in {report_path}" if report_path is not None else ""
    head = (
        f"{len(found)} reference(s) cannot align pixel for pixel with their target (aspect ratios more than "
        f"{ALIGN_TOLERANCE:.0%} apart, or resized to different sizes): the model learns the shift or zoom as "
        "part of the edit. Expected when the edit reframes (F2P's face crop -> photo); otherwise crop or pad "
        f"both images of a pair to one size{where}:"
    )
    more = [f"  ... and {len(found) - limit} more"] if len(found) > limit else []
    return [head, *(f"  {f}" for f in found[:limit]), *more]
