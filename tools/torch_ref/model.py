"""Independent PyTorch reference of handoff's compute model.

Written from docs/weights.md (tensor names, shapes, the forward pass) and
docs/design.md section 5 (the KDA and MLA math), not from the Rust source. Two forms of
every mixer live here:

* the reference: token by token, the way decode runs (`Model.step`). KDA keeps its
  recurrent state S [H, Dk, Dv] and the last W-1 conv inputs; MLA keeps its cached
  rows [L+R]. This is what golden.py uses, in float64.
* the training form (`Model.forward`): whole sequences at once. KDA uses the chunked
  form below (`kda_chunked`), MLA uses scaled_dot_product_attention on the latent
  rows. test_ref.py checks that both forms compute the same function.

Every matrix is [in, out] and applied as `x @ W`, as the weight file stores it, so
the parameters are exactly the tensors of docs/weights.md and `state_dict()` is the
file.
"""
import math
import tomllib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-6  # RMSNorm and the q/k L2 norm (docs/weights.md)


@dataclass
class Config:
    vocab: int = 256
    hidden: int = 128
    num_layers: int = 8
    pattern: str = "KKKM"
    intermediate: int = 384
    # KDA
    kda_heads: int = 4
    dk: int = 32
    dv: int = 32
    conv: int = 4
    # MLA
    mla_heads: int = 4
    lora: int = 64  # L, kv_lora_rank
    rope: int = 16  # R, rope_dim (stored and scored, never rotated: NoPE)
    nope: int = 32  # Dn
    vh: int = 32  # Dvh

    def kinds(self):
        """Layer kinds: the pattern repeated, then cut to num_layers."""
        reps = -(-self.num_layers // len(self.pattern))
        return list((self.pattern * reps)[: self.num_layers])

    @classmethod
    def from_toml(cls, path):
        with open(path, "rb") as f:
            t = tomllib.load(f)
        m = t["model"]
        d = m["hidden_size"]
        return cls(
            hidden=d,
            num_layers=m["num_layers"],
            pattern=m["pattern"],
            intermediate=m.get("intermediate_size", 2 * d),
            kda_heads=m["kda"]["heads"],
            dk=m["kda"]["head_k_dim"],
            dv=m["kda"]["head_v_dim"],
            conv=m["kda"]["conv_kernel"],
            mla_heads=m["mla"]["heads"],
            lora=m["mla"]["kv_lora_rank"],
            rope=m["mla"]["rope_dim"],
            nope=m["mla"]["nope_head_dim"],
            vh=m["mla"]["v_head_dim"],
        )


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def l2n(x):
    # x / sqrt(|x|^2 + 1e-6): eps inside the root, as docs/design.md section 5 writes it
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + EPS)


def kda_gate(g_raw, a_log, dt_bias):
    """Log decay per key channel: -exp(a_log[h]) * softplus(g_raw + dt_bias[h]).

    g_raw [..., H, Dk], a_log [H], dt_bias [H*Dk]. torch's softplus returns x for
    x > 20, the threshold docs/weights.md states.
    """
    H, Dk = g_raw.shape[-2:]
    return -torch.exp(a_log)[:, None] * F.softplus(g_raw + dt_bias.view(H, Dk))


# ---------------------------------------------------------------------------
# KDA core: the recurrence (reference) and the chunked form (training)
# ---------------------------------------------------------------------------

def kda_recurrent(q, k, v, g, beta, S=None, records=None):
    """The reference, one token at a time (docs/design.md section 5, steps 4-7).

    q, k [T, H, Dk] already normalised (q also scaled by Dk^-1/2), v [T, H, Dv],
    g [T, H, Dk] log decay, beta [T, H]. S [H, Dk, Dv] (zeros when None).
    `records`, a list, receives the ReplaySSM record (k, u, g) of every token.
    Returns (o [T, H, Dv], S).
    """
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    if S is None:
        S = torch.zeros(H, Dk, Dv, dtype=q.dtype, device=q.device)
    out = []
    for t in range(T):
        S = torch.exp(g[t])[:, :, None] * S  # row i (key channel i) times alpha[i]
        pred = torch.einsum("hkv,hk->hv", S, k[t])  # S'^T k
        u = beta[t][:, None] * (v[t] - pred)
        S = S + k[t][:, :, None] * u[:, None, :]  # + k u^T
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))  # S^T q
        if records is not None:
            records.append((k[t].clone(), u.clone(), g[t].clone()))
    return torch.stack(out), S


