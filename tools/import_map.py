#!/usr/bin/env python3
"""A map of the imports between the source files of handoff, and what it shows.

Usage: python3 tools/import_map.py [--edges] [--root DIR]

It reads every .rs file of `src/`, `systems/src/` and `components/src/` (the
kernels crate is one node, `kernels`, owned by its own README), follows each
`use` path and each path written in code (`crate::`, `super::`, `self::`, a crate
name such as `handoff_systems::`, or a child module's name) to the file that
defines the item, and prints:

- circles: files that import each other, directly or around a loop;
- files over 1,000 lines (tests/ is not read, so none of these are test files);
- loose files at the src root (only main.rs and lib.rs belong there);
- imports that go against the layer order below.

Test code (`#[cfg(test)]` items and the files they declare) is left out: a test
may reach anywhere. Re-exports are followed to the file that defines the item,
so `use crate::roles::run_proxy` is an arrow to roles/proxy/, not roles/mod.rs;
a module's root that only declares and re-exports therefore never closes a
circle, while one that defines helpers for its children does.

The layer order, from the top. A file may import from its own layer and any layer
below it, never from one above:

  7  lib        src/lib.rs: the crate root, declarations only
  6  cli        src/main.rs, src/cli/: parses the command line and calls down
  5  bench      src/bench/: load generators and transfer benches; drive roles and check
  4  check      src/check/: the oracles and the verify/eval drivers; drive the engine
  3  roles      src/roles/: the processes of a deployment (proxy, prefill, decode, up)
  2  engine     src/engine/: the World and its schedule, the mover, the compute glue
  1  transport, model, systems: what the engine runs (bytes, the forward pass, the phases)
  0  components, kernels, base: plain data, the compute ops, and the few helpers
     every layer of the root crate shares (src/base/: a lock, a hash)

check sits above roles because serving must never depend on verification code,
and bench above check because a bench may verify what it moved with the oracle.

Exit status: 0 when nothing is found, 1 otherwise (so that CI may adopt it once
the tree is clean).
"""

import os
import re
import sys
from collections import defaultdict

# (layer name, rank, path prefixes relative to the repository root)
LAYERS = [
    ("lib", 7, ["src/lib.rs"]),
    ("cli", 6, ["src/main.rs", "src/cli/"]),
    ("bench", 5, ["src/bench/"]),
    ("check", 4, ["src/check/"]),
    ("roles", 3, ["src/roles/"]),
    ("engine", 2, ["src/engine/"]),
    ("transport", 1, ["src/transport/"]),
    ("model", 1, ["src/model/"]),
    ("systems", 1, ["systems/src/"]),
    ("components", 0, ["components/src/"]),
    ("kernels", 0, ["kernels"]),
    ("base", 0, ["src/base/"]),
]
LAYER_ORDER = "cli > bench > check > roles > engine > transport, model, systems > components, kernels, base"

# crate name -> (source root directory, root file); the binary's root is main.rs.
CRATES = {
    "handoff": ("src", "src/lib.rs"),
    "handoff_bin": ("src", "src/main.rs"),
    "handoff_systems": ("systems/src", "systems/src/lib.rs"),
    "handoff_components": ("components/src", "components/src/lib.rs"),
}
EXTERNAL = {"handoff_kernels": "kernels"}
MAX_LINES = 1000


def layer_of(path):
    for name, rank, prefixes in LAYERS:
        for p in prefixes:
            if path == p or (p.endswith("/") and path.startswith(p)) or path.startswith(p + "/"):
                return name, rank
    return "?", 99


def strip(text):
    """The text with comments removed and string and char literals emptied; keeps newlines."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        out.append("\n")
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 40]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'\n])'", text[i:])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|::|\S")


def tokens(text):
    return TOKEN.findall(text)


def parse_use_tree(toks, i):
    """Parses one use tree at toks[i]; returns ([(segments, alias)], next index)."""
    prefix = []
    while i < len(toks):
        t = toks[i]
        if t == "{":
            i += 1
            items = []
            while i < len(toks) and toks[i] != "}":
                sub, i = parse_use_tree(toks, i)
                items.extend((prefix + s, a) for s, a in sub)
                if i < len(toks) and toks[i] == ",":
                    i += 1
            return items, i + 1
        if t == "*":
            return [(prefix + ["*"], None)], i + 1
        if t == "::":
            i += 1
            continue
        if re.match(r"[A-Za-z_]", t):
            prefix.append(t)
            i += 1
            if i < len(toks) and toks[i] == "as":
                return [(prefix, toks[i + 1])], i + 2
            if i < len(toks) and toks[i] != "::":
                return [(prefix, None)], i
            continue
        return [(prefix, None)], i
    return [(prefix, None)], i


def module_files(root_dir, root_file):
    """Module path (tuple) -> file, for every .rs file of one crate's source directory."""
    mods = {}
    for dirpath, _, files in os.walk(root_dir):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root_dir)
            if path in (r for _, r in CRATES.values()) and path != root_file:
                continue
            if path == root_file:
                mods[()] = path
                continue
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "mod":
                parts = parts[:-1]
            if parts == ["main"] or parts == ["lib"]:
                continue
            mods[tuple(parts)] = path
    return mods


