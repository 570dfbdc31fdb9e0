"""Per-GPU memory, utilisation, SM clock, power and temperature, sampled by nvidia-ml-py in a background thread.

One monitor per node (local rank 0) samples every GPU the node's processes see (CUDA_VISIBLE_DEVICES) every
`interval_s`: the samples go to a jsonl time series, `window()` summarises those since its last call (training
merges it into each metrics record), and `stop()` returns the run's summary (peak memory, mean utilisation).
Without nvidia-ml-py, a driver or GPUs, the monitor does nothing and says nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

BUSY_PCT = 50.0  # a sample with at least this utilisation is under load: its clock and power go into the summary


def _load_nvml():
    """The initialised pynvml module, or None where there is none, no driver or no GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            pynvml.nvmlShutdown()
            return None
    except pynvml.NVMLError:
        return None
    return pynvml


def _visible_handles(nvml) -> list[tuple[int, object]]:
    """(cuda index, nvml handle) of the GPUs this process sees, in CUDA's order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None \
        else [str(i) for i in range(nvml.nvmlDeviceGetCount())]
    handles = []
    for cuda_index, ident in enumerate(ids):
        try:
            handle = (nvml.nvmlDeviceGetHandleByIndex(int(ident)) if ident.isdigit()
                      else nvml.nvmlDeviceGetHandleByUUID(ident))
        except (nvml.NVMLError, ValueError):
            break  # CUDA stops enumerating at the first invalid entry too
        handles.append((cuda_index, handle))
    return handles


class GpuMonitor:
    """Samples the visible GPUs every `interval_s` seconds until `stop()`; a no-op without GPUs (`active` False)."""

    def __init__(self, interval_s: float, path: str | Path | None = None, nvml=None, node: int = 0):
        self.interval_s, self.node = interval_s, node
        self.nvml = (nvml or _load_nvml()) if interval_s > 0 else None
        self.handles = _visible_handles(self.nvml) if self.nvml is not None else []
        self.active = bool(self.handles)
        self.path = Path(path) if path is not None and self.active else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._window: dict[int, list[tuple[float, float]]] = {}
        self._totals: dict[int, dict] = {}
        self._thread = None

    def start(self) -> GpuMonitor:
        if self.active:
            self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        file = open(self.path, "a") if self.path is not None else None
        try:
            while True:
                records = self.sample()
                if file is not None and records:
                    file.write("".join(json.dumps(r) + "\n" for r in records))
                    file.flush()
                if self._stop.wait(self.interval_s):
                    return
        finally:
            if file is not None:
                file.close()

    def sample(self) -> list[dict]:
        """One reading of every visible GPU (also called by the thread); GPUs that fail to answer are left out."""
        now, records = time.time(), []
        for index, handle in self.handles:
            try:
                memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                utilization = float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except self.nvml.NVMLError:
                continue
            used_gb, total_gb = memory.used / 1e9, memory.total / 1e9
            record = {"time": now, "node": self.node, "gpu": index, "memory_used_gb": used_gb,
                      "memory_total_gb": total_gb, "utilization_pct": utilization, **self._clocks(handle)}
            records.append(record)
            with self._lock:
                self._window.setdefault(index, []).append(record)
                t = self._totals.setdefault(index, {"peak": 0.0, "util_sum": 0.0, "n": 0, "total_gb": total_gb,
                                                    "busy": {}})
                t["peak"], t["util_sum"], t["n"] = max(t["peak"], used_gb), t["util_sum"] + utilization, t["n"] + 1
                if utilization >= BUSY_PCT:  # an idle GPU lowers its clock on purpose: only busy samples count
                    for key in ("sm_clock_mhz", "power_w"):
                        if key in record:  # [sum, count] of the busy samples' readings
                            total = t["busy"].setdefault(key, [0.0, 0])
                            total[0], total[1] = total[0] + record[key], total[1] + 1
        return records

    def _max_sm_clock_mhz(self, handle) -> float | None:
        """The GPU's maximum SM clock (nvml's max clock info), None where the driver does not give it."""
        try:
            return float(self.nvml.nvmlDeviceGetMaxClockInfo(handle, self.nvml.NVML_CLOCK_SM))
        except (self.nvml.NVMLError, AttributeError):
            return None

    def _clocks(self, handle) -> dict:
        """The SM clock (MHz), board power (W) and temperature (C) of one GPU; a reading the driver or the GPU does
        not give is left out. A clock below the GPU's maximum under load means power or thermal throttling, which
        makes steps slower with nothing in the program changed."""
        nvml, out = self.nvml, {}
        for key, read in (("sm_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
                          ("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000),
                          ("temperature_c", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))):
            try:
                out[key] = float(read())
            except (nvml.NVMLError, AttributeError):
                continue
        return out

    def window(self) -> dict:
        """Over the samples since the last call: {'gpuI_memory_gb': peak used, 'gpuI_utilization_pct': mean,
        'gpuI_sm_clock_mhz': lowest, 'gpuI_power_w': mean, 'gpuI_temperature_c': highest} (the last three where the
        GPU reports them)."""
        with self._lock:
            window, self._window = self._window, {}
        out = {}
        for index, samples in sorted(window.items()):
            out[f"gpu{index}_memory_gb"] = max(s["memory_used_gb"] for s in samples)
            out[f"gpu{index}_utilization_pct"] = sum(s["utilization_pct"] for s in samples) / len(samples)
            for key, summarise in (("sm_clock_mhz", min), ("power_w", statistics.fmean), ("temperature_c", max)):
                values = [s[key] for s in samples if key in s]
                if values:
                    out[f"gpu{index}_{key}"] = summarise(values)
        return out

    def summary(self) -> list[dict]:
        """Per GPU over the whole run: peak memory used, total memory, mean utilisation, number of samples; where the
        GPU reports them, its mean SM clock and power over the busy samples (utilisation >= BUSY_PCT) and its
        maximum SM clock."""
        handles = dict(self.handles)
        with self._lock:
            out = []
            for i, t in sorted(self._totals.items()):
                entry = {"node": self.node, "gpu": i, "peak_memory_used_gb": round(t["peak"], 3),
                         "memory_total_gb": round(t["total_gb"], 3),
                         "mean_utilization_pct": round(t["util_sum"] / t["n"], 1), "samples": t["n"]}
                for key, (total, count) in t["busy"].items():
                    entry[f"busy_{key}"] = round(total / count, 1)
                top = self._max_sm_clock_mhz(handles[i]) if "sm_clock_mhz" in t["busy"] and i in handles else None
                if top is not None:
                    entry["max_sm_clock_mhz"] = top
                out.append(entry)
            return out

    def stop(self) -> list[dict]:
        """End the sampling thread (after one last sample) and return `summary()`."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample()
        return self.summary()


def start_monitor(out_dir: str | Path, interval_s: float, local_rank: int, node: int = 0,
                  name: str = "gpu_metrics") -> GpuMonitor:
    """The node's monitor on local rank 0 (writing OUT/gpu_metrics.jsonl, or gpu_metrics_nodeN.jsonl on node N > 0);
    an inactive one on the other ranks."""
    if local_rank != 0:
        return GpuMonitor(0)
    file = f"{name}.jsonl" if node == 0 else f"{name}_node{node}.jsonl"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return GpuMonitor(interval_s, Path(out_dir) / file, node=node).start()


def gather_summaries(summary: list[dict]) -> list[dict]:
    """Every node's summary, on every rank (a collective when a process group is up)."""
    from train.runtime import engine

    return [entry for part in engine.all_gather_objects(summary) for entry in part]


def node_rank() -> int:
    """This node's index under the deepspeed launcher (CROSS_RANK), torchrun (GROUP_RANK) or 0."""
    return int(os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", "0")))
