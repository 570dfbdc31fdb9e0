"""Frozen transformer blocks kept in pinned host memory and copied to the GPU ahead of use (train.offload_blocks).

Why not diffusers' group offloading (`apply_group_offloading`): it is built for inference. It prefetches in the
order of the first forward only, so the backward's recomputation (which walks the blocks in reverse) would load
every block synchronously, and it moves whole modules, including the LoRA adapters whose parameters DeepSpeed
owns and has flattened into its own buffers. Here only the frozen tensors of a block move, and the prefetch
order follows the direction of the pass.

Scheme. Each offloaded block's frozen tensors (its linears' weights, fp8 or not, and their scales) live in one slice
of a host buffer that is pinned in place once filled (cudaHostRegister: exactly its bytes, where torch's pinned
tensors are rounded up to a power of two). The GPU holds `num_slots` (2) buffers of the size of the largest block. A
forward pre-hook on the block binds its tensors to views of the slot that holds it (copying it there first if no
prefetch did), then starts copying the block that runs next into the other slot on a side stream: the next block in
a forward, the previous one inside the backward (where the blocks are recomputed in reverse). The copy waits for an
event recorded on the compute stream at that moment, so it never overwrites a slot before the kernels already issued
for the block that used it have run; the block's own kernels wait for its copy's event.

Why this is safe for the backward: offloaded blocks are always activation-checkpointed (config check), so their
forward saves no weight for the backward; the recomputation inside the backward does, and the block's views stay
valid until its slot is reused, which is when the block two places earlier is prefetched. By then every kernel
that reads the block's weights (the input-gradient path, which the earlier block's gradient depends on) has been
issued. An evicted block's tensors are rebound to NaN placeholders, so a read that broke this rule would show as
a NaN loss instead of silently wrong numbers; tests/test_offload.py checks gradients against resident blocks.
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 256  # byte alignment of each tensor inside a slot (what CUDA kernels assume of an allocation)
SHM_DIR = Path("/dev/shm")
SHM_SPARE_BYTES = 2e9  # left free in /dev/shm: the data loader's workers pass their batches through it
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


class ShareError(RuntimeError):
    """/dev/shm could not take the node's shared copy after all (another job filled it after the check)."""

    without_traceback = True  # engine.exit_with prints the message alone


@dataclass(frozen=True)
class NodeShare:
    """One copy per node of the offloaded blocks' host buffers: a file under /dev/shm that every training process
    of the node maps; the node's first process (`writer`) fills it, and each process registers the mapping as
    pinned memory with CUDA (the way torch.distributed's state-dict staging pins shared memory)."""

    path: str
    writer: bool


def shm_free_bytes() -> float:
    """Free bytes of /dev/shm (0 where there is none)."""
    try:
        return float(shutil.disk_usage(SHM_DIR).free)
    except OSError:
        return 0.0


def can_share(total_bytes: float, ranks_per_node: int, shm_free: float) -> bool:
    """Whether the node's processes share one copy of `total_bytes` of offloaded weights (several processes, and
    /dev/shm holds it with SHM_SPARE_BYTES to spare); the memory plan counts host memory by the same rule."""
    return ranks_per_node > 1 and total_bytes > 0 and total_bytes + SHM_SPARE_BYTES <= shm_free


