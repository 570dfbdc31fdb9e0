"""Process set-up and the DeepSpeed engine (with checkpoint.py, ds_patches.py and config.py, which validates DeepSpeed's
section with its own config classes, the only modules importing deepspeed).

On a machine without CUDA the same command and config run on DeepSpeed's CPU accelerator with gloo.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch


def local_world_size(environ=None) -> int:
    """Processes on this node: LOCAL_SIZE as the deepspeed launcher sets it (torchrun: LOCAL_WORLD_SIZE)."""
    env = os.environ if environ is None else environ
    return int(env.get("LOCAL_SIZE", env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))))


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's share of the host)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare_environment() -> None:
    """Environment that must be set before deepspeed is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights only ever come from local directories
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Processes on one CPU host share its cores; each using all of them oversubscribes the cores and
        # spinning OpenMP threads made a 2-process step 12x slower than a 1-process one.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, usable_cores() // local_world_size()))
    else:
        # DeepSpeed's op builder cannot parse arch-specific entries such as Hopper's '9.0a' (from torch or a
        # preset TORCH_CUDA_ARCH_LIST): give it plain 'X.Y' entries.
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}"))


class TooManyProcessesError(ValueError):
    """More processes on a node than it has GPUs; the message names both counts and the fix."""


def processes_problem(num_procs: int, num_gpus: int, num_cores: int) -> tuple[str | None, str | None]:
    """(error, warning) for `num_procs` processes on a node with `num_gpus` GPUs (0: the CPU) and `num_cores`
    cores: each process takes a GPU of its own, so more processes than GPUs cannot start; without a GPU they
    share the cores, and more processes than cores only take turns on them."""
    if num_gpus and num_procs > num_gpus:
        return (f"{num_procs} processes on this node (deepspeed --num_gpus {num_procs}) but torch sees "
                f"{num_gpus} GPU(s) here; each process takes a GPU of its own: start at most {num_gpus} "
                f"(deepspeed --num_gpus {num_gpus})"), None
    if not num_gpus and num_procs > num_cores:
        return None, (f"warning: {num_procs} processes on this node share its {num_cores} CPU core(s) (no GPU): "
                      f"each runs one thread and they take turns on the cores, slower than {num_cores} "
                      f"process(es) would be; start at most {num_cores} (deepspeed --num_gpus {num_cores})")
    return None, None


def check_processes(rank: int) -> None:
    """Refuse more processes on this node than its GPUs (TooManyProcessesError, before anything loads); without a
    GPU, rank 0 warns once when they outnumber the cores."""
    from train.runtime.console import print0

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    error, warning = processes_problem(local_world_size(), num_gpus, usable_cores())
    if error:
        raise TooManyProcessesError(error)
    if warning:
        print0(warning, rank=rank, file=sys.stderr)


