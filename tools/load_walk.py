#!/usr/bin/env python3
"""The walk of one slab load, as the program runs it: which source files it calls into, in
which order, step by step, and whether any step calls into a file twice.

Builds `tests/one_load.rs` with kvtier and kvtier-sys unoptimized (every function a real call;
its own target directory, `target/walk`), runs it under gdb with a breakpoint on every function
of the two crates that records and continues, and reads the load's calls back:

  caller   Engine::submit_load, down to the worker's channel
  intake   the worker's turn taking the part into its load queue
  issue    the turn that starts the read (Worker::issue_loads)
  submit   the pass's io_uring_enter
  reap     the turn that handles the completion and reports the key (Worker::reap)
  results  Engine::wait_finished on the caller

A step's calls, in the order they ran, name the files they enter; a run of calls into one
file with none elsewhere between is one visit, and each step must visit each file once. Not
counted: a function calling one of its own file's, kvtier-sys calling its own files (it is read
as a black box, by the file kvtier calls into), a closure run while the function that holds it
is still on the stack, a drop (a guard or a handle ending what its file started), and the
one-line reads of a field and metric counts in `GETTERS`; `--trace` shows them with the
reason. Exits 1 if a step
enters a file it had left.

    python3 tools/load_walk.py            # needs gdb; about 10 min the first time (the build)
    python3 tools/load_walk.py --trace    # every recorded call too
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST = "one_load"
# One-line reads of a field through a function, and counting into a metric (a couple of
# atomic adds): shown with --trace, not counted.
GETTERS = (
    "Context::backend",
    "Context::metrics",
    "Context::block_bytes",
    "Context::region_of",
    "JobState::lease",
    "JobState::is_resolved",
    "WorkerMetrics::dev",
    "Histogram::record",
    "metrics::bucket_of",
)

GDB_SCRIPT = r'''
import gdb, json, re
gdb.execute("set pagination off")
gdb.execute("set print thread-events off")
gdb.execute("set confirm off")
out = open(OUT, "w")
on = [False]

def stack(f):
    names = []
    while f is not None:
        names.append(f.name() or "?")
        f = f.older()
    return names[::-1]

def record(name):
    f = gdb.selected_frame()
    sal = f.find_sal()
    st = stack(f)
    out.write(json.dumps({"t": gdb.selected_thread().num, "d": len(st), "fn": name or f.name(),
                          "stack": st,
                          "file": sal.symtab.filename if sal.symtab else "?"}) + "\n")

class Rec(gdb.Breakpoint):
    def stop(self):
        if on[0]:
            record(None)
        return False

class Start(gdb.Breakpoint):
    def stop(self):
        if not on[0]:
            on[0] = True
            record(None)
        return False

txt = gdb.execute("info functions -q -n ^kvtier", to_string=True)
cur, seen, n = None, set(), 0
for line in txt.splitlines():
    m = re.match(r"File (.*):$", line)
    if m:
        cur = m.group(1)
        continue
    m = re.match(r"(\d+):\s", line)
    if not (m and cur and (cur.startswith("src/") or cur.startswith("sys/src/"))):
        continue
    if cur.startswith("src/sim/"):
        continue
    loc = cur + ":" + m.group(1)
    if loc in seen:
        continue
    seen.add(loc)
    try:
        Rec(loc, internal=True)
    except Exception:
        continue
    n += 1
Start("kvtier::engine::Engine::submit_load", internal=True)
gdb.execute("run")
out.close()
'''


@dataclass
class Call:
    t: int
    d: int
    fn: str
    file: str
    stack: list[str]
    parent: "Call | None" = None
    kids: list["Call"] = field(default_factory=list)

    def walk(self):
        yield self
        for k in self.kids:
            yield from k.walk()

    def has(self, name: str) -> bool:
        return any(name in c.fn for c in self.walk())


def build() -> str:
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(ROOT, "target", "walk"))
    cmd = ["cargo", "test", "--locked", "--features", "kvtier/sim", "--test", TEST, "--no-run",
           "--message-format=json",
           "--config", "profile.dev.package.kvtier.opt-level=0",
           "--config", "profile.dev.package.kvtier-sys.opt-level=0"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, check=True, text=True)
    for line in p.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") and \
                msg["target"]["name"] == TEST:
            return msg["executable"]
    sys.exit("load_walk: cargo built no test executable")


def trace(exe: str, out: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(f"OUT = {out!r}\n" + GDB_SCRIPT)
        script = f.name
    try:
        subprocess.run(["gdb", "-q", "-batch", "-x", script, "--args", exe, "--exact",
                        "one_block_stored_and_loaded_through_one_worker", "--test-threads", "1"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    finally:
        os.unlink(script)


def trees(hits: list[dict]) -> dict[int, list[Call]]:
    """Each thread's recorded calls as trees: a call's parent is the innermost recorded call
    still on its stack (its backtrace names it at that depth)."""
    roots: dict[int, list[Call]] = {}
    open_calls: dict[int, list[Call]] = {}
    for h in hits:
        if "/rustc/" in h["file"]:
            continue
        c = Call(h["t"], h["d"], h["fn"], h["file"], h["stack"])
        st = open_calls.setdefault(c.t, [])
        while st and (st[-1].d > c.d or c.stack[st[-1].d - 1] != st[-1].fn):
            st.pop()
        if st and st[-1].d == c.d:
            if (st[-1].fn, st[-1].stack) == (c.fn, c.stack):
                # The same function at the same place in the same caller, no sibling between:
                # a later line of the call that maps to its first one (or the same call made
                # again at once, which reads the same).
                continue
            st.pop()
        if st:
            c.parent = st[-1]
            st[-1].kids.append(c)
        else:
            roots.setdefault(c.t, []).append(c)
        st.append(c)
    return roots


def short(fn: str) -> str:
    for noise in ("<kvtier::slab::layout::SlabLayout>", "<kvtier::slab::layout::Op>",
                  "<kvtier::uring::backend::UringBackend>"):
        fn = fn.replace(noise, "")
    return fn.replace("kvtier::", "").replace("kvtier_sys::", "sys::")


def plain(fn: str) -> str:
    """A function's path without generics (`a::B<T>::f<T>` -> `a::B::f`)."""
    depth, out = 0, []
    for ch in fn:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def base(fn: str) -> str:
    """A function's last path segment without generics (`a::B<T>::f<T>` -> `f`)."""
    return plain(fn).split("::")[-1]


