"""The peer of `handoff bench compute --device cuda`: the same model in plain
PyTorch, one batched decode step at B = 1, 8, 32, 88 (eager and replayed as a
CUDA graph), a prefill of 512 tokens, and torch.matmul (cuBLAS) at the shapes
`cuda_check --bench` times. benches/h200.sh runs it in the same call as the
handoff figures and prints the ratios.

The model is tools/torch_ref/model.py's (written from docs/weights.md, sharing no
code with handoff), loaded from the weights `handoff weights --config F --out W`
writes: the same numbers handoff multiplies by. The batched step below is plain
PyTorch over that model's parameters: every request at context `--context` (its
KV rows and KDA state preallocated, the new row written at the same index each
replay so the graph's shapes stay fixed), greedy pick on the device.

usage: python3 torch_model.py --config config/gpu.toml --weights /tmp/w.safetensors
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "torch_ref"))
from model import Config, kda_gate, l2n, load, rms  # noqa: E402


class BatchedDecode:
    """One decode step of B requests, each with `ctx` cached tokens."""

    def __init__(self, model, B, ctx, wdtype, device):
        c = model.c
        self.c, self.B, self.ctx, self.wdtype = c, B, ctx, wdtype
        g = torch.Generator(device="cpu").manual_seed(1)
        f32 = torch.float32
        self.layers = []
        for blk in model.layers:
            w = lambda t: t.detach().to(device, wdtype)  # noqa: E731 matrices
            v = lambda t: t.detach().to(device, f32)  # noqa: E731 vectors
            L = {"kind": blk.kind, "attn_norm": v(blk.attn_norm), "mlp_norm": v(blk.mlp_norm),
                 "gate": w(blk.mlp.gate), "up": w(blk.mlp.up), "down": w(blk.mlp.down)}
            if blk.kind == "K":
                k = blk.kda
                C = 2 * c.kda_heads * c.dk + c.kda_heads * c.dv
                L.update(wqkv=w(k.wqkv), conv=v(k.conv), wg=w(k.wg), wb=w(k.wb), a_log=v(k.a_log),
                         dt_bias=v(k.dt_bias), wgate=w(k.wgate), onorm=v(k.onorm), wo=w(k.wo),
                         S=(torch.randn(B, c.kda_heads, c.dk, c.dv, generator=g) * 0.05).to(device),
                         conv_state=torch.randn(B, c.conv - 1, C, generator=g).to(device))
            else:
                a = blk.mla
                L.update(wkva=w(a.wkva), kv_norm=v(a.kv_norm), wq=w(a.wq), wuk=w(a.wuk), wuv=w(a.wuv), wo=w(a.wo),
                         rows=torch.randn(B, ctx + 1, c.lora + c.rope, generator=g).to(device))
            self.layers.append(L)
        self.embed = model.embed.detach().to(device, f32)
        self.final_norm = model.final_norm.detach().to(device, f32)
        self.lm_head = model.lm_head.detach().to(device, wdtype)

    def mm(self, x, w):
        return (x.to(w.dtype) @ w).to(torch.float32)

    def step(self, tok):
        c, B = self.c, self.B
        H, Dk, Dv = c.kda_heads, c.dk, c.dv
        h = self.embed[tok]
        for L in self.layers:
            x = rms(h, L["attn_norm"])
            if L["kind"] == "K":
                cc = self.mm(x, L["wqkv"])
                window = torch.cat([L["conv_state"], cc[:, None]], 1)
                L["conv_state"].copy_(window[:, 1:])
                cc = F.silu((window * L["conv"].T[None]).sum(1))
                q = l2n(cc[:, : H * Dk].view(B, H, Dk)) / math.sqrt(Dk)
                k = l2n(cc[:, H * Dk: 2 * H * Dk].view(B, H, Dk))
                vv = cc[:, 2 * H * Dk:].view(B, H, Dv)
                gg = kda_gate(self.mm(x, L["wg"]).view(B, H, Dk), L["a_log"], L["dt_bias"])
                beta = torch.sigmoid(self.mm(x, L["wb"]))
                S = torch.exp(gg)[..., None] * L["S"]
                u = beta[..., None] * (vv - torch.einsum("bhkv,bhk->bhv", S, k))
                S = S + k[..., None] * u[:, :, None, :]
                L["S"].copy_(S)
                o = torch.einsum("bhkv,bhk->bhv", S, q)
                gate = F.silu(self.mm(x, L["wgate"])).view(B, H, Dv)
                m = self.mm((rms(o, L["onorm"]) * gate).flatten(1), L["wo"])
            else:
                row = self.mm(x, L["wkva"])
                row = torch.cat([rms(row[:, : c.lora], L["kv_norm"]), row[:, c.lora:]], -1)
                L["rows"][:, self.ctx] = row
                qh = self.mm(x, L["wq"]).view(B, c.mla_heads, c.nope + c.rope)
                qn = torch.einsum("bhn,hnl->bhl", qh[..., : c.nope].to(L["wuk"].dtype), L["wuk"]).float()
                ql = torch.cat([qn, qh[..., c.nope:]], -1)
                rows = L["rows"]
                score = torch.einsum("bhw,btw->bht", ql, rows) / math.sqrt(c.nope + c.rope)
                o_lat = torch.einsum("bht,btl->bhl", torch.softmax(score, -1), rows[..., : c.lora])
                y = torch.einsum("bhl,hlv->bhv", o_lat.to(L["wuv"].dtype), L["wuv"]).float()
                m = self.mm(y.flatten(1), L["wo"])
            h = h + m
            x = rms(h, L["mlp_norm"])
            h = h + self.mm(F.silu(self.mm(x, L["gate"])) * self.mm(x, L["up"]), L["down"])
        return self.mm(rms(h, self.final_norm), self.lm_head).argmax(-1)


def timed(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--batches", default="1,8,32,88")
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--wdtype", default="f32", choices=["f32", "bf16"])
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = Config.from_toml(a.config)
    model = load(a.weights, cfg, dtype=torch.float32)
    wdtype = torch.float32 if a.wdtype == "f32" else torch.bfloat16
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: the model of {a.config}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {a.wdtype} weights, context {a.context}")
    for B in [int(b) for b in a.batches.split(",")]:
        dec = BatchedDecode(model, B, a.context, wdtype, dev)
        tok = torch.randint(0, 256, (B,), device=dev)
        with torch.no_grad():
            for _ in range(3):
                dec.step(tok)
            torch.cuda.synchronize()
            eager = timed(lambda: dec.step(tok), 10)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    dec.step(tok)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                dec.step(tok)
            graph.replay()
            torch.cuda.synchronize()
            replay = timed(graph.replay, 30)
        print(f"torch decode step batch {B}: graph {replay * 1e3:.1f} us, eager {eager * 1e3:.1f} us")
        del dec, graph
        torch.cuda.empty_cache()

    # Prefill of one prompt (the training form: chunked KDA, SDPA for MLA).
    m = model.to(dev)
    toks = torch.randint(0, 256, (1, a.prefill), device=dev)
    with torch.no_grad():
        m(toks)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m(toks)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    print(f"torch prefill {a.prefill} tokens: {dt * 1e3:.1f} ms = {a.prefill / dt:.0f} tokens/s (eager)")

    # torch.matmul (cuBLAS) at cuda_check --bench's shapes.
    for (mr, k, n) in [(1, 7168, 7168), (88, 7168, 7168), (4096, 4096, 4096), (1, 2048, 2048), (88, 2048, 2048)]:
        for dt_name, dt in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
            x = torch.randn(mr, k, device=dev, dtype=dt)
            w = torch.randn(k, n, device=dev, dtype=dt)
            for _ in range(3):
                x @ w
            ms = timed(lambda: x @ w, 20)
            print(f"torch.matmul {dt_name} {mr}x{k}.{k}x{n}: {ms * 1e3:.1f} us, {2 * mr * k * n / (ms * 1e-3) / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
