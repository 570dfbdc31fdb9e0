"""train/runtime/gpumon.py with a fake nvml module: sampling, windows, summary, visible devices, absent GPUs."""

from __future__ import annotations

import json
import time
import types

from train.runtime import gpumon
from train.runtime.record import Metrics


class FakeNvml(types.SimpleNamespace):
    """The pynvml calls the monitor makes; GPU i uses (i + 1) GB more each sample and is (10 * i + step) % busy."""

    class NVMLError(Exception):
        pass

    def __init__(self, count: int = 2, fail_index: int | None = None):
        super().__init__(count=count, calls=0, fail_index=fail_index)

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index):
        if index >= self.count:
            raise self.NVMLError("invalid index")
        return {"index": index, "samples": 0}

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return {"index": int(uuid.rsplit("-", 1)[1]), "samples": 0}

    def nvmlDeviceGetMemoryInfo(self, handle):
        if handle["index"] == self.fail_index:
            raise self.NVMLError("GPU is lost")
        handle["samples"] += 1
        return types.SimpleNamespace(used=handle["samples"] * (handle["index"] + 1) * 1e9, total=80e9)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=10 * handle["index"] + handle["samples"])


class ClockedNvml(FakeNvml):
    """FakeNvml whose GPUs also report an SM clock that drops 100 MHz per sample from 1980, a power of 500 W plus
    10 W per sample, and a temperature of 40 C plus 5 per sample; GPU 1 reports no temperature."""

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

    def nvmlDeviceGetClockInfo(self, handle, kind):
        assert kind == self.NVML_CLOCK_SM
        return 1980 - 100 * (handle["samples"] - 1)

    def nvmlDeviceGetPowerUsage(self, handle):
        return (500 + 10 * handle["samples"]) * 1000  # milliwatts

    def nvmlDeviceGetTemperature(self, handle, sensor):
        if handle["index"] == 1:
            raise self.NVMLError("not supported")
        return 40 + 5 * handle["samples"]

    def nvmlDeviceGetMaxClockInfo(self, handle, kind):
        assert kind == self.NVML_CLOCK_SM
        return 1980


def test_samples_window_and_summary(monkeypatch):
    """Direct samples: the window holds peak memory and mean utilisation since its last read; the summary all."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = gpumon.GpuMonitor(1.0, nvml=FakeNvml())
    assert monitor.active
    monitor.sample()
    monitor.sample()
    assert monitor.window() == {"gpu0_memory_gb": 2.0, "gpu0_utilization_pct": 1.5,
                                "gpu1_memory_gb": 4.0, "gpu1_utilization_pct": 11.5}
    monitor.sample()
    assert monitor.window()["gpu1_memory_gb"] == 6.0
    assert monitor.window() == {}
    summary = monitor.stop()
    assert summary == [
        {"node": 0, "gpu": 0, "peak_memory_used_gb": 3.0, "memory_total_gb": 80.0, "mean_utilization_pct": 2.0,
         "samples": 3},
        {"node": 0, "gpu": 1, "peak_memory_used_gb": 6.0, "memory_total_gb": 80.0, "mean_utilization_pct": 12.0,
         "samples": 3},
    ]


def test_the_window_has_the_lowest_clock_mean_power_and_highest_temperature(monkeypatch):
    """A throttling GPU shows in metrics.jsonl: the window's SM clock is its lowest sample, power the mean, the
    temperature the highest; a reading the GPU does not give is left out, and a driver without these calls (the plain
    fake) gives memory and utilisation alone."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = gpumon.GpuMonitor(1.0, nvml=ClockedNvml())
    monitor.sample()
    monitor.sample()
    assert monitor.window() == {"gpu0_memory_gb": 2.0, "gpu0_utilization_pct": 1.5, "gpu0_sm_clock_mhz": 1880.0,
                                "gpu0_power_w": 515.0, "gpu0_temperature_c": 50.0,
                                "gpu1_memory_gb": 4.0, "gpu1_utilization_pct": 11.5, "gpu1_sm_clock_mhz": 1880.0,
                                "gpu1_power_w": 515.0}
    assert set(monitor.sample()[0]) == {"time", "node", "gpu", "memory_used_gb", "memory_total_gb",
                                        "utilization_pct", "sm_clock_mhz", "power_w", "temperature_c"}
    plain = gpumon.GpuMonitor(1.0, nvml=FakeNvml(count=1))
    plain.sample()
    assert set(plain.window()) == {"gpu0_memory_gb", "gpu0_utilization_pct"}


