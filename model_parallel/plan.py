"""The placement plan: which process runs which stage of which pipeline, on which device, with which blocks.

Pure data, computed from the config and the launch shape alone, so it is checked (and tested) before any
process group or model exists. Legend: S stages per pipeline (1 encoder + D decoder stages), P pipelines,
W = P x S processes. Launch rank r runs stage r % S of pipeline r // S, so a pipeline's stages are neighbours
on one node (the deepspeed launcher numbers ranks node by node).

Two torch.distributed worlds (see model_parallel/worlds.py) number the processes by role:
- the encoder world: encoder of pipeline p is encoder rank p;
- the decoder world: decoder stage k (0 = the one after the encoder) of pipeline p is decoder rank
  p x D + (D - 1 - k), so decoder rank 0 is the last stage of pipeline 0: it holds the loss, logs and commits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from train.config.schema import PROJECT_KEY

if TYPE_CHECKING:
    from train.config import ProjectConfig

DEVICE_PATTERN = re.compile(r"^(cpu|cuda:(\d+))$")


class PlanError(ValueError):
    """The placement cannot be built on this launch; the message names the key and the fix."""


@dataclass(frozen=True)
class Placement:
    rank: int  # launch rank
    pipeline: int
    stage: int  # 0 = encoder, 1..D = decoder stages in data-flow order
    num_stages: int
    device: str  # "cpu" or "cuda:N" (the device this process drives)
    blocks: tuple[int, int] | None  # [first, end) transformer blocks of a decoder stage; None for the encoder

    @property
    def is_encoder(self) -> bool:
        return self.stage == 0

    @property
    def num_decoder_stages(self) -> int:
        return self.num_stages - 1

    @property
    def decoder_index(self) -> int:
        """0-based position among the decoder stages of the pipeline (data-flow order)."""
        return self.stage - 1

    @property
    def is_first_decoder(self) -> bool:
        return self.stage == 1

    @property
    def is_last_decoder(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def role_rank(self) -> int:
        """Rank in this process's role world (encoder world or decoder world)."""
        if self.is_encoder:
            return self.pipeline
        d = self.num_decoder_stages
        return self.pipeline * d + (d - 1 - self.decoder_index)

    def peer(self, stage: int) -> int:
        """Launch rank of another stage of the same pipeline."""
        return self.pipeline * self.num_stages + stage


@dataclass(frozen=True)
class Plan:
    placements: tuple[Placement, ...]
    num_pipelines: int
    num_stages: int

    def of(self, rank: int) -> Placement:
        return self.placements[rank]

    def role_world_size(self, encoder: bool) -> int:
        return self.num_pipelines * (1 if encoder else self.num_stages - 1)

    def describe(self) -> str:
        lines = []
        for p in self.placements:
            what = "encoder (VL + VAE)" if p.is_encoder else f"decoder blocks {p.blocks[0]}-{p.blocks[1] - 1}"
            lines.append(f"rank {p.rank}: pipeline {p.pipeline} stage {p.stage} {what} on {p.device}")
        return "\n".join(lines)


def device_index(name: str) -> int | None:
    match = DEVICE_PATTERN.match(name)
    if match is None:
        raise PlanError(f"qwen_edit.parallel.stages: {name!r} is not a device name; write \"cuda:N\" or \"cpu\"")
    return None if match.group(2) is None else int(match.group(2))


