"""hpcbert: train and benchmark BERT on HPC clusters."""

from __future__ import annotations

import os as _os
import time as _time

__version__ = "0.1.0"


def _process_start_time() -> float:
    """Wall-clock time at which this process started (time budgets count from here).

    Linux: /proc/self/stat field 22 is the start time in clock ticks since boot, /proc/uptime the
    seconds since boot. Elsewhere: the time this package was imported.
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / _os.sysconf("SC_CLK_TCK")
        return _time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return _time.time()


PROCESS_START = _process_start_time()


# PyTorch's CUDA caching allocator, as hpcbert runs it unless the user configured it: expandable
# segments (what torchtitan launches with). An unpadded batch has a new token count every step, so
# its tensors change size every step; the default allocator carves them out of fixed segments and
# can fail a large batch on fragmentation with memory free. Expandable segments map memory into one
# address range per stream that grows and shrinks instead. torch reads the setting when CUDA first
# allocates, so it is set before that; processes started from this one (torchrun's ranks) inherit it.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the newer name first; torch reads both
ALLOC_CONF_DEFAULT = "expandable_segments:True"


def cuda_allocator_settings(environ=None) -> str | None:
    """The CUDA allocator settings `environ` (default os.environ) gives torch; None: torch's default."""
    env = _os.environ if environ is None else environ
    return next((env[name] for name in ALLOC_CONF_VARS if env.get(name, "").strip()), None)


def cuda_allocator_default(environ=None) -> str:
    """The allocator settings this process's CUDA runs with: the user's (either variable, not empty),
    else ALLOC_CONF_DEFAULT, then set in `environ` (default os.environ) under the name every torch
    version reads. To run PyTorch's default allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False."""
    env = _os.environ if environ is None else environ
    settings = cuda_allocator_settings(env)
    if settings is None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = settings = ALLOC_CONF_DEFAULT
    return settings
