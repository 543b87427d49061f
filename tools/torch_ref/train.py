"""Trains the byte-level KKKM checkpoint with the reference model's training form.

    python3 tools/torch_ref/train.py --seconds 200 --out DIR

Reads the dims from config/trained.toml, the train split from .train/train.txt
(prepare_data.py writes it) and the held-out split from data/heldout.txt. The
learning-rate schedule runs on wall time (warm-up, then cosine to a tenth over
--seconds), so a faster or slower machine still finishes its schedule. Writes to
DIR: byte-kkkm.safetensors (docs/weights.md's names and shapes, BF16) and
train_log.json (settings, losses, steps, wall time, samples).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
from model import Config, Model, num_params  # noqa: E402

LN2 = math.log(2.0)


def read_bytes(path, device):
    with open(path, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long, device=device)


@torch.no_grad()
def bits_per_byte(model, data, seq, chunk, batch=64):
    """Mean next-byte cross-entropy in bits over `data`, in windows of `seq`
    predictions; each window starts from an empty state."""
    model.eval()
    n = data.numel() - 1
    starts = list(range(0, n, seq))
    total, count = 0.0, 0
    full = [s for s in starts if s + seq <= n]
    for i in range(0, len(full), batch):
        idx = torch.tensor(full[i : i + batch], device=data.device)
        ar = torch.arange(seq + 1, device=data.device)
        win = data[idx[:, None] + ar[None]]
        logits = model(win[:, :-1], chunk=chunk)
        total += F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten(), reduction="sum").item()
        count += win[:, 1:].numel()
    rest = [s for s in starts if s + seq > n]
    for s in rest:
        win = data[s:][None]
        logits = model(win[:, :-1], chunk=chunk)
        total += F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten(), reduction="sum").item()
        count += win.shape[1] - 1
    model.train()
    return total / count / LN2


@torch.no_grad()
def sample(model, prompt: bytes, n, chunk):
    """Greedy continuation with the training form (the whole sequence each step)."""
    model.eval()
    dev = model.embed.device
    toks = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([toks], device=dev), chunk=chunk)[0, -1]
        toks.append(int(torch.argmax(logits)))
    model.train()
    return bytes(toks[len(prompt):]).decode("utf-8", "replace")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(REPO, "config", "trained.toml"))
    ap.add_argument("--train", default=os.path.join(REPO, ".train", "train.txt"))
    ap.add_argument("--heldout", default=os.path.join(HERE, "data", "heldout.txt"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=200.0)
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--train-eval-bytes", type=int, default=200_000)
    ap.add_argument("--val-bytes", type=int, default=40_000)
    ap.add_argument("--sample-bytes", type=int, default=120)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()

    torch.manual_seed(a.seed)
    # TF32 matmuls: the model is tiny and launch-bound; the checkpoint is then
    # evaluated (and golden.py runs) in full f32/f64.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device(a.device)
    cfg = Config.from_toml(a.config)
    model = Model(cfg)
    model.init_weights(seed=a.seed)
    model.to(dev).train()
    print(f"params {num_params(model)}  device {dev}  {cfg}", flush=True)

    train = read_bytes(a.train, dev)
    held = read_bytes(a.heldout, dev)
    # The last --val-bytes of the train split are never trained on: they pick the
    # checkpoint (the lowest loss among the evaluations), so the held-out split
    # stays unseen by every choice made here.
    val = train[-a.val_bytes :]
    train = train[: -a.val_bytes]
    train_eval = train[: a.train_eval_bytes]  # fixed slice of the train split, scored like held-out
    print(f"train {train.numel()} bytes, val {val.numel()}, held-out {held.numel()} bytes", flush=True)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and name != "embed" else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    ar = torch.arange(a.seq + 1, device=dev)

    log = {"evals": []}
    best = {"val": float("inf"), "step": 0, "state": None}

    def evaluate(step):
        vb = bits_per_byte(model, val, a.seq, a.chunk)
        hb = bits_per_byte(model, held, a.seq, a.chunk)
        log["evals"].append({"step": step, "s": round(time.time() - t0, 1),
                             "val_bpb": round(vb, 4), "heldout_bpb": round(hb, 4)})
        print(f"  eval step {step}: val {vb:.4f}  held-out {hb:.4f} bpb", flush=True)
        if vb < best["val"]:
            best.update(val=vb, step=step, state={k: v.detach().clone() for k, v in model.state_dict().items()})
    step, t0 = 0, time.time()
    run_loss = None
    while True:
        el = time.time() - t0
        frac = min(el / a.seconds, 1.0)
        if frac >= 1.0 or step >= a.max_steps:
            break
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for gp in opt.param_groups:
            gp["lr"] = lr
        idx = torch.randint(0, train.numel() - a.seq - 1, (a.batch,), device=dev, generator=gen)
        win = train[idx[:, None] + ar[None]]
        logits = model(win[:, :-1], dropout=a.dropout, chunk=a.chunk)
        loss = F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            lv = loss.item() / LN2
            run_loss = lv if run_loss is None else 0.9 * run_loss + 0.1 * lv
            if step % 250 == 0:
                print(f"step {step}  {time.time() - t0:6.1f}s  lr {lr:.2e}  train(dropout) {run_loss:.3f} bpb", flush=True)
        if step % a.eval_every == 0:
            evaluate(step)
    train_s = time.time() - t0
    if not log["evals"] or log["evals"][-1]["step"] != step:
        evaluate(step)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(best["state"][k])
    print(f"kept the weights of step {best['step']} (val {best['val']:.4f} bpb)", flush=True)

    # final figures in f32 (no TF32), then with the weights rounded to BF16 as shipped
    torch.backends.cuda.matmul.allow_tf32 = False
    f32 = {"train_bpb": bits_per_byte(model, train_eval, a.seq, a.chunk),
           "heldout_bpb": bits_per_byte(model, held, a.seq, a.chunk)}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    bf = {"train_bpb": bits_per_byte(model, train_eval, a.seq, a.chunk),
          "heldout_bpb": bits_per_byte(model, held, a.seq, a.chunk)}
    print(f"final f32 weights: train {f32['train_bpb']:.4f}  held-out {f32['heldout_bpb']:.4f} bpb", flush=True)
    print(f"final bf16 weights: train {bf['train_bpb']:.4f}  held-out {bf['heldout_bpb']:.4f} bpb", flush=True)

    from safetensors.torch import save_file
    sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in model.state_dict().items()}
    path = os.path.join(a.out, "byte-kkkm.safetensors")
    save_file(sd, path)

    held_text = open(a.heldout, "rb").read()
    samples = {}
    for p in (b"The ", b"A man ", b"Computers are ", held_text[:40]):
        samples[p.decode("utf-8", "replace")] = sample(model, p, a.sample_bytes, a.chunk)
    for p, s in samples.items():
        print(f"--- {p!r}\n{s}", flush=True)

    log.update(vars(a))
    log.update({"params": num_params(model), "steps": step, "kept_step": best["step"], "train_seconds": round(train_s, 1),
                "bytes_seen": step * a.batch * a.seq, "epochs": round(step * a.batch * a.seq / train.numel(), 2),
                "final_f32": f32, "final_bf16": bf, "samples": samples,
                "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                "torch": torch.__version__, "total_seconds": round(time.time() - t_start, 1),
                "file_bytes": os.path.getsize(path)})
    with open(os.path.join(a.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(f"steps {step} in {train_s:.1f}s, wrote {path} ({os.path.getsize(path)} bytes)", flush=True)


if __name__ == "__main__":
    main()
