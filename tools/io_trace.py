#!/usr/bin/env python3
"""Where a store's or a load's time goes: io_uring ops, system calls and the block layer, from a
`perf record` of kernel tracepoints, per time window.

Record (whole machine, timestamps on CLOCK_MONOTONIC so they line up with the windows):

    perf record -a -k CLOCK_MONOTONIC -o io.data \\
        -e io_uring:io_uring_submit_req -e io_uring:io_uring_complete \\
        -e io_uring:io_uring_queue_async_work \\
        -e raw_syscalls:sys_enter -e raw_syscalls:sys_exit \\
        -e block:block_rq_issue -e block:block_rq_complete -- COMMAND

then report on windows given as START,END (CLOCK_MONOTONIC seconds), or read from the
`phase ...` lines `tools/vllm_compare.py --marks` prints to stderr:

    python tools/io_trace.py io.data --marks marks.txt [--phase store]
    python tools/io_trace.py io.data --window 1234.5,1235.3

Per window it prints:
* io_uring ops by opcode (every ring traced): count, the share the kernel handed to its io-wq
  workers ("async"), and latency from submission to completion (mean, p50, p90, p99), which for
  an async op includes its wait for a free io-wq worker;
* system calls of threads not named `kvtier*` (another tier's blocking I/O threads, a caller):
  count and latency by call;
* the block layer by device and direction: requests, mean size, mean requests in flight
  (matched issue-to-complete time over the window: Little's law), latency, and MiB/s;
* when the first and the last write reached each device, against the window's start and end
  (how long the device waited for a phase to get going and to finish).
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import subprocess
import sys

LINE = re.compile(r"^\s*(.+?)\s+(\d+)\s+(\d+\.\d+):\s+(\S+):\s+(.*)$")
REQ = re.compile(r"req(?:uest)? (0x[0-9a-f]+)")
OPCODE = re.compile(r"opcode (\w+)")
NR = re.compile(r"NR (\d+)")
# block_rq_issue: "254,0 WS 262144 () 384756736 + 512 ..."; block_rq_complete lacks the bytes.
BLOCK = re.compile(r"(\d+,\d+) (\S+) (?:\d+ )?\((.*?)\) (\d+) \+ (\d+)")

# x86-64 system call numbers worth naming (others print as numbers).
SYSCALLS = {
    0: "read", 1: "write", 2: "open", 3: "close", 4: "stat", 5: "fstat", 7: "poll", 8: "lseek",
    9: "mmap", 11: "munmap", 17: "pread64", 18: "pwrite64", 19: "readv", 20: "writev",
    21: "access", 24: "sched_yield", 28: "madvise", 35: "nanosleep", 74: "fsync",
    75: "fdatasync", 82: "rename", 83: "mkdir", 87: "unlink", 188: "setxattr",
    190: "fsetxattr", 193: "fgetxattr", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait",
    257: "openat", 258: "mkdirat", 262: "newfstatat", 263: "unlinkat", 264: "renameat",
    271: "ppoll", 316: "renameat2", 332: "statx", 426: "io_uring_enter", 437: "openat2",
}


def quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0


def read_events(data: str, start: float, end: float):
    """The tracepoint events of `data` in [start, end], in time order."""
    out = subprocess.run(
        ["perf", "script", "-i", data, "--time", f"{start:.6f},{end:.6f}",
         "-F", "comm,tid,time,event,trace"],
        check=True, capture_output=True, text=True).stdout
    events = []
    for line in out.splitlines():
        m = LINE.match(line)
        if m:
            events.append((float(m.group(3)), m.group(1), int(m.group(2)), m.group(4),
                           m.group(5)))
    events.sort(key=lambda e: e[0])
    return events


def report(events, start: float, end: float) -> None:
    submitted: dict[str, tuple[float, str]] = {}
    went_async: set[str] = set()
    uring = collections.defaultdict(list)
    uring_async = collections.Counter()
    in_call: dict[int, tuple[float, int, str]] = {}
    calls = collections.defaultdict(list)
    callers = collections.defaultdict(set)
    issued: dict[tuple[str, int], tuple[float, int]] = {}
    block_lat = collections.defaultdict(list)
    block_bytes = collections.defaultdict(list)
    first_last: dict[tuple[str, str], list[float]] = {}
    for t, comm, tid, name, trace in events:
        if name == "io_uring:io_uring_submit_req":
            req, op = REQ.search(trace), OPCODE.search(trace)
            if req and op:
                submitted[req.group(1)] = (t, op.group(1))
                went_async.discard(req.group(1))
        elif name == "io_uring:io_uring_queue_async_work":
            req = REQ.search(trace)
            if req:
                went_async.add(req.group(1))
        elif name == "io_uring:io_uring_complete":
            req = REQ.search(trace)
            if req and req.group(1) in submitted:
                t0, op = submitted.pop(req.group(1))
                uring[op].append(t - t0)
                if req.group(1) in went_async:
                    uring_async[op] += 1
                    went_async.discard(req.group(1))
        elif name == "raw_syscalls:sys_enter":
            nr = NR.search(trace)
            if nr:
                in_call[tid] = (t, int(nr.group(1)), comm)
        elif name == "raw_syscalls:sys_exit":
            if tid in in_call:
                t0, nr, who = in_call.pop(tid)
                if not who.startswith("kvtier"):
                    call = SYSCALLS.get(nr, str(nr))
                    calls[call].append(t - t0)
                    callers[call].add(who)
        elif name in ("block:block_rq_issue", "block:block_rq_complete"):
            m = BLOCK.match(trace)
            if not m:
                continue
            dev, rwbs, sector, sectors = m.group(1), m.group(2), int(m.group(4)), int(m.group(5))
            kind = "W" if "W" in rwbs else "R" if "R" in rwbs else None
            if kind is None:
                continue  # flushes, discards
            if name == "block:block_rq_issue":
                if sectors:
                    issued[(dev, sector)] = (t, sectors * 512)
                    span = first_last.setdefault((dev, kind), [t, t])
                    span[1] = t
            elif (dev, sector) in issued:
                t0, size = issued.pop((dev, sector))
                block_lat[(dev, kind)].append(t - t0)
                block_bytes[(dev, kind)].append(size)
                first_last[(dev, kind)][1] = t
    span = end - start
    print("  io_uring ops:   opcode        count  async %   mean µs    p50 µs    p90 µs    p99 µs")
    for op, xs in sorted(uring.items(), key=lambda kv: -len(kv[1])):
        print(f"    {op:22s} {len(xs):7d} {100 * uring_async[op] / len(xs):7.0f} "
              f"{1e6 * statistics.mean(xs):9.0f} {1e6 * quantile(xs, .5):9.0f} "
              f"{1e6 * quantile(xs, .9):9.0f} {1e6 * quantile(xs, .99):9.0f}")
    print("  system calls (threads not named kvtier*):  call   count   mean µs    p50 µs"
          "    p90 µs  total s  threads")
    for call, xs in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"    {call:22s} {len(xs):7d} {1e6 * statistics.mean(xs):9.0f} "
              f"{1e6 * quantile(xs, .5):9.0f} {1e6 * quantile(xs, .9):9.0f} {sum(xs):8.2f}  "
              f"{','.join(sorted(callers[call]))[:40]}")
    print("  block layer:    dev  dir  requests  mean KiB  in flight   mean µs    p50 µs"
          "    p90 µs     MiB/s  first ms  last ms (to the end)")
    for key in sorted(block_lat):
        lat, size = block_lat[key], block_bytes[key]
        first, last = first_last[key]
        print(f"    {key[0]:>10s}  {key[1]}  {len(lat):9d} {statistics.mean(size) / 1024:9.0f} "
              f"{sum(lat) / span:10.1f} {1e6 * statistics.mean(lat):9.0f} "
              f"{1e6 * quantile(lat, .5):9.0f} {1e6 * quantile(lat, .9):9.0f} "
              f"{sum(size) / span / 2**20:9.0f} {1e3 * (first - start):9.1f} "
              f"{1e3 * (end - last):8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="perf.data recorded as above")
    ap.add_argument("--window", action="append", default=[],
                    help="START,END in CLOCK_MONOTONIC seconds (repeat)")
    ap.add_argument("--marks", help="stderr of tools/vllm_compare.py --marks: its phase lines")
    ap.add_argument("--phase", choices=["store", "load"], default=None,
                    help="with --marks: only this phase")
    args = ap.parse_args()
    windows = []
    for w in args.window:
        a, b = (float(x) for x in w.split(","))
        windows.append((f"window {a:.3f}-{b:.3f}", a, b))
    if args.marks:
        for line in open(args.marks):
            word = line.split()
            # phase TIER store|load BLOCK_BYTES JOBS START END
            if len(word) == 7 and word[0] == "phase" and args.phase in (None, word[2]):
                windows.append((f"{word[1]} {word[2]}, {word[3]} B blocks, {word[4]} job(s)",
                                float(word[5]), float(word[6])))
    if not windows:
        ap.error("no window: give --window or --marks")
    for title, a, b in windows:
        print(f"== {title}: {b - a:.3f} s")
        report(read_events(args.data, a, b), a, b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
