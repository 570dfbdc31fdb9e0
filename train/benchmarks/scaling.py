"""Scaling of the real entry point over the GPUs of one node: train/main.py through the deepspeed launcher on N GPUs
and on 1, for three settings, from the same base config.

    python -m train.bench --scaling --model M --data D [--gpus N] [--settings zero2,deepcompile,stage0]
                          [--config ds_configs/zero2.json] [--steps 15] [--skip 5] [--set KEY=JSON ...] [--json J]

Settings, each the base config (--config, every --set applied; the setting's own change wins) with one change:
- zero2: none (ds_configs/zero2.json as shipped: ZeRO-2 with its per-parameter gradient hooks);
- deepcompile: qwen_edit.train.deepcompile true (DeepSpeed's DeepCompile: the reductions inside the compiled
  backward);
- stage0: zero_optimization.stage 0 (plain data parallel: gradients all-reduced after the backward, no hooks).
Every run trains --steps optimizer steps and logs each one (save only at the end, no tensorboard); its metrics.jsonl
gives the step times, of which the first --skip (compilation, the caching allocator growing) are left out.
Per run: the mean and median step time, samples/s per GPU from each (micro-batch x gradient accumulation / step
time), the losses. Per setting: the efficiency, samples/s per GPU on N GPUs over that on 1 (from the means and from
the medians), and the largest relative loss difference against zero2 at the same GPU count (same seeds and data
order: only rounding separates the curves, the reductions' order and, with DeepCompile, its whole-model graph).

Before any launch every setting's config is checked as train/main.py checks it (train.config.load_config): a
setting this machine refuses (DeepCompile on a CPU) is reported as not available with the config's message, and its
runs are not launched. The command exits 1 when a launched run fails. Each run's log is OUT/<setting>_<n>gpu.log; a
run still going after --run_timeout gets SIGTERM, then SIGKILL 20 s later (a SIGTERM during a compile can hang).
Why a mode of train.bench and not a script of its own: the benchmarks' command already holds the one-process probes;
the work here is generating configs, launching and reading metrics.jsonl, which a test runs on CPU processes (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from train import config
from train.benchmarks.report import machine
from train.runtime import engine, steptime

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {
    "zero2": {},
    "deepcompile": {"qwen_edit.train.deepcompile": True},
    "stage0": {"zero_optimization.stage": 0},
}
# What every run changes in the base config: its length, a metrics line per step, no intermediate save.
RUN_KEYS = {
    "qwen_edit.output.save_every_steps": 0,
    "qwen_edit.output.log_every_steps": 1,
    "qwen_edit.output.export_every_steps": 0,
    "qwen_edit.output.tensorboard": False,
}
KILL_GRACE_S = 20


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.bench --scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="diffusers-format model directory (train/main.py --model)")
    p.add_argument("--data", required=True, help="data directory (train/main.py --data)")
    p.add_argument("--config", default=str(REPO / "ds_configs" / "zero2.json"), help="base config (default zero2)")
    p.add_argument(
        "--gpus",
        type=int,
        help="N: GPUs of the multi-GPU runs (default: every GPU of this node; 2 on CPU); 1: the one-GPU runs alone, "
        "for the settings' loss curves against zero2's",
    )
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--steps", type=int, default=15, help="optimizer steps per run (default 15)")
    p.add_argument(
        "--skip",
        type=int,
        default=5,
        help="first steps left out of the statistics: compilation, the allocator's growth (default 5)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a dotted key of the config file and its JSON value, for every run (repeatable), e.g. "
        "qwen_edit.data.cache='\"auto\"'",
    )
    p.add_argument("--out", default="/tmp/train_scaling", help="generated configs, logs and runs (default %(default)s)")
    p.add_argument("--run_timeout", type=float, default=900, help="seconds per run (default 900)")
    p.add_argument("--json", default="", help="append the result as one JSON line to this file")
    args = p.parse_args(argv)
    args.gpus = args.gpus or torch.cuda.device_count() or 2
    args.settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown or not args.settings:
        p.error(f"--settings: {', '.join(unknown) or 'none given'}; choose among {', '.join(SETTINGS)}")
    if args.gpus < 1 or args.steps <= args.skip or args.skip < 0:
        p.error("--gpus must be >= 1, --skip >= 0 and --steps > --skip")
    try:
        args.changes = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.set)}
    except ValueError as e:
        p.error(f"--set takes KEY=JSON, e.g. qwen_edit.data.num_workers=0 ({e})")
    return args


def setting_config(base: dict, setting: str, changes: dict, steps: int) -> dict:
    """The config of one setting: `base` with `changes` (dotted keys), the setting's own change and RUN_KEYS."""
    cfg = json.loads(json.dumps(base))
    for dotted, value in {**changes, **SETTINGS[setting], **RUN_KEYS, "qwen_edit.train.max_steps": steps}.items():
        *parents, last = dotted.split(".")
        node = cfg
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = value
    return cfg


