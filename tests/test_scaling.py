"""python -m train.bench --scaling: the settings' configs, and the harness end to end on CPU processes (gloo):
train/main.py through the deepspeed launcher on 2 processes and on 1, DeepCompile reported as not available.

Timings are printed by the harness, never asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIG, main_in_process

from train.benchmarks import scaling

REPO = Path(__file__).resolve().parent.parent


def test_each_setting_changes_one_thing_of_the_base_config():
    """zero2 is the base as given, deepcompile sets the project key, stage0 the ZeRO stage; every run logs each
    step, saves only at the end and runs the asked steps; --set applies to all."""
    base = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    made = {s: scaling.setting_config(base, s, {"qwen_edit.data.num_workers": 0}, 7) for s in scaling.SETTINGS}
    for cfg in made.values():
        q = cfg["qwen_edit"]
        assert (q["train"]["max_steps"], q["output"]["log_every_steps"], q["output"]["save_every_steps"]) == (7, 1, 0)
        assert q["data"]["num_workers"] == 0 and q["lora"] == base["qwen_edit"]["lora"]
    assert made["zero2"]["zero_optimization"] == base["zero_optimization"]
    assert "deepcompile" not in made["zero2"]["qwen_edit"]["train"]
    assert made["deepcompile"]["qwen_edit"]["train"]["deepcompile"] is True
    assert made["stage0"]["zero_optimization"] == {**base["zero_optimization"], "stage": 0}
    assert base["qwen_edit"]["train"]["max_steps"] == 1000  # the base is left alone
    with pytest.raises(SystemExit):
        scaling.parse_args(["--model", "m", "--data", "d", "--settings", "zero2,zero4"])


def test_efficiency_and_loss_curves_come_from_the_runs():
    """Efficiency = samples/s per GPU on N over that on 1 (means and medians); losses against zero2 per GPU count."""

    def run(setting, world, mean, median, losses):
        return {
            "setting": setting,
            "world_size": world,
            "status": "ok",
            "samples_per_s_per_gpu": 1 / mean,
            "samples_per_s_per_gpu_median": 1 / median,
            "losses": losses,
        }

    runs = [
        run("zero2", 1, 1.0, 0.9, [2.0, 1.0]),
        run("zero2", 4, 1.25, 1.0, [2.0, 1.0]),
        run("stage0", 1, 1.0, 1.0, [2.0, 1.1]),
        run("stage0", 4, 1.0, 1.0, [2.2, 1.0]),
    ]
    zero2 = scaling.summarise("zero2", runs, 4)
    assert zero2 == pytest.approx({"setting": "zero2", "efficiency": 0.8, "efficiency_median": 0.9, "speedup": 3.2})
    stage0 = scaling.summarise("stage0", runs, 4)
    assert stage0["efficiency"] == 1.0 and stage0["loss_max_rel_diff_vs_zero2"] == pytest.approx({"1": 0.1, "4": 0.1})
    assert "efficiency" not in scaling.summarise("stage0", runs[:3], 4)  # no run on 4 GPUs: no efficiency
    one_gpu = scaling.summarise("stage0", runs[::2], 1)  # --gpus 1: the loss curve alone
    assert "efficiency" not in one_gpu and one_gpu["loss_max_rel_diff_vs_zero2"] == pytest.approx({"1": 0.1})
    assert scaling.world_sizes(1) == [1] and scaling.world_sizes(4) == [1, 4]
    assert scaling.parse_args(["--model", "m", "--data", "d", "--gpus", "1"]).gpus == 1
    with pytest.raises(SystemExit):
        scaling.parse_args(["--model", "m", "--data", "d", "--gpus", "0", "--steps", "3", "--skip", "3"])


def test_a_failed_run_reports_the_trainers_error_not_the_launchers(tmp_path):
    """The launcher's closing line (a rank exited, its command and code) follows the trainer's own error."""
    log = tmp_path / "zero2_1gpu.log"
    log.write_text(
        "[INFO] [runner.py:600:main] cmd = python -u train/main.py\n"
        "error: qwen_edit.memory.budget_gb: 141.0 GB is more than NVIDIA H100 80GB HBM3 has (79.1 GB); lower it\n"
        "[ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 'train/main.py'] "
        "exits with return code = 2\n"
    )
    assert scaling.last_error(log).startswith("error: qwen_edit.memory.budget_gb: 141.0 GB is more than")
    log.write_text("[ERROR] [launch.py:259:sigkill_handler] ['python'] exits with return code = -9\n")
    assert "return code = -9" in scaling.last_error(log)  # killed without a word: the launcher's line is all there is


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU harness: DeepCompile is available on this machine")
def test_scaling_harness_on_cpu_processes(tiny_edit, tmp_path):
    """2 processes vs 1 for ZeRO-2 through the launcher; DeepCompile refused by the config as train/main.py would. The
    harness (train.bench --scaling) runs in this process: it only starts the launches and reads their records."""
    from train import bench

    out = tmp_path / "scaling"
    argv = ["--scaling", "--model", str(tiny_edit / "model"), "--data", str(tiny_edit / "data"), "--config",
            str(TINY_CONFIG), "--gpus", "2", "--settings", "zero2,deepcompile", "--steps", "3", "--skip", "1",
            "--set", "qwen_edit.data.num_workers=0", "--out", str(out), "--json", str(out / "s.jsonl")]
    code, stdout, stderr = main_in_process(bench, argv)
    assert code == 0, f"exit {code}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    r = json.loads((out / "s.jsonl").read_text().splitlines()[-1])
    runs = {run["world_size"]: run for run in r["runs"]}
    assert [run["setting"] for run in r["runs"]] == ["zero2", "zero2"] and set(runs) == {1, 2}
    for run in runs.values():
        assert run["status"] == "ok" and run["timed_steps"] == 2 and len(run["losses"]) == 3, run
        assert run["samples_per_s_per_gpu"] == pytest.approx(1 / run["mean_s_per_step"])  # micro-batch 1, GAS 1
        assert 0 < run["median_s_per_step"] <= run["slowest_s"]
    zero2, deepcompile = r["settings"]
    assert zero2["efficiency"] == pytest.approx(runs[2]["samples_per_s_per_gpu"] / runs[1]["samples_per_s_per_gpu"])
    assert deepcompile["status"] == "not available" and "no CUDA GPU" in deepcompile["reason"]
    assert "not available: qwen_edit.train.deepcompile" in stdout and "efficiency" in stdout
    assert not (out / "runs" / "zero2_1gpu").exists() and (out / "zero2_2gpu.log").is_file()