def replay_rebuild(S0, records):
    """ReplaySSM: S_n = exp(G_n) S_0 + sum_j exp(G_n - G_j) k_j u_j^T, G the
    cumulative g (inclusive of token j itself: token j's update is applied after its
    own decay, so it decays only by the tokens after it)."""
    ks = torch.stack([r[0] for r in records])  # [n, H, Dk]
    us = torch.stack([r[1] for r in records])  # [n, H, Dv]
    gs = torch.stack([r[2] for r in records])  # [n, H, Dk]
    G = gs.cumsum(0)
    Gn = G[-1]
    S = torch.exp(Gn)[:, :, None] * S0
    w = torch.exp(Gn[None] - G)  # [n, H, Dk], <= 1
    return S + torch.einsum("nhk,nhv->hkv", w * ks, us)


def kda_chunked(q, k, v, g, beta, S0=None, chunk=32):
    """Chunked form of the same recurrence, for training speed.

    Batched: q, k [B, H, T, Dk] (normalised, q scaled), v [B, H, T, Dv],
    g [B, H, T, Dk], beta [B, H, T]. Returns (o [B, H, T, Dv], S [B, H, Dk, Dv]).

    Inside a chunk with start state S0 and gamma_t = cumsum of g up to t:
      S_t = D(gamma_t) S0 + sum_{j<=t} D(gamma_t - gamma_j) k_j u_j^T
      u_t = beta_t (v_t - S0^T (e^gamma_t k_t) - sum_{j<t} A_tj u_j),
            A_tj = sum_c k_t[c] k_j[c] e^(gamma_t[c] - gamma_j[c])
    so (I + diag(beta) A) U = diag(beta) (V - (K e^gamma) S0): a unit lower
    triangular solve, done once per chunk for V and for K e^gamma, which makes
    U = W1 - W2 S0 and leaves only small matmuls in the sequential loop. Every
    exponent used is a difference gamma_t - gamma_j with j <= t (or gamma_t itself),
    so it is <= 0 and nothing overflows.
    """
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk
    pad = (-T) % C
    if pad:
        # padded tokens: k = 0 writes nothing, g = 0 decays nothing
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v, g = (x.reshape(B, H, N, C, -1) for x in (q, k, v, g))
    beta = beta.reshape(B, H, N, C, 1)

    gc = g.cumsum(-2)  # [B, H, N, C, Dk]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = gc[..., :, None, :] - gc[..., None, :, :]  # [.., t, j, Dk]
    E = torch.exp(diff.masked_fill(~incl[:, :, None], float("-inf")))
    A = ((k[..., :, None, :] * E) * k[..., None, :, :]).sum(-1)  # [.., t, j]
    A = A * (~torch.eye(C, dtype=torch.bool, device=q.device))  # strictly lower
    Aqk = ((q[..., :, None, :] * E) * k[..., None, :, :]).sum(-1)  # j <= t
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    Tm = eye + beta * A
    eg = torch.exp(gc)
    W1 = torch.linalg.solve_triangular(Tm, beta * v, upper=False, unitriangular=True)
    W2 = torch.linalg.solve_triangular(Tm, beta * (k * eg), upper=False, unitriangular=True)
    Qg = q * eg
    Kd = k * torch.exp(gc[..., -1:, :] - gc)  # decay from token j to the chunk's end
    dend = eg[..., -1, :]  # [B, H, N, Dk]

    S = torch.zeros(B, H, Dk, Dv, dtype=q.dtype, device=q.device) if S0 is None else S0
    outs = []
    for n in range(N):
        U = W1[:, :, n] - W2[:, :, n] @ S
        outs.append(Qg[:, :, n] @ S + Aqk[:, :, n] @ U)
        S = dend[:, :, n, :, None] * S + Kd[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, Dv)[:, :, :T]
    return o, S


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------

def _p(*shape):
    return nn.Parameter(torch.empty(*shape))