def block_ranges(num_blocks: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[first, end) per decoder stage for cuts at the given block indices (e.g. 60 blocks, [30] -> 0-29, 30-59)."""
    bounds = [0, *cuts, num_blocks]
    if any(b >= e for b, e in zip(bounds, bounds[1:], strict=False)):
        raise PlanError(f"qwen_edit.parallel.decoder_cuts: {cuts} must be increasing block indices strictly between "
                        f"0 and {num_blocks} (the transformer's block count)")
    return list(zip(bounds, bounds[1:], strict=False))


def build_plan(stages: list[str], cuts: list[int], world_size: int, num_blocks: int, num_gpus: int = 0,
               local_world_size: int | None = None) -> Plan:
    """Placement of every launch rank. `num_gpus` = GPUs this node has (0 = CPU: every stage runs on the CPU and
    the cuda names only fix the stage count); `local_world_size` = processes per node (default: all of them).

    Pipeline replicas on one node take the next devices: replica j on a node adds j x S to every cuda index
    (2 pipelines x ["cuda:0", "cuda:1"] on 4 GPUs: cuda:0/1 and cuda:2/3).
    """
    num_stages = len(stages)
    if num_stages < 2:
        raise PlanError(f"qwen_edit.parallel.stages: {stages} names {num_stages} device(s); give the encoder's and "
                        "at least one decoder device, e.g. [\"cuda:0\", \"cuda:1\"]")
    if len(cuts) != num_stages - 2:
        raise PlanError(f"qwen_edit.parallel.decoder_cuts: {len(cuts)} cut(s) for {num_stages - 1} decoder stage(s); "
                        f"give {num_stages - 2} block indices (one fewer than the decoder devices in stages)")
    if world_size % num_stages:
        raise PlanError(f"qwen_edit.parallel.stages: {num_stages} stages per pipeline, but {world_size} processes; "
                        f"launch a multiple of {num_stages} (deepspeed --num_gpus {num_stages})")
    ranges = block_ranges(num_blocks, cuts)
    local = local_world_size or world_size
    if local % num_stages:
        raise PlanError(f"qwen_edit.parallel.stages: {local} processes per node do not hold whole pipelines of "
                        f"{num_stages} stages; use a multiple of {num_stages} processes per node")
    indices = [device_index(s) for s in stages]
    if num_gpus:
        names = [s for s in stages if s != "cpu"]
        if len(set(names)) != len(names) or len(names) != num_stages:
            raise PlanError(f"qwen_edit.parallel.stages: {stages} must name {num_stages} different cuda devices on a "
                            "GPU machine")
    placements = []
    for rank in range(world_size):
        pipeline, stage = divmod(rank, num_stages)
        device = "cpu"
        if num_gpus:
            index = indices[stage] + (rank % local) // num_stages * num_stages
            if index >= num_gpus:
                raise PlanError(
                    f"qwen_edit.parallel.stages: pipeline {pipeline} stage {stage} needs cuda:{index}, but this "
                    f"machine has {num_gpus} GPU(s) (cuda:0-{num_gpus - 1}); name existing devices or launch "
                    "fewer processes"
                )
            device = f"cuda:{index}"
        placements.append(Placement(rank, pipeline, stage, num_stages, device,
                                    None if stage == 0 else ranges[stage - 1]))
    return Plan(tuple(placements), world_size // num_stages, num_stages)


def check_parallel(cfg: ProjectConfig, problems: list[str], world_size: int, num_gpus: int | None = None,
                   fp16: bool = False, node_local_storage: bool = False) -> None:
    """The model-parallel placement: device names, cuts, world size; devices against `num_gpus` when known.
    train/main.py passes it to train.config.load_config, so a bad placement is one more problem of the config."""
    if cfg.parallel.mode != "model_parallel":
        return
    key = f"{PROJECT_KEY}.parallel"
    if node_local_storage:  # DeepSpeed and checkpoint.save commit a node's copy on its local rank 0
        problems.append("checkpoint.use_node_local_storage: not available in the model-parallel mode: each node's "
                        "checkpoint copy is written by its local rank 0, which is an encoder there (it holds no "
                        "weights), so no checkpoint would be written; keep --output_dir on a file system every node "
                        "shares, or use parallel.mode zero2")
    if cfg.parallel.queue_depth < 1:
        problems.append(f"{key}.queue_depth: must be >= 1, got {cfg.parallel.queue_depth}")
    if fp16 and cfg.parallel.decoder_cuts:
        problems.append(f"{key}.decoder_cuts: fp16's loss scaling is not carried across a cut; use bf16")
    if cfg.validation.file and cfg.parallel.decoder_cuts:
        problems.append(f"{PROJECT_KEY}.validation.file: validation images need the whole transformer on one decoder "
                        f"stage, but {key}.decoder_cuts {cfg.parallel.decoder_cuts} cuts it; set validation.file to "
                        "\"\" (and render the export with python -m train.infer) or decoder_cuts to []")
    num_blocks = 10**9  # unknown until the model is readable; then the transformer's block count
    config_file = Path(cfg.model.path) / "transformer" / "config.json"
    if cfg.model.path and config_file.is_file():
        num_blocks = json.loads(config_file.read_text()).get("num_layers", 60)
    try:
        build_plan(cfg.parallel.stages, cfg.parallel.decoder_cuts, world_size, num_blocks, num_gpus or 0)
    except PlanError as e:
        problems.append(str(e))
