"""Load a running `handoff up` and print where each role's engine time went.

    python3 benches/peers/serve_systems.py --url http://127.0.0.1:8123 [--concurrency 32] [--requests 128]

Sends completions of 16 tokens (the prompts of `bench serve`) at the given
concurrency, then reads `/metrics` and prints, per role, the systems whose
total run time is largest (sum and count of handoff_engine_system_seconds),
next to the load's wall time. Standard library only.
"""
import argparse
import json
import re
import threading
import time
import urllib.request


def prompt(i):
    return "".join(chr(ord("a") + (i + j) % 26) for j in range(32 + (i * 37) % 96))


def complete(url, i, out):
    body = json.dumps({"prompt": prompt(i), "max_tokens": 16}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    out.append(time.time() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128)
    a = ap.parse_args()
    lat, nxt, lock = [], [0], threading.Lock()

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= a.requests:
                return
            complete(a.url, i, lat)

    t0 = time.time()
    ts = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.time() - t0
    lat.sort()
    print(f"load: {len(lat)} requests of 16 tokens at C{a.concurrency} in {wall:.2f} s = {16 * len(lat) / wall:.0f} tok/s, latency p50 {1e3 * lat[len(lat) // 2]:.0f} ms")
    text = urllib.request.urlopen(a.url + "/metrics", timeout=30).read().decode()
    pat = re.compile(r'^handoff_engine_system_seconds_(sum|count)\{role="([^"]+)",phase="([^"]+)",system="([^"]+)"\} (\S+)$')
    agg = {}
    for line in text.splitlines():
        m = pat.match(line)
        if m:
            kind, role, phase, system, v = m.groups()
            agg.setdefault((role, phase, system), {})[kind] = float(v)
    # Where a request's time went, from the proxy's histograms: the phases of
    # each completed choice (queue, handoff, decode), TTFT and ITL; means.
    hist = {}
    hp = re.compile(r'^(handoff_phase_seconds|handoff_time_to_first_token_seconds|handoff_inter_token_latency_seconds)_(sum|count)(\{[^}]*\})? (\S+)$')
    for line in text.splitlines():
        m = hp.match(line)
        if m:
            name, kind, labels, v = m.groups()
            hist.setdefault((name, labels or ""), {})[kind] = float(v)
    parts = []
    for (name, labels), v in sorted(hist.items()):
        if v.get("count", 0) > 0:
            what = labels.strip("{}").replace('phase="', "").replace('"', "") or name.replace("handoff_", "").replace("_seconds", "")
            parts.append(f"{what} {1e3 * v['sum'] / v['count']:.1f} ms")
    print("a request's time, means: " + ", ".join(parts))
    by_role = {}
    for (role, phase, system), v in agg.items():
        by_role.setdefault(role, []).append((v.get("sum", 0.0), v.get("count", 0.0), phase, system))
    for role in sorted(by_role):
        rows = sorted(by_role[role], reverse=True)
        total = sum(r[0] for r in rows)
        print(f"{role}: engine systems {total:.2f} s in all ({100 * total / wall:.0f}% of the wall time)")
        for s, n, phase, system in rows[:6]:
            print(f"  {phase}/{system}: {s:.3f} s over {int(n)} runs = {1e3 * s / max(n, 1):.2f} ms a run")


if __name__ == "__main__":
    main()