def refusal(path: Path, args: argparse.Namespace) -> str | None:
    """The config's problems as train/main.py would print them on this machine at --gpus ranks; None: it runs."""
    cli = ["--ds_config", str(path), "--model", args.model, "--data", args.data, "--output_dir", str(args.out)]
    try:
        config.load_config(
            config.parse_args(cli), args.gpus, has_gpu=torch.cuda.is_available(), num_gpus=torch.cuda.device_count()
        )
    except config.ConfigError as e:
        return "; ".join(e.problems)
    return None


def launch(cmd: list[str], log: Path, timeout: float) -> int:
    """Run `cmd` in its own process group with its output in `log`; 124 when the timeout stopped it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, as the GPU scripts run
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher and its ranks
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124


def read_run(run_dir: Path, skip: int) -> dict:
    """A finished run's figures from its metrics.jsonl, resolved config.json and summary.json."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    resolved = json.loads((run_dir / "config.json").read_text())
    samples = resolved["train_micro_batch_size_per_gpu"] * resolved["gradient_accumulation_steps"]
    stats = steptime.step_time_stats([r["step_time_s"] for r in rows], samples, warmup=skip)
    if stats is None:
        raise ValueError(f"{run_dir}: {len(rows)} steps, none after the first {skip}; run more --steps")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    plan = summary.get("memory_plan") or {}
    return {
        **stats,
        "samples_per_s_per_gpu": stats["samples_per_s"],
        "samples_per_s_per_gpu_median": samples / stats["median_s_per_step"],
        "losses": [r["loss"] for r in rows],
        "peak_memory_gb": max(r.get("peak_memory_gb", 0.0) for r in rows),
        "plan_choice": plan.get("choice"),
    }