class KDA(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        H, Dk, Dv, d = c.kda_heads, c.dk, c.dv, c.hidden
        C = 2 * H * Dk + H * Dv
        self.wqkv = _p(d, C)
        self.conv = _p(C, c.conv)
        self.wg = _p(d, H * Dk)
        self.wb = _p(d, H)
        self.a_log = _p(H)
        self.dt_bias = _p(H * Dk)
        self.wgate = _p(d, H * Dv)
        self.onorm = _p(Dv)
        self.wo = _p(H * Dv, d)

    def _split(self, c):
        """c [..., C] (after conv + SiLU) -> q, k [..., H, Dk], v [..., H, Dv]."""
        H, Dk, Dv = self.c.kda_heads, self.c.dk, self.c.dv
        q = c[..., : H * Dk].unflatten(-1, (H, Dk))
        k = c[..., H * Dk : 2 * H * Dk].unflatten(-1, (H, Dk))
        v = c[..., 2 * H * Dk :].unflatten(-1, (H, Dv))
        return l2n(q) / math.sqrt(Dk), l2n(k), v

    def _gates(self, x):
        H, Dk = self.c.kda_heads, self.c.dk
        g = kda_gate((x @ self.wg).unflatten(-1, (H, Dk)), self.a_log, self.dt_bias)
        beta = torch.sigmoid(x @ self.wb)
        return g, beta

    def _out(self, x, o):
        """Gated RMSNorm per head (onorm shared by the heads), then wo."""
        H, Dv = self.c.kda_heads, self.c.dv
        gate = F.silu(x @ self.wgate).unflatten(-1, (H, Dv))
        y = rms(o, self.onorm) * gate
        return y.flatten(-2) @ self.wo

    def forward(self, x, chunk=32):
        """Training form: x [B, T, d]."""
        W = self.c.conv
        c = x @ self.wqkv  # [B, T, C]
        # depthwise causal conv, out[t] = sum_j conv[:, j] * c[t - (W-1) + j]
        c = F.conv1d(F.pad(c.transpose(1, 2), (W - 1, 0)), self.conv[:, None, :], groups=c.shape[-1])
        c = F.silu(c.transpose(1, 2))
        q, k, v = self._split(c)
        g, beta = self._gates(x)
        tr = lambda z: z.transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D]
        o, _ = kda_chunked(tr(q), tr(k), tr(v), tr(g), beta.transpose(1, 2), chunk=chunk)
        return self._out(x, tr(o))

    def step(self, x, state):
        """Reference, one token: x [d]. state: {'S': [H,Dk,Dv], 'conv': [W-1, C]}."""
        c = x @ self.wqkv
        window = torch.cat([state["conv"], c[None]], 0)  # [W, C], last row = current token
        state["conv"] = window[1:]
        c = F.silu((window * self.conv.T).sum(0))
        q, k, v = self._split(c)
        g, beta = self._gates(x)
        o, state["S"] = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], state["S"],
                                      state.get("records"))
        return self._out(x, o[0])

    def init_state(self, dtype, device):
        c = self.c
        C = 2 * c.kda_heads * c.dk + c.kda_heads * c.dv
        return {"S": torch.zeros(c.kda_heads, c.dk, c.dv, dtype=dtype, device=device),
                "conv": torch.zeros(c.conv - 1, C, dtype=dtype, device=device)}