def _my_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def node_share(total_bytes: float) -> NodeShare | None:
    """The NodeShare of this process for `total_bytes` of offloaded weights, or None (each process keeps its own
    copy): decided alike by the node's processes from the smallest /dev/shm room any of them sees. A collective
    when a process group is up."""
    from train.runtime.engine import all_gather_objects

    host = socket.gethostname()
    seen = all_gather_objects((host, shm_free_bytes(), uuid.uuid4().hex))  # in rank order
    mine = [rank for rank, x in enumerate(seen) if x[0] == host]
    if not can_share(total_bytes, len(mine), min(seen[r][1] for r in mine)):
        return None
    token = seen[0][2]  # the run's: one name per node and run
    # one writer per host name (its lowest rank), even where several launcher nodes share a host name
    share = NodeShare(str(SHM_DIR / f"qwen_edit_offload_{token}_{host}"), writer=_my_rank() == mine[0])
    if share.writer:  # the file, empty until the offloader fills it: every process must see it
        os.close(os.open(share.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    all_gather_objects(True)  # the writer has made it
    if all(all_gather_objects(os.path.exists(share.path))):
        return share
    if share.writer:  # a process of this host name sees another /dev/shm (a container of its own): no sharing
        os.unlink(share.path)
    return None


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` that owns one element (a NaN where the dtype has one): stands in for weights that are
    not on the device, with the right shape, dtype and device for anything that only reads those (peft)."""
    fill = float("nan") if dtype.is_floating_point else 0
    return torch.full((1,), fill, dtype=dtype, device=device).expand(shape)


def _unregister(whole: torch.Tensor, device: torch.device) -> None:
    """Undo BlockOffloader._pin's cudaHostRegister before `whole`'s memory is freed (its last reference goes with
    this call), once no copy can still be reading it."""
    torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(whole.data_ptr())


def _pinned_copy(whole: torch.Tensor) -> torch.Tensor:
    """A copy of `whole` in pinned memory from torch's allocator (where CUDA will not pin `whole` in place)."""
    own = torch.empty(whole.numel(), dtype=torch.uint8, pin_memory=True)
    return own.copy_(whole)


def moves(t: torch.Tensor) -> bool:
    """Whether an offloaded block's frozen tensor lives on the host: the matrices do; vectors (biases, norm
    scales, fp8 row scales) are a fraction of a percent of the bytes and stay on the device."""
    return t.dim() >= 2


def _frozen_tensors(block: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool]]:
    """(owner module, attribute name, is_parameter) of each frozen tensor of `block` worth moving (parameters
    among them become buffers in the offloader)."""
    found = []
    for module in block.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad and moves(p):
                found.append((module, name, True))
        for name, b in module.named_buffers(recurse=False):
            if b is not None and moves(b):
                found.append((module, name, False))
    return found


def _get(owner: torch.nn.Module, name: str) -> torch.Tensor:
    return owner._buffers[name]


def _bind(owner: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner._buffers[name] = tensor  # `module.weight` reads a buffer as it read the parameter


def _as_buffer(owner: torch.nn.Module, name: str) -> None:
    """Re-register the frozen parameter `name` as a (non-persistent) buffer, as fp8 weights already are: DeepSpeed
    broadcasts every parameter at start (placeholders cannot be sent), and compiled blocks take buffers as inputs,
    so swapping them does not recompile. Frozen weights are in no checkpoint either way."""
    owner.register_buffer(name, owner._parameters.pop(name).detach(), persistent=False)


class _Layout:
    """Where each frozen tensor of one block sits in a flat byte buffer."""

    def __init__(self, tensors: list[tuple[torch.nn.Module, str]]):
        self.entries, offset = [], 0
        for owner, name in tensors:
            t = _get(owner, name)
            nbytes = t.numel() * t.element_size()
            self.entries.append((owner, name, offset, t.shape, t.dtype))
            offset += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = offset

    def views(self, flat: torch.Tensor):
        for owner, name, offset, shape, dtype in self.entries:
            nbytes = shape.numel() * dtype.itemsize
            yield owner, name, flat[offset:offset + nbytes].view(dtype).view(shape)


class BlockOffloader:
    """Keeps the frozen tensors of `blocks` (index -> module) in pinned host memory; see the module docstring.

    The blocks' tensors may be anywhere when this is built: block by block they are copied into the pinned buffers
    and replaced by placeholders, so host memory peaks one block above the final footprint (the streaming loader
    leaves them in ordinary host memory, so a block never exists on the GPU whole).
    """

    def __init__(self, blocks: dict[int, torch.nn.Module], device: torch.device, num_slots: int = 2,
                 share: NodeShare | None = None):
        if num_slots < 2:
            raise ValueError("an offloader needs at least 2 slots (one computing, one being filled)")
        self.device, self.order = torch.device(device), sorted(blocks)
        self.blocks = blocks
        tensors = {i: _frozen_tensors(b) for i, b in blocks.items()}
        for found in tensors.values():
            for owner, name, is_param in found:
                if is_param:
                    _as_buffer(owner, name)
        self.layouts = {i: _Layout([(owner, name) for owner, name, _ in found]) for i, found in tensors.items()}
        self.shared = share is not None
        self.host = self._shared_buffers(share) if share is not None else self._own_buffers()
        writes = share is None or share.writer  # the others' tensors are placeholders (streaming.Placement)
        for i, layout in self.layouts.items():
            for owner, name, view in layout.views(self.host[i]):
                if writes:
                    view.copy_(_get(owner, name))
                _bind(owner, name, placeholder(view.shape, view.dtype, self.device))
        if share is not None:
            from train.runtime.engine import all_gather_objects

            all_gather_objects(True)  # the writer has filled the buffers
        if self.device.type == "cuda":
            self._pin()
        slot_bytes = max((lay.nbytes for lay in self.layouts.values()), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_slots)]
        self.resident: list[int | None] = [None] * num_slots  # block index held by each slot
        self.last_used = [0] * num_slots  # fetch counter at each slot's last use (the older one is refilled)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.ready = [torch.cuda.Event() if cuda else None for _ in range(num_slots)]
        self.copies = self.fetches = self.waited = 0  # block copies, block uses, uses not prefetched, so far
        self.handles = [b.register_forward_pre_hook(self._pre_hook(i)) for i, b in blocks.items()]

    def _shared_buffers(self, share: NodeShare) -> dict[int, torch.Tensor]:
        """Each block's host buffer as a slice of the node's shared file (NodeShare). ShareError on every process
        when the writer cannot reserve it: the other processes did not load these weights (the streaming loader
        left them to the writer), and one copy per process is not what the memory plan counted."""
        from train.runtime.engine import all_gather_objects

        total = sum(layout.nbytes for layout in self.layouts.values())
        problem = None
        if share.writer:
            try:
                fd = os.open(share.path, os.O_RDWR)  # node_share made it
                try:
                    os.posix_fallocate(fd, 0, total)  # every page now: a full /dev/shm fails here, not mid-copy
                finally:
                    os.close(fd)
            except OSError as e:
                problem = f"{share.path}: {e}"
                if os.path.exists(share.path):
                    os.unlink(share.path)
        problems = [x for x in all_gather_objects(problem) if x]
        if problems:
            raise ShareError(f"offloaded blocks: {SHM_DIR} could not take the node's shared copy of "
                             f"{total / 1e9:.1f} GB ({problems[0]}). Free {SHM_DIR} (other jobs' files, a larger "
                             "docker --shm-size) or offload fewer blocks (qwen_edit.memory.budget_gb higher, "
                             "train.offload_blocks lower)")
        whole = torch.from_file(share.path, shared=True, size=total, dtype=torch.uint8)
        all_gather_objects(True)  # every process has mapped it: the name can go, the pages stay until all exit
        if share.writer:
            os.unlink(share.path)
        return self._slices(whole)

    def _own_buffers(self) -> dict[int, torch.Tensor]:
        """Each block's host buffer as a slice of one ordinary allocation of this process, pinned once it is
        filled (_pin). Its pages appear as the blocks are copied in, so host memory peaks about one block above the
        final footprint, and pinning it whole costs its size: torch's own pinned tensors are each rounded up to a
        power of two (CachingHostAllocator), which costs a 0.34 GB fp8 block 0.54 GB."""
        return self._slices(torch.empty(sum(layout.nbytes for layout in self.layouts.values()), dtype=torch.uint8))

    def _slices(self, whole: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each block's buffer as a consecutive slice of `whole` (kept as self._whole, what _pin registers)."""
        self._whole, slices, offset = whole, {}, 0
        for i, layout in self.layouts.items():
            slices[i], offset = whole[offset: offset + layout.nbytes], offset + layout.nbytes
        return slices

    def _pin(self) -> None:
        """Register the filled host buffer with CUDA as pinned memory (cudaHostRegister: exactly its pages, also
        for the node's shared mapping), so that its copies to the device run asynchronously, and unregister it
        when this offloader goes. Where CUDA refuses, keep a pinned copy made by torch (rounded up to a power of
        two) and say so."""
        whole = self._whole
        err = int(torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), whole.numel(), CUDA_HOST_REGISTER_PORTABLE))
        if err == 0:
            weakref.finalize(self, _unregister, whole, self.device).atexit = False  # exit frees it anyway
            return
        print(f"offloaded blocks: CUDA could not pin the host buffer in place (cudaError {err}); this process "
              f"keeps a pinned copy of its own, {whole.numel() / 1e9:.1f} GB that torch's pinned allocator rounds "
              "up to a power of two", flush=True)
        own = _pinned_copy(whole)
        self.host = {i: own[buf.data_ptr() - whole.data_ptr():][: buf.numel()] for i, buf in self.host.items()}
        self.shared, self._whole = False, None

    @property
    def host_bytes(self) -> int:
        return sum(flat.numel() for flat in self.host.values())

    @property
    def device_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def _pre_hook(self, index: int):
        @torch.compiler.disable  # stream and binding work stays outside compiled block graphs
        def hook(module, args):
            self.fetch(index)

        return hook

    def _next(self, index: int) -> int:
        """The offloaded block that runs after `index`: the next one in a forward; inside the backward the
        previous one (checkpointed blocks are recomputed in reverse). At either end the same block runs again
        (the backward starts where the forward ended), so nothing new is needed."""
        k = self.order.index(index)
        in_backward = torch._C._current_graph_task_id() != -1
        k = max(k - 1, 0) if in_backward else min(k + 1, len(self.order) - 1)
        return self.order[k]

    def _load(self, index: int, avoid: int | None) -> int:
        """Start copying block `index` into a slot other than `avoid`; returns the slot."""
        candidates = [s for s in range(len(self.slots)) if s != avoid]
        empty = [s for s in candidates if self.resident[s] is None]
        slot = empty[0] if empty else min(candidates, key=lambda s: self.last_used[s])
        evicted = self.resident[slot]
        if evicted is not None:
            for owner, name, view in self.layouts[evicted].views(self.slots[slot]):
                _bind(owner, name, placeholder(view.shape, view.dtype, self.device))
        dst, src = self.slots[slot][: self.layouts[index].nbytes], self.host[index]
        if self.stream is None:
            dst.copy_(src)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # kernels that read this slot first
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                self.ready[slot].record(self.stream)
        self.resident[slot] = index
        self.copies += 1
        return slot

    def fetch(self, index: int) -> None:
        """Make block `index`'s tensors point at a slot holding its weights, then prefetch the block after it."""
        if index in self.resident:
            slot = self.resident.index(index)
        else:  # not prefetched: only the very first use, or after a pass that ran the blocks out of order
            slot = self._load(index, avoid=None)
            self.waited += 1
        self.fetches += 1
        self.last_used[slot] = self.fetches
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        for owner, name, view in self.layouts[index].views(self.slots[slot]):
            _bind(owner, name, view)
        nxt = self._next(index)
        if nxt not in self.resident:
            self._load(nxt, avoid=slot)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

