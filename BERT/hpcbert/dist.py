"""Distributed start-up in one function, and the few collectives the trainer needs.

The same path runs for 1 process (no torchrun) and N processes (torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT; a hand launch may set them too). gloo on CPU,
NCCL on CUDA, each rank pinned to its local GPU, threads per worker set explicitly.

Start-up waits with a timeout and says who is missing: every rank checks in to the rendezvous
TCPStore (hosted by rank 0, or by torchrun's agent) before the process group is created. A rank
that never arrives makes the others fail after `timeout_s` with a message naming it, instead of
hanging inside init_process_group (the most reported multi-node failure).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import platform
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


class StartupError(RuntimeError):
    """Distributed start-up failed; the message names the missing rank(s) and what to check."""

    def __init__(self, message: str, missing: list[int] | None = None):
        super().__init__(message)
        self.missing = missing or []


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None = None   # gloo / nccl; None for a single process
    threads: int = 1             # torch intra-op threads of this process
    host_allocator: str = "system"  # what tune_host_allocator() did: "glibc-retain" or "system"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def active(self) -> bool:
        return self.world_size > 1


def data_parallel(model: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """`model` under DDP: gradients all-reduced in 25 MB buckets, overlapping the rest of the
    backward pass, each parameter's gradient a view of its bucket (`gradient_as_bucket_view`). By
    default DDP keeps the gradients twice, in the parameters' `.grad` and again in its buckets
    (a copy of each in between); as views they are held once, as `hpcbert plan` counts them."""
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[d.local_rank] if d.device.type == "cuda" else None, bucket_cap_mb=25,
        gradient_as_bucket_view=True)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment: {name}={value!r} is not an integer") from e


def default_threads(local_world: int) -> int:
    """Cores this process may use (affinity mask, as set by Slurm/PBS cgroups) / local processes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world))


HOST_ALLOCATOR_ENV = "HPCBERT_HOST_ALLOCATOR"  # "system": leave the C library's malloc as it is
# mallopt(3) parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def tune_host_allocator() -> str:
    """Keep freed host memory in the process instead of handing it back to the kernel.

    PyTorch's CPU tensors come from malloc. glibc serves every block over its mmap threshold (at
    most 32 MiB) with a fresh mmap and unmaps it on free, so a training step that frees and
    reallocates the same activations and gradients every step pays a page fault and the kernel's
    zeroing for every 4 KiB of them, again each step (results/step_overhead/: without this, a
    minilm-l6 step at lengths up to 16 is 1.29x slower, 19,449 faults against 864; up to 128,
    1.10x). Intel's PyTorch CPU tuning guide swaps in jemalloc or tcmalloc for
    this; glibc does the same through mallopt: no mmap for blocks (served from the heap), and a
    trim threshold above any step's working set (freed memory stays mapped, reused next step).
    The process's resident size then stays at its peak, as under those allocators.

    Returns "glibc-retain" when applied; "system" where the C library is not glibc or
    HPCBERT_HOST_ALLOCATOR=system asks to leave it alone. Process-wide and idempotent."""
    setting = os.environ.get(HOST_ALLOCATOR_ENV, "")
    if setting not in ("", "retain", "system"):
        raise ValueError(f"environment: {HOST_ALLOCATOR_ENV}={setting!r}; accepted: retain (the default) or system")
    if setting == "system" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "system"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "system"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) and mallopt(_M_TOP_PAD, 64 << 20)
    return "glibc-retain" if ok else "system"


def init(threads: int | None = None, timeout_s: float = 600.0, device: str | None = None) -> Dist:
    """Read torchrun's environment, choose the device and backend, set threads, init the group.

    timeout_s bounds the start-up wait for every rank and every later collective."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    if not 0 <= rank < world:
        raise ValueError(f"environment: RANK={rank} is outside WORLD_SIZE={world}")
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda:
        n_gpu = torch.cuda.device_count()
        if local_rank >= n_gpu:
            raise ValueError(f"environment: LOCAL_RANK={local_rank} but this node has {n_gpu} visible GPU(s); "
                             f"start at most {n_gpu} processes per node (--nproc-per-node)")
        torch.cuda.set_device(local_rank)  # pin: this rank only ever touches its own GPU
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    # Explicit threads per worker: schedulers export OMP_NUM_THREADS = all cores of the chunk,
    # and N workers x all cores oversubscribe the CPU.
    n_threads = threads or default_threads(local_world)
    torch.set_num_threads(n_threads)
    allocator = tune_host_allocator()
    backend = None
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        store = _check_in(rank, world, timeout_s)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if use_cuda else None)
    elif dist.is_initialized():
        backend = dist.get_backend()
    return Dist(rank, world, local_rank, local_world, dev, backend, n_threads, allocator)


def _check_in(rank: int, world: int, timeout_s: float) -> dist.Store:
    """Check in to the env:// rendezvous store (MASTER_ADDR:MASTER_PORT) and wait for all ranks;
    returns the store for init_process_group."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MASTER_PORT", 29500)
    # Under torchrun the agent may host the store (TORCHELASTIC_USE_AGENT_STORE=True); otherwise
    # rank 0 hosts it, exactly as init_process_group's env:// rendezvous would.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    prefix = f"hpcbert/start{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # fresh keys per restart
    rv = Rendezvous(addr, port, prefix, host_store=(rank == 0 and not agent_store),
                    store_host="torchrun's agent on the head node" if agent_store else "rank 0")
    return dist.PrefixStore(f"{prefix}/pg", check_in(rank, world, timeout_s, rv))


