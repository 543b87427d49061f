"""Checks the reference KDA against FLA's kernels (fla-core 0.6.0) on a GPU.

    PYTHONPATH=<fla site> python3 tools/torch_ref/check_fla.py

Ground truth: model.kda_recurrent in float64 (on the CPU), fed q, k normalised and
q scaled by Dk^-1/2, g = -exp(a_log) * softplus(g_raw + dt_bias), beta =
sigmoid(b_raw), as docs/design.md section 5 states. Compared with it, all in f32 on the
GPU, with a random start state and a ragged length (not a multiple of 64):

  mine-chunked   model.kda_chunked (the training form)
  fla-chunk-raw  chunk_kda fed the raw inputs: use_qk_l2norm_in_kernel,
                 use_gate_in_kernel (A_log, dt_bias), use_beta_sigmoid_in_kernel,
                 default scale
  fla-recur-raw  fused_recurrent_kda, the same raw inputs and flags
  fla-chunk-pre  chunk_kda fed what the reference computes (normalised q/k, the
                 log decay g, beta after sigmoid), scale=None: isolates the
                 recurrence and the default scale
  fla-chunk-s1   as fla-chunk-pre but q pre-scaled and scale=1.0: shows that the
                 default scale is Dk^-1/2 on q

and the gradients of mine-chunked against fla-chunk-raw (w.r.t. the raw q, k, v,
g_raw, b_raw) for one case.
"""
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import kda_chunked, kda_gate, kda_recurrent, l2n  # noqa: E402


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def reference(q, k, v, graw, braw, a_log, dt_bias, S0):
    """float64 on the CPU, one batch row at a time; inputs [B, T, H, D]."""
    B, T, H, Dk = q.shape
    q, k, v, graw, braw, a_log, dt_bias, S0 = (x.double().cpu() for x in (q, k, v, graw, braw, a_log, dt_bias, S0))
    qn, kn = l2n(q), l2n(k)  # qn returned unscaled: FLA's default scale applies Dk^-1/2
    g = kda_gate(graw, a_log, dt_bias)
    beta = torch.sigmoid(braw)
    os_, ss = [], []
    for b in range(B):
        o, S = kda_recurrent(qn[b] / math.sqrt(Dk), kn[b], v[b], g[b], beta[b], S0[b].clone())
        os_.append(o)
        ss.append(S)
    return torch.stack(os_), torch.stack(ss), (qn, kn, g, beta)


def main():
    dev = torch.device(os.environ.get("CHECK_FLA_DEVICE", "cuda"))
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    import fla
    print(f"fla {getattr(fla, '__version__', '?')}, torch {torch.__version__}, {torch.cuda.get_device_name() if dev.type == 'cuda' else dev}")
    for (B, T, H, Dk, Dv) in [(2, 300, 4, 32, 32), (2, 200, 2, 64, 64)]:
        gen = torch.Generator().manual_seed(T)
        rnd = lambda *s: torch.randn(*s, generator=gen)
        q, k = rnd(B, T, H, Dk), rnd(B, T, H, Dk)
        v = rnd(B, T, H, Dv)
        graw, braw = rnd(B, T, H, Dk), rnd(B, T, H)
        a_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
        dt = torch.exp(torch.empty(H * Dk).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        dt_bias = dt + torch.log(-torch.expm1(-dt))
        S0 = rnd(B, H, Dk, Dv) * 0.5
        ref_o, ref_S, (qn, kn, g, beta) = reference(q, k, v, graw, braw, a_log, dt_bias, S0)
        print(f"case B={B} T={T} H={H} Dk={Dk} Dv={Dv}: |o| max {ref_o.abs().max():.3f}, |S| max {ref_S.abs().max():.3f}")

        cu = lambda x: x.float().to(dev).contiguous()
        tr = lambda x: x.transpose(1, 2)
        res = {}
        o, S = kda_chunked(tr(cu(qn) * Dk**-0.5), tr(cu(kn)), tr(cu(v)), tr(cu(g)), tr(cu(beta)), cu(S0), chunk=32)
        res["mine-chunked"] = (tr(o), S)
        for name, fn in (("fla-chunk-raw", chunk_kda), ("fla-recur-raw", fused_recurrent_kda)):
            try:
                o, S = fn(cu(q), cu(k), cu(v), cu(graw), cu(braw), A_log=cu(a_log), dt_bias=cu(dt_bias),
                          initial_state=cu(S0), output_final_state=True, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
                res[name] = (o, S)
            except Exception as e:  # report, keep going
                print(f"  {name}: error {type(e).__name__}: {e}")
        try:
            o, S = chunk_kda(cu(qn), cu(kn), cu(v), cu(g), cu(beta), initial_state=cu(S0), output_final_state=True)
            res["fla-chunk-pre"] = (o, S)
            o, S = chunk_kda(cu(qn) * Dk**-0.5, cu(kn), cu(v), cu(g), cu(beta), scale=1.0,
                             initial_state=cu(S0), output_final_state=True)
            res["fla-chunk-s1"] = (o, S)
        except Exception as e:
            print(f"  fla-chunk-pre: error {type(e).__name__}: {e}")
        for name, (o, S) in res.items():
            print(f"  {name:14s} output rel err {rel(o, ref_o):.2e}   final state rel err {rel(S, ref_S):.2e}")

    # gradients: mine-chunked (through the gate/norm functions) vs fla-chunk-raw
    try:
        B, T, H, Dk, Dv = 2, 300, 4, 32, 32
        gen = torch.Generator().manual_seed(1)
        ins = [torch.randn(B, T, H, Dk, generator=gen), torch.randn(B, T, H, Dk, generator=gen),
               torch.randn(B, T, H, Dv, generator=gen), torch.randn(B, T, H, Dk, generator=gen),
               torch.randn(B, T, H, generator=gen)]
        a_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen)).to(dev)
        dt = torch.exp(torch.empty(H * Dk).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(dev)
        w = torch.randn(B, T, H, Dv, generator=gen).to(dev)
        grads = {}
        for name in ("mine", "fla"):
            xs = [x.to(dev).requires_grad_(True) for x in ins]
            q, k, v, graw, braw = xs
            if name == "mine":
                tr = lambda x: x.transpose(1, 2)
                o, _ = kda_chunked(tr(l2n(q) / math.sqrt(Dk)), tr(l2n(k)), tr(v), tr(kda_gate(graw, a_log, dt_bias)),
                                   tr(torch.sigmoid(braw)), chunk=32)
                o = tr(o)
            else:
                o, _ = chunk_kda(q, k, v, graw, braw, A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                                 use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
            (o * w).sum().backward()
            grads[name] = [x.grad for x in xs]
        for nm, gm, gf in zip(("q", "k", "v", "g_raw", "b_raw"), grads["mine"], grads["fla"]):
            print(f"  grad {nm:6s} mine-chunked vs fla-chunk-raw rel err {rel(gm, gf):.2e}")
    except Exception as e:
        print(f"  gradients: error {type(e).__name__}: {e}")
    print(f"fla check done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
