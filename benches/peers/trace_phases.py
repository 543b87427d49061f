"""Where a request's time goes between the roles, from a `handoff up` log at
`HANDOFF_LOG=debug` (the roles' stderr, in one file):

    python3 benches/peers/trace_phases.py UP.LOG

Reads the roles' debug lines (decode: admit, a stage's writes reported,
finished; prefill: job in, computed, written) and prints, over the requests
that went through every one, the mean and p50/p90 of each step's time from the
one before it, and how many jobs each stage's ticks held. Standard library only.
"""
import re
import sys
from datetime import datetime

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LINE = re.compile(r"^(\S+Z)\s+DEBUG\s+\S+:\s+(.*)$")
FIELD = re.compile(r"(\w+)=(\S+)")
EVENTS = [
    ("decode: admit", "admit"),
    ("prefill: job in", "job_in"),
    ("prefill: computed", "computed"),
    ("prefill: written", "written"),
    ("decode: a stage's writes reported", "reported"),
    ("decode: finished", "finished"),
]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    ev = {}
    for raw in open(sys.argv[1], errors="replace"):
        m = LINE.match(ANSI.sub("", raw.strip()))
        if not m:
            continue
        text = m.group(2)
        name = next((n for p, n in EVENTS if text.startswith(p)), None)
        if name is None:
            continue
        f = dict(FIELD.findall(text))
        if "request" not in f:
            continue
        t = datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        key = name if "stage" not in f else f"{name}[{f['stage']}]"
        ev.setdefault(int(f["request"]), {}).setdefault(key, t)
    if not ev:
        sys.exit("no debug lines of the roles found (run the roles with HANDOFF_LOG=debug)")
    stages = sorted({k.split("[")[1][:-1] for e in ev.values() for k in e if "[" in k})
    order = ["admit"]
    for s in stages:
        order += [f"job_in[{s}]", f"computed[{s}]"]
    order += [f"written[{s}]" for s in stages] + [f"reported[{s}]" for s in stages] + ["finished"]
    # The last stage logs no "computed" (it hands no hidden states on): keep
    # the steps that most requests logged.
    order = [k for k in order if sum(k in e for e in ev.values()) >= 0.9 * len(ev)]
    full = [e for e in ev.values() if all(k in e for k in order)]
    print(f"{len(ev)} requests in the log, {len(full)} with every step ({', '.join(order)})")
    if not full:
        return
    print(f"{'step':>34} {'mean ms':>9} {'p50 ms':>9} {'p90 ms':>9}")
    for a, b in zip(order, order[1:]):
        d = sorted(1e3 * (e[b] - e[a]) for e in full)
        print(f"{a + ' -> ' + b:>34} {sum(d) / len(d):9.2f} {d[len(d) // 2]:9.2f} {d[int(0.9 * (len(d) - 1))]:9.2f}")
    d = sorted(1e3 * (e["finished"] - e["admit"]) for e in full)
    print(f"{'admit -> finished':>34} {sum(d) / len(d):9.2f} {d[len(d) // 2]:9.2f} {d[int(0.9 * (len(d) - 1))]:9.2f}")
    for s in stages:
        # Jobs computed within 1 ms of each other count as one tick's batch.
        ts = sorted(e[f"computed[{s}]"] for e in ev.values() if f"computed[{s}]" in e)
        batches, last = [], None
        for t in ts:
            if last is None or t - last > 1e-3:
                batches.append(0)
            batches[-1] += 1
            last = t
        if batches:
            print(f"stage {s}: {len(ts)} jobs computed in {len(batches)} batches, mean {len(ts) / len(batches):.1f} a batch, largest {max(batches)}")


if __name__ == "__main__":
    main()