def plain_arch_list(value: str) -> str:
    """'9.0a;8.0+PTX 10.0a' -> '9.0;8.0+PTX;10.0': drop the arch-specific letter suffixes DeepSpeed cannot parse."""
    entries = []
    for entry in value.replace(",", ";").replace(" ", ";").split(";"):
        if entry:
            arch, ptx = (entry[:-4], "+PTX") if entry.endswith("+PTX") else (entry, "")
            entries.append(arch.rstrip("abcdefghijklmnopqrstuvwxyz") + ptx)
    return ";".join(dict.fromkeys(entries))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: object = None
    """Process group of the data-parallel replicas (loss mean, digests); None = every rank (model_parallel with
    a decoder cut narrows it to one stage's replicas)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class PortInUseError(RuntimeError):
    """The rendezvous port is taken; the message names the flag that picks another. The training, cache and
    inference commands refuse with it (exit 2); elsewhere (train.bench, train.bench_data) exit_with prints it."""

    without_traceback = True


@contextmanager
def rendezvous_port(launched: bool = True):
    """Turn c10d's error for a taken MASTER_PORT (rank 0's TCPStore cannot bind it: EADDRINUSE, a long traceback)
    into a PortInUseError naming the fix. `launched`: under the deepspeed launcher (its --master_port) rather than
    a plain `python ...` that reads MASTER_PORT from the environment."""
    try:
        yield
    except torch.distributed.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        port, free = os.environ.get("MASTER_PORT", "?"), free_port()
        fix = (f"pass another one, e.g. deepspeed --master_port {free} ... (or bash launch.sh --master_port {free} ...)"
               if launched else f"set another one, e.g. MASTER_PORT={free} python ..., or leave MASTER_PORT unset")
        what = "the launcher's --master_port, default 29500" if launched else "MASTER_PORT"
        raise PortInUseError(f"port {port} ({what}) is already in use, likely by another training run; {fix}") from e


def init_distributed(timeout_s: int = 600) -> Dist:
    """Set the device, then the process group; a plain `python train/main.py` becomes a world of one."""
    prepare_environment()
    launched = "RANK" in os.environ
    if not launched:  # a plain `python train/main.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    skip_cpu_shm_op()
    # The timeout bounds how long survivors wait in a collective for a rank that died (e.g. on another node).
    with rendezvous_port(launched):
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False,
                                   timeout=timedelta(seconds=timeout_s))
    return Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, device)


def skip_cpu_shm_op() -> None:
    """Keep DeepSpeed's shared-memory all-reduce op out of CPU runs; a no-op on GPUs.

    On the CPU accelerator every deepspeed.init_distributed JIT-compiles (minutes on 2 cores, again whenever
    torch's extension cache looks stale) and loads deepspeed_shm_comm, and maps a 64 MiB /dev/shm buffer per rank
    that it never unlinks. Its one user is deepspeed.comm.inference_all_reduce, which training never calls: the
    engine's gradient all-reduce is torch.distributed's (gloo) either way. build_shm_op returns None for an op
    that deepspeed.ops.__compatible_ops__ marks incompatible, so no build, no load and no buffer."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def build_engine(model: torch.nn.Module, ds_config: dict, mpu=None):
    """ZeRO engine over the trainable parameters only; frozen weights are never given to the optimizer.
    `mpu`: DeepSpeed's model/data-parallel groups (model_parallel's decoder cut); None = data parallel only."""
    import deepspeed

    from train.runtime import ds_patches

    ds_patches.apply()  # multi-tensor gradient checks in the step (see train/runtime/ds_patches.py)
    if str((ds_config.get("optimizer") or {}).get("type", "")).lower() != "muon":
        ds_patches.import_muon_uncompiled()  # DeepSpeed imports it for isinstance checks: no compile for those
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, lr_scheduler = deepspeed.initialize(model=model, model_parameters=params, config=ds_config,
                                                      mpu=mpu)
    if (ds_config.get("compile") or {}).get("deepcompile"):  # qwen_edit.train.deepcompile
        deepcompile(engine)
    if getattr(engine.optimizer, "cpu_offload", False):  # ZeRO-Offload: the memory plan's last resort, or the config's
        from train.runtime.console import print0

        print0(f"optimizer offload: fp32 master weights, gradients and {type(engine.basic_optimizer).__name__}'s "
               "state in host memory, stepped on the CPU (zero_optimization.offload_optimizer)",
               rank=engine.global_rank)
    return engine, lr_scheduler


def deepcompile(engine) -> None:
    """DeepCompile (compile.deepcompile): the frozen weights become buffers (frozen_to_buffers), then the engine
    compiles the whole module with DeepSpeed's backend, whose ZeRO-1/2 pass reduces the gradients in the compiled
    backward (DeepSpeedEngine.compile, deepspeed/compile/init_z1_and_2.py)."""
    from train.runtime.console import print0

    moved = frozen_to_buffers(engine.module)
    engine.compile()
    print0(f"DeepCompile: the engine compiles the whole transformer ({moved} frozen weights held as buffers)",
           rank=engine.global_rank)


def frozen_to_buffers(model: torch.nn.Module) -> int:
    """Re-register every frozen parameter of `model` as a non-persistent buffer of the same name; returns how many.
    DeepCompile's ZeRO-1/2 backend asserts that each parameter among a compiled graph's inputs carries the id the
    optimizer gave it (deepspeed/compile/backend.py, "All param inputs should have param_id"), and dynamo passes a
    frozen weight in as a parameter too; as a buffer it is a plain input. Non-persistent, so that checkpoints leave
    the frozen weights out as before (save_checkpoint's exclude_frozen_parameters)."""
    moved = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not param.requires_grad:
                del module._parameters[name]
                module.register_buffer(name, param.detach(), persistent=False)
                moved += 1
    return moved


def all_gather_objects(value, group=None) -> list:
    """Every rank's `value` in rank order, on every rank (a collective over `group` when one is up); [value]
    in a world of one."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [value]
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, value, group=group)
    return parts


def exit_with(main: Callable[[], int]):
    """Run an entry point started by the launcher and end the process with its exit code.

    argparse's exit keeps its code, a SystemExit with a message prints it and exits 1 (as Python does); any other
    crash prints its traceback (an out-of-memory error only its message) and exits 1 without waiting on the other
    ranks (the launcher stops them). The process leaves by os._exit, skipping the interpreter's teardown: after
    the final barrier all work is done, and gloo/DeepSpeed threads racing the interpreter's exit killed about 3%
    of CPU launches with rc 250.
    """
    try:
        code = main()
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        if getattr(e, "without_traceback", False):  # e.g. train.runtime.oom.OutOfMemory: the message says what to do
            print(f"error: {e}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


EARLY_EXIT_GRACE_S = 5.0


def refuse_early(error: Exception, rank: int) -> int:
    """Exit code 2 for a user mistake found before the ranks are connected, printed by rank 0 only. The other ranks
    wait a moment first: the launcher ends every process when one exits non-zero, and a rank 1 that returned at
    once could have rank 0 killed before its message was out (seen in CI)."""
    import time

    from train.runtime.console import print0

    print0(f"error: {error}", rank=rank, file=sys.stderr)
    if rank != 0:
        time.sleep(EARLY_EXIT_GRACE_S)
    return 2


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def teardown() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
