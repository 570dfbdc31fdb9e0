"""Process groups of the model-parallel mode: one world per role, joined per pipeline by point-to-point links.

DeepSpeed's engine and this project's checkpoint code issue collectives on the default group (barriers in
`save_checkpoint`, tag validation, the loss reduction, replica digests): every member must call them. The
encoder processes take no part in training, so they must not be members. Each process therefore initialises
torch.distributed's default group with the processes of its own role only, through one shared TCPStore (the
launcher's MASTER_ADDR:MASTER_PORT) under a per-role prefix:

    decoder world  every decoder stage of every pipeline: DeepSpeed, ZeRO-2, checkpoints, logging
    encoder world  every encoder: the pre-flight row check shared between them
    links          per pipeline, its own gloo groups between neighbouring stages (micro-batches forward,
                   activations forward and their gradients backward across a decoder cut)

Links are gloo on host memory: what crosses from the encoder is a few MB per micro-batch (embeddings and
latents), far below what a stage computes on it. RANK/WORLD_SIZE/LOCAL_RANK are rewritten to the role world's
values so that the unmodified trainer code (and DeepSpeed) sees a plain data-parallel world.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from model_parallel.plan import Placement, Plan
from train.runtime import engine


@dataclass
class Links:
    """Gloo groups of this process to its neighbours in the pipeline (None at the ends). Each neighbour pair has
    one group per direction, so a receiving thread and the training thread never share one."""

    to_next: object | None  # forward group {me, next stage}; my rank in it is 0
    to_prev: object | None  # forward group {previous stage, me}; my rank in it is 1
    grads_from_next: object | None = None  # backward group {me, next stage} (gradients across a decoder cut)
    grads_to_prev: object | None = None  # backward group {previous stage, me}
    store: object | None = None  # the launch-wide TCPStore (hosted by launch rank 0)
    launch_world_size: int = 1
    launch_rank: int = 0


def _gloo_pair(store, prefix: str, my_index: int, timeout: timedelta):
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), my_index, 2, timeout)


def init_worlds(plan: Plan, me: Placement, timeout_s: int) -> Links:
    """Create the role world (as the default group) and this process's links. Every launch rank calls it."""
    timeout = timedelta(seconds=timeout_s)
    env = os.environ
    world_size = int(env["WORLD_SIZE"])
    with engine.rendezvous_port():  # a taken port: one line naming --master_port
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, me.rank == 0, timeout=timeout)
    backend = "nccl" if me.device.startswith("cuda") else "gloo"
    role = "encoder" if me.is_encoder else "decoder"
    dist.init_process_group(backend, store=dist.PrefixStore(f"{role}/", store), rank=me.role_rank,
                            world_size=plan.role_world_size(me.is_encoder), timeout=timeout)
    base = f"pipeline{me.pipeline}/"
    links = Links(None, None, store=store, launch_world_size=world_size, launch_rank=me.rank)
    if me.stage < me.num_stages - 1:
        links.to_next = _gloo_pair(store, f"{base}link{me.stage}/fwd/", 0, timeout)
        if me.stage > 0:  # a decoder cut
            links.grads_from_next = _gloo_pair(store, f"{base}link{me.stage}/bwd/", 0, timeout)
    if me.stage > 0:
        links.to_prev = _gloo_pair(store, f"{base}link{me.stage - 1}/fwd/", 1, timeout)
        if me.stage > 1:
            links.grads_to_prev = _gloo_pair(store, f"{base}link{me.stage - 1}/bwd/", 1, timeout)
    env.update(RANK=str(me.role_rank), WORLD_SIZE=str(plan.role_world_size(me.is_encoder)))
    if me.device.startswith("cuda"):
        env["LOCAL_RANK"] = me.device.split(":")[1]  # DeepSpeed places its engine on cuda:LOCAL_RANK
    return links


def set_device(me: Placement) -> torch.device:
    device = torch.device(me.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class ModelParallelGroups:
    """DeepSpeed's `mpu` for a decoder cut over D stages: model-parallel group = the D stages of my pipeline,
    data-parallel group = my stage in every pipeline (ZeRO-2 shards and reduces over it). Ranks are decoder-world
    ranks. DeepSpeed then sums the gradient norm over the stages (so clipping and the NaN/inf skip decide for
    the whole pipeline at once) and names checkpoint files by stage (mp_rank_KK)."""

    def __init__(self, plan: Plan, me: Placement):
        num_dec = plan.num_stages - 1
        self._pipe_ranks, self._dp_ranks = None, None
        for p in range(plan.num_pipelines):  # new_group is collective over the decoder world: all build all
            ranks = [p * num_dec + k for k in range(num_dec)]
            group = dist.new_group(ranks)
            if p == me.pipeline:
                self._mp_group, self._mp_ranks = group, ranks
        for k in range(num_dec):
            ranks = [p * num_dec + k for p in range(plan.num_pipelines)]
            group = dist.new_group(ranks)
            if me.role_rank in ranks:
                self._dp_group, self._dp_ranks = group, ranks

    def get_model_parallel_group(self):
        return self._mp_group

    def get_model_parallel_rank(self) -> int:
        return self._mp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self) -> int:
        return len(self._mp_ranks)

    def get_data_parallel_group(self):
        return self._dp_group

    def get_data_parallel_rank(self) -> int:
        return self._dp_ranks.index(dist.get_rank())

    def get_data_parallel_world_size(self) -> int:
        return len(self._dp_ranks)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)


def check_out(links: Links) -> None:
    """Check out of the launch-wide store without a collective, for a process that ends on an error of its own (a
    failed save): the store's host, which waits in leave() for every process, then exits instead of staying until
    DeepSpeed's launch.py kills it 30 s after terminating it (its SIGTERM alone does not end that wait). A store
    already gone is no error here: the process is ending with its own message."""
    if links.store is None:
        return
    try:
        links.store.add("left", 1)
    except RuntimeError:  # torch's store errors (DistStoreError, DistNetworkError) derive from it
        pass


def leave(links: Links, timeout_s: int) -> None:
    """Check out of the launch-wide store; its host (launch rank 0, an encoder) leaves last.

    Launch rank 0 hosts the TCPStore that every role world and link was built on. An encoder finishes first
    (it only sends), and when its process exited the store went with it: the decoders' last checkpoint barrier
    failed with "Broken pipe" (seen on 2 H200s). So every process adds itself, and the host waits for all.
    """
    import time

    if links.store is None:
        return
    links.store.add("left", 1)
    if links.launch_rank != 0:
        return
    deadline = time.monotonic() + timeout_s
    while links.store.add("left", 0) < links.launch_world_size and time.monotonic() < deadline:
        time.sleep(0.05)
