"""hpcbert: train and benchmark BERT on HPC clusters."""

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