def is_sys(path: str) -> bool:
    return path.startswith("sys/")


def why_not_counted(c: Call) -> str | None:
    """Why call `c` is not a call into a file of its own, or None if it is one."""
    p = c.parent
    if p is not None and is_sys(p.file) and is_sys(c.file):
        return "kvtier-sys inside"
    if "{closure#" in c.fn:
        enclosing = c.fn.split("::{closure#")[0]
        a = p
        while a is not None:
            if a.file == c.file and base(a.fn) == base(enclosing):
                return "a closure of a function on the stack"
            a = a.parent
    if c.fn.endswith("::drop") or "::drop<" in c.fn:
        return "a drop (the end of what its file started)"
    if any(plain(c.fn).endswith(g) for g in GETTERS):
        return "a getter"
    return None


def visits(root: Call, until: Call | None = None):
    """The calls of `root`'s subtree in the order they ran, each with the file it enters (None
    when it enters none: see `why_not_counted`), up to the end of `until`'s subtree."""
    last_of_until = None
    if until is not None:
        *_, last_of_until = until.walk()
    for c in root.walk():
        why = None if c is root else why_not_counted(c)
        if why is None and c.parent is not None and c.parent.file == c.file:
            why = "same file"
        yield c, why
        if c is last_of_until:
            return


def steps(roots: dict[int, list[Call]]) -> list[tuple[str, Call, Call | None]]:
    flat = {t: [c for r in rs for c in r.walk()] for t, rs in roots.items()}
    caller = next(t for t, cs in flat.items() if any("Engine::submit_load" in c.fn for c in cs))
    worker = next(t for t, cs in flat.items() if any("alloc_load" in c.fn for c in cs))
    wcalls = flat[worker]

    def first(pred, after=-1):
        for i, c in enumerate(wcalls):
            if i > after and pred(c):
                return i, c
        sys.exit("load_walk: a step of the load was not found in the trace")

    out: list[tuple[str, Call, Call | None]] = []
    out.append(("caller", next(c for c in flat[caller] if "Engine::submit_load" in c.fn), None))
    i, intake = first(lambda c: base(c.fn) == "intake" and c.has("WorkQueue::push"))
    out.append(("intake", intake, None))
    i, issue = first(lambda c: base(c.fn) == "issue_loads" and c.has("alloc_load"), i)
    start = next(c for c in issue.walk() if base(c.fn) == "start_load" and "layout" in c.fn)
    # The load's own calls: the loop's next look at the queue is the next load's.
    out.append(("issue", issue, start))
    i, submit = first(lambda c: "uring::backend" in c.fn and base(c.fn) == "submit"
                      and (c.parent is None or "uring::backend" not in c.parent.fn), i)
    out.append(("submit", submit, None))
    i, reap = first(lambda c: base(c.fn) == "reap" and c.has("load_done"), i)
    out.append(("reap", reap, None))
    wait = [c for c in flat[caller] if "Engine::wait_finished" in c.fn]
    if wait:
        out.append(("results", wait[-1], None))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", action="store_true",
                    help="also every recorded call, and why a call is not counted")
    ap.add_argument("--hits", help="read this recorded trace instead of running one")
    args = ap.parse_args()
    if args.hits:
        path = args.hits
    else:
        exe = build()
        path = os.path.join(ROOT, "target", "walk", "load_walk.jsonl")
        trace(exe, path)
    hits = [json.loads(line) for line in open(path)]
    again = []
    for name, root, until in steps(trees(hits)):
        print(f"{name}:")
        seen: list[str] = []
        for c, why in visits(root, until):
            if why is not None:
                if args.trace:
                    print(f"      {'  ' * (c.d - root.d)}{c.file}: {short(c.fn)}  [{why}]")
                continue
            if seen and seen[-1] == c.file:
                mark = ""  # the same file again, nothing between: one visit
            elif c.file in seen:
                mark = "   <- AGAIN"
                again.append(f"{name}: {c.file} ({short(c.fn)})")
            else:
                mark = ""
            if not (seen and seen[-1] == c.file) or args.trace:
                print(f"  {c.file:26} {short(c.fn)}{mark}")
            seen.append(c.file)
    if again:
        print(f"\n{len(again)} call(s) into a file the step had left already:")
        for a in again:
            print(f"  {a}")
        return 1
    print("\nEach step calls into each file once, in the order above.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
