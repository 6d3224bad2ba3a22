#!/usr/bin/env python3
"""The dependency graph between the kvtier crate's top-level modules, and its cycles.

Reads src/**/*.rs, finds every `crate::<module>` a module names (and `super::<module>` in the
files directly under src/), leaving out test modules (`#[cfg(test)] mod ...` to the file's end)
and the simulator (`sim`, feature `sim`, tests only, which drives everything). Prints each
module's dependencies; exits 1 and names the cycle if two modules reach each other.

    python3 tools/module_deps.py           # the graph, then "no cycles" or the cycles
    python3 tools/module_deps.py --quiet   # only the verdict (tools/test.sh runs this)
"""
import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
SKIP = {"sim"}
TEST_MOD = re.compile(r"^\s*#\[cfg\(test\)\]\s*\n\s*(pub(\(\w+\))?\s+)?mod\s+\w+\s*\{", re.M)


def top_module(path: Path) -> str | None:
    rel = path.relative_to(SRC)
    if len(rel.parts) == 1:
        return None if rel.stem in ("lib", "main") else rel.stem
    return rel.parts[0]


def graph() -> dict[str, set[str]]:
    modules = {top_module(p) for p in SRC.rglob("*.rs")} - {None}
    deps: dict[str, set[str]] = {m: set() for m in modules}
    for path in SRC.rglob("*.rs"):
        me = top_module(path)
        if me is None or me in SKIP:
            continue
        text = path.read_text()
        cut = TEST_MOD.search(text)
        if cut:
            text = text[: cut.start()]
        # Comments (doc links included) name modules without depending on them.
        text = re.sub(r"//[^\n]*", "", text)
        # `#[cfg(feature = "sim")]` items reach the simulator on purpose: not a dependency.
        names = set(re.findall(r"\bcrate::(\w+)", text))
        rel = path.relative_to(SRC)
        if len(rel.parts) == 1 or (len(rel.parts) == 2 and rel.name == "mod.rs"):
            names |= set(re.findall(r"\bsuper::(\w+)", text)) if len(rel.parts) == 1 else set()
        deps[me] |= {n for n in names if n in modules and n != me and n not in SKIP}
    return {m: d for m, d in deps.items() if m not in SKIP}


def cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(deps[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    deps = graph()
    if "--quiet" not in sys.argv:
        for m in sorted(deps):
            print(f"{m:>10} -> {', '.join(sorted(deps[m])) or '-'}")
    found = cycles(deps)
    for c in found:
        both = [f"{a} -> {b}" for a in c for b in sorted(deps[a]) if b in c]
        print(f"module cycle: {', '.join(c)} ({'; '.join(both)})")
    if not found:
        print(f"kvtier's {len(deps)} top-level modules (sim aside): no cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
