"""Host memory as the plan counts it: the node's available memory and training processes, and the pinned bytes a
setting takes there.

The offloaded blocks' frozen weights live in pinned host memory (one buffer pinned in place, exactly its bytes, in
their stored dtype). Where several training processes share a node and /dev/shm has the room, the node keeps one
copy in /dev/shm that each of them maps and pins (offload.NodeShare): K x (bytes of a block's matrices); otherwise
each process keeps its own, P x K x (bytes of a block's matrices). Plus, with DeepSpeed's optimizer offload, P x its
partition of the optimizer state (Sizes.host_state_bytes); choice.host_bytes counts it. A setting fits only when
that stays below the smallest available host memory of any rank (psutil) less Host.margin_bytes."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from train.plan.sizes import GB


@dataclass(frozen=True)
class Host:
    """This node's host memory as the plan counts it: the available bytes (the smallest any rank saw; inf = not
    counted) and the training processes that share it (each pins its own offloaded blocks)."""

    available_bytes: float = math.inf
    ranks_per_node: int = 1
    world_size: int = 1
    shm_bytes: float = 0.0  # free /dev/shm (the smallest any rank of the node saw): room for one shared copy

    def shares(self, blocks_bytes: float) -> bool:
        """Whether the node's processes share one copy of `blocks_bytes` of offloaded weights (offload.can_share:
        the rule the offloader follows)."""
        from train.model.offload import can_share

        return can_share(blocks_bytes, self.ranks_per_node, self.shm_bytes)

    @property
    def margin_bytes(self) -> float:
        """Left free beside the pinned buffers: 2 GB per process (the loader's tensor in flight, DeepSpeed's and
        torch's host buffers, the data workers' growth) and 5% of the available memory; an allowance, not a
        measurement."""
        return 0.0 if math.isinf(self.available_bytes) else 2 * GB * self.ranks_per_node + 0.05 * self.available_bytes

    @property
    def room_bytes(self) -> float:
        return self.available_bytes - self.margin_bytes


UNCOUNTED_HOST = Host()  # host memory not counted: everything fits it


def _host_available() -> float:
    import psutil  # a dependency of DeepSpeed's

    return float(psutil.virtual_memory().available)


def _ranks_per_node() -> int:
    env = os.environ
    return int(env.get("LOCAL_SIZE", env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))))


def node_host(world_size: int) -> Host:
    """This node's Host: the smallest available host memory any rank sees (a collective, so that every rank plans
    alike) and the processes per node from the launcher's environment."""
    from train.model.offload import shm_free_bytes
    from train.runtime.engine import all_gather_objects

    seen = all_gather_objects((_host_available(), shm_free_bytes()))
    return Host(min(a for a, _ in seen), _ranks_per_node(), world_size, min(f for _, f in seen))