class File:
    def __init__(self, crate, modpath, path):
        self.crate, self.modpath, self.path = crate, modpath, path
        self.uses = []  # (module path of the using scope, segments, is_pub_use)
        self.children = set()  # child module names declared (file or inline)
        self.test_children = set()  # child modules declared under cfg(test)
        self.inline = {}  # inline module path -> this file
        self.macros = set()  # macro_rules! names defined here
        self.idents = set()  # identifiers written in code (outside use statements)


def scan(f, text):
    toks = tokens(strip(text))
    stack = []  # (brace depth at which an inline module opened, name)
    depth = 0
    i = 0
    pending_test = False
    prev_pub = False

    def scope():
        return f.modpath + tuple(name for _, name in stack)

    def skip_item(j):
        par = 0
        while j < len(toks):
            t = toks[j]
            if t in "([":
                par += 1
            elif t in ")]":
                par -= 1
            elif t == ";" and par == 0:
                return j + 1
            elif t == "{" and par == 0:
                d = 1
                j += 1
                while j < len(toks) and d:
                    d += {"{": 1, "}": -1}.get(toks[j], 0)
                    j += 1
                return j
            j += 1
        return j

    while i < len(toks):
        t = toks[i]
        if t == "#":
            j = i + 1
            if j < len(toks) and toks[j] == "!":
                j += 1
            if j < len(toks) and toks[j] == "[":
                d, k = 0, j
                while k < len(toks):
                    d += {"[": 1, "]": -1}.get(toks[k], 0)
                    k += 1
                    if d == 0:
                        break
                attr = toks[j:k]
                if attr[1:3] == ["cfg", "("] and "test" in attr and "not" not in attr:
                    pending_test = True
                i = k
                continue
        if pending_test and t not in ("pub", "(", "crate", ")", "super", "in"):
            pending_test = False
            if t == "mod" and i + 2 < len(toks) and toks[i + 2] == ";":
                f.test_children.add(toks[i + 1])
            i = skip_item(i)
            continue
        if t == "pub":
            prev_pub = True
            i += 1
            if i < len(toks) and toks[i] == "(":
                while i < len(toks) and toks[i] != ")":
                    i += 1
                i += 1
            continue
        if t == "mod" and i + 2 < len(toks) and re.match(r"[A-Za-z_]", toks[i + 1]):
            name = toks[i + 1]
            if toks[i + 2] == ";":
                f.children.add(name)
                i += 3
            elif toks[i + 2] == "{":
                stack.append((depth, name))
                f.inline[scope()] = f.path
                depth += 1
                i += 3
            else:
                i += 1
            prev_pub = False
            continue
        if t == "macro_rules" and i + 2 < len(toks) and toks[i + 1] == "!":
            f.macros.add(toks[i + 2])
        if t == "use":
            items, j = parse_use_tree(toks, i + 1)
            for segs, alias in items:
                f.uses.append((scope(), segs, prev_pub, alias))
            i = j
            prev_pub = False
            continue
        prev_pub = False
        if re.match(r"[A-Za-z_]", t):
            f.idents.add(t)
        if t == "{":
            depth += 1
        elif t == "}":
            depth -= 1
            if stack and stack[-1][0] == depth:
                stack.pop()
        elif re.match(r"[A-Za-z_$]", t) and i + 1 < len(toks) and toks[i + 1] == "::" and (i == 0 or toks[i - 1] != "::"):
            segs = [t]
            j = i + 1
            while j + 1 < len(toks) and toks[j] == "::" and re.match(r"[A-Za-z_]", toks[j + 1]):
                segs.append(toks[j + 1])
                j += 2
            f.uses.append((scope(), segs, False, None))
            i = j
            continue
        i += 1


