"""CPU self-checks of the reference (float64): run `python3 tools/torch_ref/test_ref.py`.

1. the parameter names and shapes are those of docs/weights.md's table (parsed from
   the page itself);
2. the chunked KDA equals the recurrence (several chunk sizes, a ragged tail, a
   start state);
3. ReplaySSM's rebuild from the records equals the recurrent state;
4. absorbed MLA equals MLA with the keys and values expanded per head;
5. the training forward (chunked KDA, SDPA MLA) equals the token-by-token reference.
"""
import math
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Config, Model, kda_chunked, kda_recurrent, replay_rebuild, rms  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
torch.set_default_dtype(torch.float64)


def check(name, a, b, tol):
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    ok = err <= tol * max(scale, 1e-30)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max abs err {err:.3e} (scale {scale:.3e})")
    if not ok:
        sys.exit(1)


def doc_shapes(c: Config):
    """Names and shapes from docs/weights.md's table, symbols evaluated for c."""
    sym = dict(V=c.vocab, d=c.hidden, I=c.intermediate, H=c.kda_heads, Dk=c.dk, Dv=c.dv,
               W=c.conv, C=2 * c.kda_heads * c.dk + c.kda_heads * c.dv, Hm=c.mla_heads,
               L=c.lora, R=c.rope, Dn=c.nope, Dvh=c.vh)
    rows = re.findall(r"^\| `([^`]+)` \| `\[([^\]]+)\]`", open(os.path.join(REPO, "docs/weights.md")).read(), re.M)
    want = {}
    for name, shape in rows:
        dims = tuple(eval(s, {}, dict(sym)) for s in shape.split(","))
        if "{i}" not in name:
            want[name] = dims
            continue
        for i, kind in enumerate(c.kinds()):
            part = name.split(".")[2]
            if part in ("kda", "mla") and part != {"K": "kda", "M": "mla"}[kind]:
                continue
            want[name.replace("{i}", str(i))] = dims
    return want


def main():
    torch.manual_seed(0)
    c = Config(hidden=32, num_layers=5, intermediate=48, kda_heads=2, dk=8, dv=12, conv=4,
               mla_heads=2, lora=16, rope=4, nope=8, vh=6)

    # 1. names and shapes
    m = Model(c)
    got = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    want = doc_shapes(c)
    assert got == want, (set(got.items()) ^ set(want.items()))
    print(f"ok   names and shapes: {len(got)} tensors as docs/weights.md")

    # 2. chunked == recurrent (random gates, strong and weak decays)
    B, H, T, Dk, Dv = 2, 3, 37, 8, 5
    q = torch.nn.functional.normalize(torch.randn(B, H, T, Dk), dim=-1) / math.sqrt(Dk)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, Dk), dim=-1)
    v = torch.randn(B, H, T, Dv)
    g = -torch.rand(B, H, T, Dk) * 3.0
    beta = torch.rand(B, H, T)
    S0 = torch.randn(B, H, Dk, Dv)
    ref_o, ref_S = [], []
    for b in range(B):
        tr = lambda z: z[b].transpose(0, 1)
        o, S = kda_recurrent(tr(q), tr(k), tr(v), tr(g), beta[b].T, S0[b].clone())
        ref_o.append(o.transpose(0, 1))
        ref_S.append(S)
    ref_o, ref_S = torch.stack(ref_o), torch.stack(ref_S)
    for chunk in (1, 8, 16, 64):
        o, S = kda_chunked(q, k, v, g, beta, S0, chunk=chunk)
        check(f"chunked KDA (chunk {chunk}) output", o, ref_o, 1e-10)
        check(f"chunked KDA (chunk {chunk}) state", S, ref_S, 1e-10)

    # 3. ReplaySSM rebuild
    recs = []
    tr = lambda z: z[0].transpose(0, 1)
    _, S = kda_recurrent(tr(q), tr(k), tr(v), tr(g), beta[0].T, S0[0].clone(), recs)
    check("ReplaySSM rebuild", replay_rebuild(S0[0], recs), S, 1e-10)

    # random weights with some spread, so that every term matters
    m.init_weights(seed=1, std=0.3)
    m.eval()

    # 4. absorbed MLA == expanded MLA (keys k_nope = wuk @ latent, values wuv^T latent)
    mla = m.layers[3].mla
    x = torch.randn(T, c.hidden)
    st = mla.init_state(torch.float64, "cpu")
    absorbed = torch.stack([mla.step(x[t], st) for t in range(T)])
    rows = mla._row(x)  # [T, L+R]
    lat, rope = rows[:, : c.lora], rows[:, c.lora :]
    qh = (x @ mla.wq).unflatten(-1, (c.mla_heads, c.nope + c.rope))
    outs = []
    for h in range(c.mla_heads):
        kn = lat @ mla.wuk[h].T  # [T, Dn]
        vh = lat @ mla.wuv[h]  # [T, Dvh]
        s = (qh[:, h, : c.nope] @ kn.T + qh[:, h, c.nope :] @ rope.T) / math.sqrt(c.nope + c.rope)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.softmax(s, -1) @ vh)
    expanded = torch.cat(outs, -1) @ mla.wo
    check("absorbed MLA vs expanded", absorbed, expanded, 1e-10)

    # 5. training forward == token-by-token reference
    toks = torch.randint(0, 256, (2, 41))
    with torch.no_grad():
        full = m(toks, chunk=16)
        for b in range(2):
            state = m.init_state()
            steps = torch.stack([m.step(int(t), state) for t in toks[b]])
            check(f"training forward vs reference (seq {b})", full[b], steps, 1e-9)
    print("all checks passed")


if __name__ == "__main__":
    main()
