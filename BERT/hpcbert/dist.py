"""Distributed start-up in one function, and the few collectives the trainer needs.

The same path runs for 1 process (no torchrun) and N processes (torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT). gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def active(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment: {name}={value!r} is not an integer") from e


def init(threads: int | None = None, timeout_s: float = 300.0, device: str | None = None) -> Dist:
    """Read torchrun's environment, choose the device and backend, set threads, init the group."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    # Explicit threads per worker: schedulers export OMP_NUM_THREADS = all cores of the chunk,
    # and N workers x all cores oversubscribe the CPU.
    n_threads = threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(n_threads)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if use_cuda else None)
    return Dist(rank, world, local_rank, local_world, dev)


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()


def shutdown(d: Dist) -> None:
    if d.active and dist.is_initialized():
        dist.destroy_process_group()
