"""Builds the byte corpus from Debian's `fortunes` package.

Every fortune file under /usr/share/games/fortunes (except `ascii-art`, which is
pictures, not English) is split into its fortunes (records end at a line holding
only "%"); duplicates are dropped. The fortunes are shuffled with a fixed seed; the first ones, up to
--heldout-bytes, are the held-out split, the rest the train split. Both splits are
written in the package's own format ("fortune text\n%\n" records), as raw bytes.

    python3 tools/torch_ref/prepare_data.py            # writes .train/train.txt and
                                                       # tools/torch_ref/data/heldout.txt
"""
import argparse
import os
import random

SKIP = {"ascii-art"}


def read_fortunes(root):
    names = sorted(
        n for n in os.listdir(root)
        if not n.endswith(".dat") and not n.endswith(".u8") and n not in SKIP
        and os.path.isfile(os.path.join(root, n))
    )
    records = []
    for n in names:
        with open(os.path.join(root, n), "rb") as f:
            data = f.read()
        for rec in data.split(b"\n%\n"):
            rec = rec.strip(b"\n%")
            if rec.strip():
                records.append(rec)
    return names, records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/usr/share/games/fortunes")
    ap.add_argument("--heldout-bytes", type=int, default=40_000)
    ap.add_argument("--seed", type=int, default=12)
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.abspath(os.path.join(here, "..", ".."))
    ap.add_argument("--train-out", default=os.path.join(repo, ".train", "train.txt"))
    ap.add_argument("--heldout-out", default=os.path.join(here, "data", "heldout.txt"))
    a = ap.parse_args()

    names, records = read_fortunes(a.root)
    # Some fortunes appear in several files; keep one copy so that none of the
    # held-out text is also in the train split.
    records = list(dict.fromkeys(records))
    random.Random(a.seed).shuffle(records)
    held, size, i = [], 0, 0
    while size < a.heldout_bytes:
        held.append(records[i])
        size += len(records[i]) + 3
        i += 1
    train = records[i:]
    os.makedirs(os.path.dirname(a.train_out), exist_ok=True)
    os.makedirs(os.path.dirname(a.heldout_out), exist_ok=True)
    with open(a.train_out, "wb") as f:
        f.write(b"".join(r + b"\n%\n" for r in train))
    with open(a.heldout_out, "wb") as f:
        f.write(b"".join(r + b"\n%\n" for r in held))
    print(f"{len(names)} files, {len(records)} fortunes: "
          f"train {len(train)} ({os.path.getsize(a.train_out)} bytes), "
          f"held-out {len(held)} ({os.path.getsize(a.heldout_out)} bytes)")


if __name__ == "__main__":
    main()
