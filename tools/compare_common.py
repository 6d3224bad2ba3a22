"""What the comparison scripts in tools/ (vllm_compare, sglang_compare, lmcache_compare) share:
the process's CPU time, and settling the disk between phases."""

from __future__ import annotations

import os
import resource
import time


def cpu_seconds() -> float:
    """User + system CPU of this process (every thread) so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def settle(drop: bool) -> bool:
    """Everything written so far on the disk; the page cache dropped when `drop` and allowed
    (root). True if it was dropped."""
    os.sync()
    dropped = False
    if drop:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            dropped = True
        except OSError:
            pass
    time.sleep(0.3)
    return dropped