def last_error(log: Path) -> str:
    """The run's own last error line: the deepspeed launcher's report that a rank exited comes after it and names
    only the command and its exit code."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    own = [line for line in lines if "sigkill_handler" not in line]
    errors = [line for line in own if "error" in line.lower()]
    return (errors or own or lines or ["(no output)"])[-1][:400]


def run_one(setting: str, world: int, cfg: Path, args: argparse.Namespace) -> dict:
    """One launch of train/main.py through the deepspeed launcher on `world` GPUs (CPU processes without GPUs)."""
    name, out = f"{setting}_{world}gpu", Path(args.out)
    run_dir, log = out / "runs" / name, out / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(world),
        "--master_port",
        str(engine.free_port()),
        str(REPO / "train" / "main.py"),
        "--ds_config",
        str(cfg),
        "--model",
        args.model,
        "--data",
        args.data,
        "--output_dir",
        str(run_dir),
        "--overwrite",
    ]
    start = time.perf_counter()
    rc = launch(cmd, log, args.run_timeout)
    row = {"setting": setting, "world_size": world, "rc": rc, "wall_s": time.perf_counter() - start, "log": str(log)}
    if rc != 0 or not (run_dir / "metrics.jsonl").is_file():
        return {**row, "status": "failed", "error": last_error(log)}
    row = {**row, "status": "ok", **read_run(run_dir, args.skip)}
    shutil.rmtree(run_dir)  # its checkpoint and export: the log and the row keep what the harness reports
    return row


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=False))


def world_sizes(gpus: int) -> list[int]:
    """The GPU counts each setting runs at: 1 and N (1 alone with --gpus 1)."""
    return sorted({1, gpus})


def summarise(setting: str, runs: list[dict], gpus: int) -> dict:
    """A setting's efficiency (N GPUs over 1, samples/s per GPU) and its loss curves against zero2's."""
    mine = {r["world_size"]: r for r in runs if r["setting"] == setting and r["status"] == "ok"}
    base = {r["world_size"]: r for r in runs if r["setting"] == "zero2" and r["status"] == "ok"}
    out: dict = {"setting": setting}
    if gpus > 1 and 1 in mine and gpus in mine:
        one, many = mine[1], mine[gpus]
        out["efficiency"] = many["samples_per_s_per_gpu"] / one["samples_per_s_per_gpu"]
        out["efficiency_median"] = many["samples_per_s_per_gpu_median"] / one["samples_per_s_per_gpu_median"]
        out["speedup"] = gpus * out["efficiency"]
    if setting != "zero2":
        out["loss_max_rel_diff_vs_zero2"] = {
            str(w): max_rel_diff(r["losses"], base[w]["losses"]) for w, r in mine.items() if w in base
        }
    return out


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = json.loads(Path(args.config).read_text())
    runs, settings = [], []
    for setting in args.settings:
        cfg = out / f"{setting}.json"
        cfg.write_text(json.dumps(setting_config(base, setting, args.changes, args.steps), indent=1))
        reason = refusal(cfg, args)
        if reason is not None:
            settings.append({"setting": setting, "status": "not available", "reason": reason})
            continue
        runs += [run_one(setting, world, cfg, args) for world in world_sizes(args.gpus)]
        settings.append({"status": "ran", **summarise(setting, runs, args.gpus)})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {
        "benchmark": "scaling",
        "config": args.config,
        "gpus": args.gpus,
        "steps": args.steps,
        "skip": args.skip,
        "changes": args.changes,
        "runs": runs,
        "settings": settings,
        "failed": sum(r["status"] == "failed" for r in runs),
        **machine(engine.Dist(0, args.gpus, 0, device)),
    }


def format_report(r: dict) -> str:
    lines = [
        f"== train.bench --scaling: train/main.py through the deepspeed launcher, "
        f"{'1' if r['gpus'] == 1 else '1 vs ' + str(r['gpus'])} "
        f"{'GPU(s)' if r['device_type'] == 'cuda' else 'CPU process(es)'}, {r['config']}, {r['steps']} steps each "
        f"(statistics over steps {r['skip'] + 1}-{r['steps']}); {r['gpu_name']}, torch {r['torch_version']}, "
        f"deepspeed {r['deepspeed_version']} ==",
        f"{'setting':12s} {'GPUs':>4s} {'mean s/step':>12s} {'median':>8s} {'slowest':>8s} "
        f"{'samples/s/GPU mean':>19s} {'median':>8s}  plan",
    ]
    for s in r["settings"]:
        if s["status"] == "not available":
            lines.append(f"{s['setting']:12s} not available: {s['reason']}")
            continue
        for run in (x for x in r["runs"] if x["setting"] == s["setting"]):
            if run["status"] != "ok":
                lines.append(f"{s['setting']:12s} {run['world_size']:4d} FAILED (rc {run['rc']}): {run['error']}")
                continue
            lines.append(
                f"{s['setting']:12s} {run['world_size']:4d} {run['mean_s_per_step']:12.4f} "
                f"{run['median_s_per_step']:8.4f} {run['slowest_s']:8.4f} {run['samples_per_s_per_gpu']:19.3f} "
                f"{run['samples_per_s_per_gpu_median']:8.3f}  {run['plan_choice'] or '-'}"
            )
        if "efficiency" in s:
            lines.append(
                f"{'':12s} efficiency {s['efficiency']:.3f} from the means, {s['efficiency_median']:.3f} "
                f"from the medians: {s['speedup']:.2f}x on {r['gpus']}"
            )
        for world, diff in s.get("loss_max_rel_diff_vs_zero2", {}).items():
            lines.append(f"{'':12s} losses against zero2 on {world}: largest relative difference {diff:.2e}")
    if r["device_type"] != "cuda":
        lines.append("note: CPU processes (gloo): the times say nothing about GPUs; this run checks the harness")
    return "\n".join(lines)
