"""OUT/loss.png: the logged loss against the step, drawn with Pillow (matplotlib is not a dependency)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 x a power of ten apart) inside [lo, hi], for an axis's labels."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [round(k * step, 12) for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def _loss_points(metrics_path: Path) -> list[tuple[int, float]]:
    """(step, loss) of every record with a finite loss; lines that are no record (a torn write) are skipped."""
    points = []
    for line in metrics_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        loss = record.get("loss") if isinstance(record, dict) else None
        if isinstance(loss, (int, float)) and math.isfinite(loss) and isinstance(record.get("step"), int):
            points.append((record["step"], float(loss)))
    return points


_PLOT_MARGINS = (72, 20, 32, 44)  # left, right, top, bottom: px around the plot area of loss.png


def _draw_axes(draw, size: tuple[int, int], steps: tuple[float, float], losses: tuple[float, float], xy) -> None:
    """The frame, grey grid lines at round values of both axes with their labels, and the axis names."""
    width, height = size
    left, right, top, bottom = _PLOT_MARGINS
    for loss in nice_ticks(*losses):
        y = xy(steps[0], loss)[1]
        draw.line([left, y, width - right, y], fill=(225, 225, 225))
        draw.text((4, y - 6), f"{loss:.4g}", fill="black")
    for step in nice_ticks(*steps):
        x = xy(step, losses[0])[0]
        draw.line([x, top, x, height - bottom], fill=(225, 225, 225))
        draw.text((x - 3 * len(f"{step:g}"), height - bottom + 4), f"{step:g}", fill="black")
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    draw.text(((left + width - right) // 2 - 12, height - 18), "step", fill="black")
    draw.text((4, top - 16), "loss", fill="black")


def plot_loss(metrics_path: str | Path, out_path: str | Path, size: tuple[int, int] = (640, 360)) -> Path | None:
    """OUT/loss.png from metrics.jsonl: the logged loss (each record the mean of its window) against the step, on
    round-valued grid lines; None when no step was logged. Drawn with Pillow: matplotlib is not a dependency."""
    from PIL import Image, ImageDraw

    points = _loss_points(Path(metrics_path))
    if not points:
        return None
    width, height = size
    left, right, top, bottom = _PLOT_MARGINS
    (s0, s1), (l0, l1) = ((min(v), max(v)) for v in zip(*points, strict=True))
    s1 = max(s1, s0 + 1)
    pad = (l1 - l0) * 0.05 or abs(l0) * 0.05 or 1e-12  # a little room above and below the curve
    l0, l1 = l0 - pad, l1 + pad

    def xy(step: float, loss: float) -> tuple[float, float]:
        return (left + (step - s0) / (s1 - s0) * (width - left - right),
                height - bottom - (loss - l0) / (l1 - l0) * (height - top - bottom))

    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    _draw_axes(draw, size, (s0, s1), (l0, l1), xy)
    if len(points) > 1:
        draw.line([xy(*p) for p in points], fill=(40, 80, 220), width=2)
    else:
        x, y = xy(*points[0])
        draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=(40, 80, 220))
    (first_step, first), (last_step, last) = points[0], points[-1]
    draw.text((left + 40, 8), f"training loss: {first:.4g} at step {first_step} -> {last:.4g} at step {last_step}",
              fill="black")
    out_path = Path(out_path)
    image.save(out_path)
    return out_path


def write_loss_curve(out_dir: str | Path) -> Path | None:
    """OUT/loss.png from OUT/metrics.jsonl, its path printed. The runs call it on the way out of training, whether
    it finished, was preempted or stopped on an error (a diverging loss is worth a look), so nothing here raises."""
    metrics_path = Path(out_dir) / "metrics.jsonl"
    try:
        curve = plot_loss(metrics_path, Path(out_dir) / "loss.png") if metrics_path.is_file() else None
    except OSError as e:  # a full disk or a read-only directory: the run's own outcome matters more
        print(f"loss curve: not written ({e})", flush=True)
        return None
    print(f"loss curve: {curve}" if curve else "loss curve: no step was logged", flush=True)
    return curve