class MLA(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        d, Hm, L, R, Dn, Dvh = c.hidden, c.mla_heads, c.lora, c.rope, c.nope, c.vh
        self.wkva = _p(d, L + R)
        self.kv_norm = _p(L)
        self.wq = _p(d, Hm * (Dn + R))
        self.wuk = _p(Hm, Dn, L)
        self.wuv = _p(Hm, L, Dvh)
        self.wo = _p(Hm * Dvh, d)

    def _row(self, x):
        """The cached row [.., L+R]: RMS-normed latent, then the (unrotated) rope part."""
        L = self.c.lora
        row = x @ self.wkva
        return torch.cat([rms(row[..., :L], self.kv_norm), row[..., L:]], -1)

    def _qlat(self, x):
        """[.., Hm, L+R]: q_nope absorbed through wuk, q_rope as is."""
        c = self.c
        qh = (x @ self.wq).unflatten(-1, (c.mla_heads, c.nope + c.rope))
        qn = torch.einsum("...hn,hnl->...hl", qh[..., : c.nope], self.wuk)
        return torch.cat([qn, qh[..., c.nope :]], -1)

    def _out(self, o_lat):
        """o_lat [.., Hm, L] -> [.., d]."""
        return torch.einsum("...hl,hlv->...hv", o_lat, self.wuv).flatten(-2) @ self.wo

    def forward(self, x):
        """Training form: x [B, T, d]; one latent KV head shared by all query heads."""
        c = self.c
        row = self._row(x)  # [B, T, L+R]
        ql = self._qlat(x).transpose(1, 2)  # [B, Hm, T, L+R]
        B, Hm, T, _ = ql.shape
        kk = row[:, None].expand(B, Hm, T, row.shape[-1])
        vv = row[:, None, :, : c.lora].expand(B, Hm, T, c.lora)
        o = F.scaled_dot_product_attention(ql, kk, vv, is_causal=True,
                                           scale=1.0 / math.sqrt(c.nope + c.rope))
        return self._out(o.transpose(1, 2))

    def step(self, x, state):
        """Reference, one token: x [d]; state {'rows': [t, L+R]} grows by one row."""
        c = self.c
        state["rows"] = torch.cat([state["rows"], self._row(x)[None]], 0)
        rows = state["rows"]
        ql = self._qlat(x)  # [Hm, L+R]
        score = (ql @ rows.T) / math.sqrt(c.nope + c.rope)  # [Hm, t]
        o_lat = torch.softmax(score, -1) @ rows[:, : c.lora]  # [Hm, L]
        return self._out(o_lat)

    def init_state(self, dtype, device):
        return {"rows": torch.zeros(0, self.c.lora + self.c.rope, dtype=dtype, device=device)}


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate = _p(c.hidden, c.intermediate)
        self.up = _p(c.hidden, c.intermediate)
        self.down = _p(c.intermediate, c.hidden)

    def forward(self, x):
        return (F.silu(x @ self.gate) * (x @ self.up)) @ self.down


class Block(nn.Module):
    def __init__(self, c: Config, kind: str):
        super().__init__()
        self.kind = kind
        self.attn_norm = _p(c.hidden)
        self.mlp_norm = _p(c.hidden)
        self.mlp = MLP(c)
        if kind == "K":
            self.kda = KDA(c)
        else:
            self.mla = MLA(c)

    @property
    def mixer(self):
        return self.kda if self.kind == "K" else self.mla


class Model(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed = _p(c.vocab, c.hidden)
        self.final_norm = _p(c.hidden)
        self.lm_head = _p(c.hidden, c.vocab)
        self.layers = nn.ModuleList(Block(c, kind) for kind in c.kinds())

    # -- training form ------------------------------------------------------
    def forward(self, tokens, dropout=0.0, chunk=32):
        """tokens [B, T] -> logits [B, T, V]. Dropout (training only) on each branch
        output; the served model has none."""
        h = self.embed[tokens]
        for blk in self.layers:
            x = rms(h, blk.attn_norm)
            m = blk.kda(x, chunk=chunk) if blk.kind == "K" else blk.mla(x)
            h = h + F.dropout(m, dropout, self.training)
            x = rms(h, blk.mlp_norm)
            h = h + F.dropout(blk.mlp(x), dropout, self.training)
        return rms(h, self.final_norm) @ self.lm_head

    # -- reference (token by token) -----------------------------------------
    def init_state(self, dtype=torch.float64, device="cpu"):
        return [blk.mixer.init_state(dtype, device) for blk in self.layers]

    def step(self, token, state):
        """One token through every layer with the per-layer state -> logits [V]."""
        h = self.embed[token]
        for blk, st in zip(self.layers, state):
            h = h + blk.mixer.step(rms(h, blk.attn_norm), st)
            h = h + blk.mlp(rms(h, blk.mlp_norm))
        return rms(h, self.final_norm) @ self.lm_head

    def prefill(self, tokens, state):
        """The prompt through the reference, token by token; returns the logits of
        the last prompt token (what prefill hands to the first decode step)."""
        logits = None
        for t in tokens:
            logits = self.step(int(t), state)
        return logits

    # -- weights ------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed=0, std=0.02):
        gen = torch.Generator().manual_seed(seed)
        c = self.c
        out_std = std / math.sqrt(2 * c.num_layers)  # residual-branch outputs
        for name, p in self.named_parameters():
            leaf = name.split(".")[-1]
            if leaf in ("attn_norm", "mlp_norm", "final_norm", "onorm", "kv_norm"):
                p.fill_(1.0)
            elif leaf == "a_log":
                # decay rates A in [1, 16], as in Mamba-style SSM inits
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 16, generator=gen)))
            elif leaf == "dt_bias":
                # softplus(dt_bias) log-uniform in [1e-3, 1e-1]: per-step decays
                # from nearly 1 (long memory) to about exp(-1.6) (short memory)
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif leaf == "conv":
                b = 1.0 / math.sqrt(c.conv)
                p.copy_(torch.empty(p.shape).uniform_(-b, b, generator=gen))
            elif name.endswith(("kda.wo", "mla.wo", "mlp.down")):
                p.copy_(torch.randn(p.shape, generator=gen) * out_std)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def load(path, config, dtype=torch.float64):
    """The reference model from a weights file (BF16 or F32, widened as the loader
    does), checked against docs/weights.md's names and shapes."""
    from safetensors.torch import load_file

    model = Model(config)
    sd = load_file(path)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in sd.items()}
    if want != got:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise ValueError(f"weights do not match: missing {missing}, extra {extra}, wrong shape {wrong}")
    model.load_state_dict({k: v.to(torch.float32).to(dtype) for k, v in sd.items()})
    return model.to(dtype)