def main():
    args = sys.argv[1:]
    root = "."
    if "--root" in args:
        root = args[args.index("--root") + 1]
    os.chdir(root)
    show_edges = "--edges" in args

    files = {}  # path -> File
    modules = {}  # (crate, module path) -> path
    for crate, (root_dir, root_file) in CRATES.items():
        if crate == "handoff_bin":
            modules[(crate, ())] = root_file
            files[root_file] = File(crate, (), root_file)
            continue
        for modpath, path in module_files(root_dir, root_file).items():
            modules[(crate, modpath)] = path
            files[path] = File(crate, modpath, path)
    for f in files.values():
        with open(f.path, encoding="utf-8") as fh:
            scan(f, fh.read())
        for m in f.inline:
            modules[(f.crate, m)] = f.path
    # Files declared only under cfg(test) (e.g. `#[cfg(test)] mod tests;`) are test code.
    for f in list(files.values()):
        for name in f.test_children:
            p = modules.pop((f.crate, f.modpath + (name,)), None)
            if p and p in files:
                del files[p]
    # Re-exports: (crate, module path, name) -> (crate, absolute segments).
    reexports = {}
    macros = {}
    for f in files.values():
        for sc, segs, is_pub, alias in f.uses:
            if is_pub and segs and segs[-1] != "*":
                name = alias or (segs[-2] if segs[-1] == "self" else segs[-1])
                ab = absolute(f.crate, sc, segs, modules)
                if ab:
                    reexports[(f.crate,) + (tuple(sc), name)] = ab

    # `#[macro_export]` macros live at the crate root whatever file defines them.
    for f in files.values():
        for name in f.macros:
            macros[(f.crate, name)] = f.path

    edges = defaultdict(set)  # (from path, to path) -> {example paths}
    for f in files.values():
        for sc, segs, is_pub, alias in f.uses:
            ab = absolute(f.crate, sc, segs, modules)
            # A module root re-exporting its own children is its public face, not a
            # dependency of its logic: such a `pub use` draws no arrow unless the
            # root's own code uses the name it brings in.
            if is_pub and ab and ab[0] == f.crate and ab[1][: len(sc)] == tuple(sc) and len(ab[1]) > len(sc):
                name = alias or (segs[-2] if segs[-1] == "self" else segs[-1])
                if name not in f.idents:
                    continue
            if ab and len(ab[1]) == 1 and (ab[0], ab[1][0]) in macros:
                target = macros[(ab[0], ab[1][0])]
            else:
                target = resolve(f.crate, sc, segs, modules, reexports)
            if target and target != f.path:
                edges[(f.path, target)].add("::".join(x for x in segs if x != "self"))

    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)

    findings = 0
    print(f"import map: {len(files)} files of src/, systems/src/, components/src/; {len(edges)} arrows between files")
    if show_edges:
        print("\narrows:")
        for (a, b), ex in sorted(edges.items()):
            print(f"  {a} -> {b}   ({', '.join(sorted(ex)[:3])})")

    circles = [c for c in sccs(sorted(files), graph) if len(c) > 1]
    print(f"\ncircles: {len(circles)}")
    for c in circles:
        findings += 1
        members = set(c)
        print("  - " + ", ".join(sorted(c)))
        for a in sorted(members):
            for b in sorted(graph[a] & members):
                print(f"      {a} -> {b}: {', '.join(sorted(edges[(a, b)])[:3])}")

    big = []
    for p in sorted(files):
        with open(p, encoding="utf-8") as fh:
            n = sum(1 for _ in fh)
        if n > MAX_LINES:
            big.append((p, n))
    print(f"\nfiles over {MAX_LINES} lines: {len(big)}")
    for p, n in big:
        findings += 1
        print(f"  - {p}: {n}")

    loose = sorted(x for x in os.listdir("src") if x.endswith(".rs") and x not in ("main.rs", "lib.rs"))
    print(f"\nloose files at the src root: {len(loose)}")
    for x in loose:
        findings += 1
        print(f"  - src/{x}")

    against = []
    for (a, b), ex in sorted(edges.items()):
        (la, ra), (lb, rb) = layer_of(a), layer_of(b)
        if rb > ra:
            against.append((a, la, b, lb, ex))
    print(f"\nimports against the layer order ({LAYER_ORDER}): {len(against)}")
    for a, la, b, lb, ex in against:
        findings += 1
        print(f"  - {a} ({la}) -> {b} ({lb}): {', '.join(sorted(ex)[:3])}")
    unknown = sorted(p for p in files if layer_of(p)[0] == "?")
    if unknown:
        findings += 1
        print(f"\nfiles in no layer: {', '.join(unknown)}")
    return 1 if findings else 0


def absolute(crate, scope, segs, modules):
    """The (crate, absolute segments) a path names, or None for another crate (std, serde...)."""
    segs = [s.lstrip("$") for s in segs]
    if not segs:
        return None
    head = segs[0]
    if head == "crate":
        return (crate, tuple(segs[1:]))
    if head in ("super", "self"):
        base = list(scope)
        k = 0
        while k < len(segs) and segs[k] in ("super", "self"):
            if segs[k] == "super" and base:
                base.pop()
            k += 1
        return (crate, tuple(base + segs[k:]))
    if head in CRATES:
        return (head, tuple(segs[1:]))
    if head in EXTERNAL:
        return (head, tuple(segs[1:]))
    if (crate, tuple(scope) + (head,)) in modules:
        return (crate, tuple(scope) + tuple(segs))
    return None


def resolve(crate, scope, segs, modules, reexports, guard=0):
    ab = absolute(crate, scope, segs, modules)
    if not ab:
        return None
    c, path = ab
    if c in EXTERNAL:
        return EXTERNAL[c]
    # The longest prefix that is a module; the next segment may be a re-export.
    for k in range(len(path), -1, -1):
        m = path[:k]
        if (c, m) in modules:
            rest = path[k:]
            if rest and rest[0] != "*" and (c, m, rest[0]) in reexports and guard < 8:
                rc, rsegs = reexports[(c, m, rest[0])]
                return resolve(rc, (), ["crate"] + list(rsegs) + list(rest[1:]), modules, reexports, guard + 1) if rc in CRATES else EXTERNAL.get(rc)
            return modules[(c, m)]
    return None


def sccs(nodes, graph):
    """Tarjan's strongly connected components."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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
            out.append(comp)

    for v in nodes:
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
