"""Golden logits of the trained checkpoint from the reference, on the CPU.

    python3 tools/torch_ref/golden.py            # writes tools/torch_ref/golden.json
    python3 tools/torch_ref/golden.py --check    # recomputes, compares with the file
    python3 tools/torch_ref/golden.py --samples 200   # also prints longer completions

The model runs token by token (Model.step: the recurrent KDA, the MLA over its
cached rows) in float64, from the weights file widened to f32 and then to f64, as
the loader reads them. For each of 4 held-out prompts (20-60 bytes, the start of a
held-out fortune) the file holds:

  prompt   the prompt bytes
  logits   33 rows of 256: row 0 is the prefill (the logits of the last prompt
           byte), row i (1..32) the i-th decode step, which was fed tokens[i-1]
  tokens   33 greedy tokens, tokens[i] = argmax(logits[i]) (lowest index on ties)

A prompt is kept only if at every one of its 33 steps the top two logits are at
least --min-gap apart, so an f32 implementation cannot flip a greedy token on
rounding. The run also repeats everything in float32 and prints the largest
difference from float64, the size of error an f32 engine should expect.
"""
import argparse
import json
import os
import sys
import tomllib

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
from model import Config, load  # noqa: E402

LENGTHS = (24, 36, 48, 60)
STEPS = 32


@torch.no_grad()
def run_case(model, prompt, steps, dtype):
    state = model.init_state(dtype=dtype)
    logits = [model.prefill(prompt, state)]
    tokens = [int(torch.argmax(logits[0]))]
    for _ in range(steps):
        logits.append(model.step(tokens[-1], state))
        tokens.append(int(torch.argmax(logits[-1])))
    return tokens, torch.stack(logits)


def min_gap(logits):
    top = torch.topk(logits, 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).min().item()


def candidates(heldout):
    """Prompt candidates: the start of each held-out fortune, printable ASCII,
    one length of LENGTHS each in turn."""
    recs = [r for r in heldout.split(b"\n%\n") if r]
    out = []
    for r in recs:
        if all(32 <= b < 127 or b in (9, 10) for b in r[:60]) and len(r) >= 70:
            out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(REPO, "config", "trained.toml"))
    ap.add_argument("--weights", default=None, help="default: the config's `weights`, relative to it")
    ap.add_argument("--heldout", default=os.path.join(HERE, "data", "heldout.txt"))
    ap.add_argument("--out", default=os.path.join(HERE, "golden.json"))
    ap.add_argument("--min-gap", type=float, default=0.05)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    ap.add_argument("--samples", type=int, default=0, help="also print greedy completions this long")
    a = ap.parse_args()

    with open(a.config, "rb") as f:
        wrel = tomllib.load(f)["model"]["weights"]
    weights = a.weights or os.path.join(os.path.dirname(os.path.abspath(a.config)), wrel)
    cfg = Config.from_toml(a.config)
    m64 = load(weights, cfg, torch.float64).eval()
    m32 = load(weights, cfg, torch.float32).eval()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    if a.check:
        with open(a.out) as f:
            gold = json.load(f)
        worst = 0.0
        for case in gold["cases"]:
            tokens, logits = run_case(m64, case["prompt"], len(case["tokens"]) - 1, torch.float64)
            d = (logits - torch.tensor(case["logits"], dtype=torch.float64)).abs().max().item()
            worst = max(worst, d)
            same = tokens == case["tokens"]
            print(f"prompt {bytes(case['prompt'])!r}: tokens {'equal' if same else 'DIFFER'}, max |logit diff| {d:.2e}")
            if not same:
                sys.exit(1)
        print(f"golden.json matches (max |logit diff| {worst:.2e})")
        sys.exit(0 if worst < 1e-6 else 1)

    heldout = open(a.heldout, "rb").read()
    cases = []
    for r in candidates(heldout):
        n = LENGTHS[len(cases)]
        prompt = list(r[:n])
        tokens, logits = run_case(m64, prompt, STEPS, torch.float64)
        gap = min_gap(logits)
        if gap < a.min_gap:
            print(f"skip {bytes(prompt)!r}: top-2 gap {gap:.4f}")
            continue
        t32, l32 = run_case(m32, prompt, STEPS, torch.float32)
        err = (l32.double() - logits).abs().max().item()
        print(f"prompt {bytes(prompt)!r} -> {bytes(tokens).decode('utf-8', 'replace')!r}")
        print(f"    min top-2 gap {gap:.4f}; f32 run: tokens {'equal' if t32 == tokens else 'DIFFER'}, "
              f"max |logit - f64| {err:.2e} (logits up to {logits.abs().max().item():.1f})")
        cases.append({"prompt": prompt, "tokens": tokens,
                      "logits": [[float(f"{x:.9g}") for x in row] for row in logits.tolist()]})
        if len(cases) == len(LENGTHS):
            break
    out = {"config": "config/trained.toml", "weights": "config/trained/byte-kkkm.safetensors", "cases": cases}
    with open(a.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {a.out} ({os.path.getsize(a.out)} bytes, {len(cases)} cases)")

    if a.samples:
        for r in candidates(heldout)[:6]:
            p = list(r[:30])
            toks, _ = run_case(m32, p, a.samples - 1, torch.float32)
            print(f"--- {bytes(p)!r}\n{bytes(toks).decode('utf-8', 'replace')}")


if __name__ == "__main__":
    main()