def test_the_summary_has_the_clock_and_power_under_load(monkeypatch):
    """summary.json's busy_sm_clock_mhz and busy_power_w average the samples at >= 50% utilisation only (an idle
    GPU lowers its clock on purpose), next to the card's max_sm_clock_mhz; without busy samples, or from a driver
    without these readings, they are absent."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = ClockedNvml(count=1)
    monitor = gpumon.GpuMonitor(1.0, nvml=nvml)
    handle = monitor.handles[0][1]
    busy = iter([10, 60, 90, 20])  # the four samples' utilisation: the 2nd and 3rd are busy
    monkeypatch.setattr(nvml, "nvmlDeviceGetUtilizationRates", lambda h: types.SimpleNamespace(gpu=next(busy)),
                        raising=False)
    for _ in range(4):
        monitor.sample()
    assert handle["samples"] == 4
    (entry,) = monitor.summary()
    # clocks 1980, 1880, 1780, 1680 and power 510-540 W by sample; the busy ones are the 2nd and 3rd
    assert entry["busy_sm_clock_mhz"] == 1830.0 and entry["busy_power_w"] == 525.0, entry
    assert entry["max_sm_clock_mhz"] == 1980.0 and entry["mean_utilization_pct"] == 45.0
    idle = gpumon.GpuMonitor(1.0, nvml=ClockedNvml(count=1))
    idle.sample()  # 1% busy
    assert not {"busy_sm_clock_mhz", "busy_power_w", "max_sm_clock_mhz"} & set(idle.summary()[0])
    plain = gpumon.GpuMonitor(1.0, nvml=FakeNvml(count=1))
    for _ in range(60):
        plain.sample()  # reaches 60% busy, but reports no clock or power
    assert not {"busy_sm_clock_mhz", "busy_power_w", "max_sm_clock_mhz"} & set(plain.summary()[0])


def test_thread_writes_time_series(tmp_path, monkeypatch):
    """The background thread samples at the interval into the jsonl; stop() joins it and takes a last sample."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "gpu_metrics.jsonl"
    monitor = gpumon.GpuMonitor(0.01, path, nvml=FakeNvml(count=1)).start()
    time.sleep(0.2)
    summary = monitor.stop()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) >= 3 and {r["gpu"] for r in records} == {0}
    assert set(records[0]) == {"time", "node", "gpu", "memory_used_gb", "memory_total_gb", "utilization_pct"}
    assert summary[0]["samples"] == len(records) + 1  # the last sample goes to the summary only


def test_visible_devices_by_index_and_uuid(monkeypatch):
    """CUDA_VISIBLE_DEVICES picks and renumbers GPUs as CUDA does; enumeration stops at an invalid entry."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-1")
    handles = gpumon._visible_handles(FakeNvml(count=4))
    assert [(i, h["index"]) for i, h in handles] == [(0, 3), (1, 1)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,0")
    assert [i for i, _ in gpumon._visible_handles(FakeNvml(count=4))] == [0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not gpumon.GpuMonitor(1.0, nvml=FakeNvml()).active


def test_failing_gpu_is_left_out(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = gpumon.GpuMonitor(1.0, nvml=FakeNvml(count=2, fail_index=1))
    assert [r["gpu"] for r in monitor.sample()] == [0]


def test_absent_nvml_is_a_quiet_no_op(tmp_path, monkeypatch, capsys):
    """Without pynvml / a driver / GPUs, or with interval 0: inactive, no thread, no file, empty summaries."""
    import pynvml

    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    monitor = gpumon.start_monitor(tmp_path, 0.01, local_rank=0)
    assert not monitor.active and monitor.window() == {} and monitor.stop() == []
    assert not (tmp_path / "gpu_metrics.jsonl").exists()
    assert not gpumon.GpuMonitor(0, nvml=FakeNvml()).active  # interval 0 = off
    assert not gpumon.start_monitor(tmp_path, 1.0, local_rank=1).active  # one monitor per node
    assert capsys.readouterr() == ("", "")


def test_metrics_records_carry_the_window(tmp_path, monkeypatch):
    """Metrics.log merges the monitor's window into each record (metrics.jsonl and tensorboard)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = gpumon.GpuMonitor(1.0, nvml=FakeNvml(count=1))
    metrics = Metrics(tmp_path, total_steps=2, tensorboard=False, gpu_monitor=monitor)
    monitor.sample()
    metrics.log({"step": 1, "loss": 1.0, "lr": 0.1, "samples_per_s": 1.0})
    metrics.log({"step": 2, "loss": 1.0, "lr": 0.1, "samples_per_s": 1.0})
    metrics.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["gpu0_memory_gb"] == 1.0 and records[0]["gpu0_utilization_pct"] == 1.0
    assert "gpu0_memory_gb" not in records[1]  # no sample in that window