@dataclass(frozen=True)
class Rendezvous:
    """Where and how members check in: the store at addr:port under key `prefix`, hosted by this
    member or not; `who` (rank / node), `option` (the timeout's flag), `store_host` and `busy_hint`
    (what to do when the port is taken on the member that hosts the store) word the errors."""
    addr: str
    port: int
    prefix: str
    host_store: bool
    who: str = "rank"
    option: str = "--dist-timeout"
    store_host: str = "rank 0"
    busy_hint: str = "set MASTER_PORT to a free port"


def check_in(rank: int, world: int, timeout_s: float, rv: Rendezvous,
             shared: dict[str, str] | None = None) -> dist.TCPStore:
    """Every member (rank, or node for the launcher) announces itself in a TCPStore at addr:port
    and waits until all `world` have. Raises StartupError naming the members that did not arrive
    within timeout_s; member 0 publishes the list so every waiting member reports the same.
    `shared`: member 0's values are published before it arrives, and every other member's dict
    (same keys) is filled with them once all have arrived (the launcher's torchrun port)."""
    addr, port, host_store, prefix, who, option, store_host = (rv.addr, rv.port, rv.host_store, rv.prefix, rv.who,
                                                                rv.option, rv.store_host)
    where = f"{addr}:{port}"
    deadline = time.monotonic() + timeout_s
    unreachable = (f"{store_host} never started or is unreachable from {socket.gethostname()} "
                   f"(missing {who}: 0).")
    if not host_store:
        # Wait for the store's port ourselves: TCPStore's client retries past its timeout (about
        # twice it) and logs C++ stack traces; a plain connect loop keeps the bound exact.
        while not _port_open(addr, port):
            if time.monotonic() > deadline:
                raise StartupError(f"{who} {rank}: nothing listens at the rendezvous store {where} after "
                                   f"{timeout_s:g} s ({option}); {unreachable}", [0])
            time.sleep(0.1)
    try:
        store = dist.TCPStore(addr, port, world_size=world, is_master=host_store,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              multi_tenant=True)
    except (RuntimeError, dist.DistError) as e:
        if host_store and ("EADDRINUSE" in str(e) or "already in use" in str(e)):
            raise StartupError(f"{who} {rank} hosts the rendezvous store but cannot listen on port {port}: another "
                               f"process on {socket.gethostname()} holds it; {rv.busy_hint}. Underlying error: {e}",
                               []) from None
        raise StartupError(f"{who} {rank}: could not open the rendezvous store at {where} within {timeout_s:g} s; "
                           f"{unreachable} Underlying error: {e}", [] if host_store else [0]) from None
    key = lambda r: f"{prefix}/{who}{r}"  # noqa: E731
    if rank == 0:
        for k, v in (shared or {}).items():
            store.set(f"{prefix}/shared/{k}", v)
    store.set(key(rank), socket.gethostname())
    store.add(f"{prefix}/arrived", 1)
    grace = 0.0 if rank == 0 else 5.0  # the others allow member 0 a little longer to publish its list
    try:
        while True:
            if store.add(f"{prefix}/arrived", 0) >= world:
                if rank != 0:  # member 0 set these before it arrived; it keeps the store up until "done"
                    for k in shared or {}:
                        shared[k] = store.get(f"{prefix}/shared/{k}").decode()
                store.add(f"{prefix}/done", 1)
                if host_store:  # keep the store up until every member has seen that all arrived
                    until = time.monotonic() + 10.0
                    while store.add(f"{prefix}/done", 0) < world and time.monotonic() < until:
                        time.sleep(0.02)
                return store
            if rank != 0 and store.check([f"{prefix}/missing"]):
                missing = store.get(f"{prefix}/missing").decode()
                raise StartupError(_missing_message(who, rank, missing, timeout_s, where, option), _ids(missing))
            if time.monotonic() > deadline + grace:
                break
            time.sleep(0.05)
        missing = ",".join(str(r) for r in range(world) if not store.check([key(r)]))
        if rank == 0:
            store.set(f"{prefix}/missing", missing)
            time.sleep(2.0)  # keep the store up while the others read the list
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, StartupError):
            raise
        raise StartupError(f"{who} {rank}: lost the rendezvous store at {where} (hosted by {store_host}) while "
                           f"waiting for all {world}; it stopped or the network failed: {e}") from None
    raise StartupError(_missing_message(who, rank, missing, timeout_s, where, option), _ids(missing))


def _ids(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",") if x]


def _port_open(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


def _missing_message(who: str, rank: int, missing: str, timeout_s: float, where: str, option: str) -> str:
    ids = missing.split(",") if missing else []
    return (f"{who} {rank}: {who}(s) {', '.join(ids)} never arrived at the rendezvous store at {where} "
            f"within {timeout_s:g} s ({option}). Check that {who} {ids[0] if ids else '?'} was started "
            f"(and its node reaches {where}), and that the {'WORLD_SIZE' if who == 'rank' else 'host list'} "
            f"is right.")


# --- the collectives the trainer needs (all of them live here) -----------------------------------

def all_gather_ints(d: Dist, value: int) -> list[int]:
    """Every rank's `value`, in rank order (one small collective)."""
    return [int(x) for x in _all_gather_number(d, int(value), torch.int64)]


def all_gather_floats(d: Dist, value: float) -> list[float]:
    """Every rank's `value`, in rank order (one small collective)."""
    return [float(x) for x in _all_gather_number(d, float(value), torch.float64)]


def _all_gather_number(d: Dist, value: int | float, dtype: torch.dtype) -> list:
    if not d.active:
        return [value]
    t = torch.zeros(d.world_size, dtype=dtype, device=d.device)
    t[d.rank] = value
    dist.all_reduce(t)  # every other rank's slot is 0: the sum is the gather
    return t.tolist()


def all_gather_objects(d: Dist, obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (evaluation: predictions of every rank)."""
    if not d.active:
        return [obj]
    out: list[Any] = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(d: Dist, obj: Any) -> Any:
    """Rank 0's `obj` on every rank. Decisions about files are rank 0's (which run directory,
    which checkpoint): on a shared file system with stale directory caches, ranks must not each
    decide. An exception object broadcast this way is re-raised on every rank by the caller."""
    if not d.active:
        return obj
    box = [obj if d.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def decide(d: Dist, fn: Callable[[], Any]) -> Any:
    """Rank 0 runs `fn()`; every rank returns its result, or raises the error it raised, so a bad
    --resume path or data file fails on every rank with rank 0's message (instead of leaving the
    others waiting in a collective until the timeout)."""
    if not d.active:
        return fn()
    result: Any = None
    error: BaseException | None = None
    if d.is_main:
        try:
            result = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
            result = ("error", e if isinstance(e, (ValueError, OSError)) else RuntimeError(f"rank 0: {e!r}"))
    kind, value = broadcast_object(d, result)
    if error is not None:
        raise error
    if kind == "error":
        raise value
    return value


class Agreement:
    """The one all-reduce per optimizer step: every value the ranks must agree on, summed.

    A step posts a float64 vector (stop request, signals, save request, loss, non-finite
    gradient, token counts, ...); values only rank 0 may set (its clock, its view of the stop file)
    are zero elsewhere, so the sum is rank 0's value. On CUDA the vector is built and reduced on
    the device without waiting for it, and copied back into pinned host memory behind that step's
    work alone (an event marks the copy); the host reads it `lag` steps later (one step behind by
    default), waiting for that copy only, while the next step stays queued on the device, which is
    never left idle. (A read of the device vector itself would wait for every step queued after it
    too.) On CPU the result is read at once (nothing to overlap)."""

    def __init__(self, d: Dist, lag: int | None = None):
        self.d = d
        self.lag = (1 if d.device.type == "cuda" else 0) if lag is None else lag
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def post(self, tag: Any, host: list[float], device_values: list[torch.Tensor] = ()) -> None:
        """Start reducing `host` + `device_values` (0-dim tensors); `tag` comes back with the result."""
        h = torch.tensor(host, dtype=torch.float64)
        if self.d.device.type == "cuda":
            h = h.pin_memory().to(self.d.device, non_blocking=True)  # no host wait for the copy
        parts = [h] + [v.detach().to(torch.float64).reshape(1) for v in device_values]
        vec = torch.cat(parts) if len(parts) > 1 else h
        if self.d.active:
            dist.all_reduce(vec)  # NCCL: stream-ordered, returns without waiting for the device
        copied = None
        if vec.is_cuda:
            host_vec = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            host_vec.copy_(vec, non_blocking=True)  # queued behind this step, before the next one
            copied = torch.cuda.Event()
            copied.record()
            vec = host_vec
        self.pending.append((tag, vec, copied))

    def ready(self, flush: bool = False) -> list[tuple[Any, list[float]]]:
        """Results whose turn has come (all of them with flush=True), oldest first."""
        out = []
        while self.pending and (flush or len(self.pending) > self.lag):
            tag, vec, copied = self.pending.pop(0)
            if copied is not None:
                copied.synchronize()  # CPU-GPU sync point: this step's copy, `lag` steps behind the device
            out.append((tag, vec.tolist()))
        return out


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()


def shutdown(d: Dist) -> None:
    if d.active and dist.is_initialized():
        dist.destroy_process_group()
