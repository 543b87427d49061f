#!/usr/bin/env python3
"""Compile kda_decode.hip through NVRTC (CuPy) and check it against a float64
NumPy version of design.md section 5. Runs on the lent H200:

    python3 kernels/hip/check_nvrtc.py

Prints one line per case and a timing of the batch-88 x 12-head step under graph
replay (the shape of FLA's fused_recurrent_kda figure in design.md section 7). Exits
non-zero on the first mismatch, naming (slot, head, channel).
"""
import pathlib
import sys

import cupy as cp
import numpy as np

SRC = (pathlib.Path(__file__).parent / "kda_decode.hip").read_text()


def softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def reference(state, q, k, v, g_raw, b_raw, a_log, dt_bias):
    """One step for [B, H] heads in float64; returns (state', out, record)."""
    B, H, dk, dv = state.shape
    qh = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    kh = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    g = -np.exp(a_log)[None, :, None] * softplus(g_raw + dt_bias[None])
    beta = 1.0 / (1.0 + np.exp(-b_raw))
    s = state * np.exp(g)[..., None]
    u = beta[..., None] * (v - np.einsum("bhij,bhi->bhj", s, kh))
    s = s + kh[..., :, None] * u[..., None, :]
    o = np.einsum("bhij,bhi->bhj", s, qh)
    rec = np.concatenate([kh, u, g], axis=-1)
    return s, o, rec


def run_case(kernel, B, H, dk, dv, threads, seed):
    rng = np.random.default_rng(seed)
    f = lambda *shape, lo=-1.0, hi=1.0: rng.uniform(lo, hi, shape).astype(np.float32)
    state = f(B, H, dk, dv, lo=-0.5, hi=0.5)
    q, k, g_raw = f(B, H, dk), f(B, H, dk), f(B, H, dk, lo=-3.0, hi=1.0)
    v, b_raw = f(B, H, dv), f(B, H, lo=-2.0, hi=2.0)
    a_log, dt_bias = f(H, lo=-2.0, hi=0.5), f(H, dk)
    want_s, want_o, want_r = reference(*(x.astype(np.float64) for x in (state, q, k, v, g_raw, b_raw, a_log, dt_bias)))

    d = [cp.asarray(x) for x in (state, q, k, v, g_raw, b_raw, a_log, dt_bias)]
    out = cp.zeros((B, H, dv), cp.float32)
    rec = cp.zeros((B, H, 2 * dk + dv), cp.float32)
    shmem = (4 * dk + threads) * 4
    kernel((B * H,), (threads,), (*d, out, rec, np.int32(H), np.int32(dk), np.int32(dv)), shared_mem=shmem)
    cp.cuda.Device().synchronize()
    for name, got, want in (("state", d[0], want_s), ("out", out, want_o), ("record", rec, want_r)):
        got = cp.asnumpy(got).astype(np.float64)
        bad = np.abs(got - want) > 1e-5 + 1e-4 * np.abs(want)
        if bad.any():
            idx = np.unravel_index(np.argmax(bad), bad.shape)
            print(f"FAIL B={B} H={H} dk={dk} dv={dv} threads={threads}: {name} first mismatch at "
                  f"slot={idx[0]} head={idx[1]} channel={idx[2:]}: got {got[idx]}, want {want[idx]}")
            sys.exit(1)
    print(f"ok   B={B} H={H} dk={dk} dv={dv} threads={threads}: state, out, record match float64")
    return d, out, rec, shmem


def main():
    mod = cp.RawModule(code=SRC, backend="nvrtc", options=("--std=c++17",))
    kernel = mod.get_function("kda_decode_step")
    print(f"NVRTC compiled kda_decode.hip on {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for (B, H, dk, dv, threads) in ((2, 3, 128, 128, 128), (3, 2, 40, 24, 64), (1, 1, 7, 300, 256), (4, 5, 64, 32, 32), (2, 2, 160, 64, 64)):
        run_case(kernel, B, H, dk, dv, threads, seed=B * 100 + dk)
    # Timing at FLA's figure's shape: batch 88 x 12 heads of 128x128 f32
    # state, and 8x that batch to see whether launches or bytes bound it.
    for B in (88, 704):
        H, dk, dv, threads = 12, 128, 128, 128
        d, out, rec, shmem = run_case(kernel, B, H, dk, dv, threads, seed=1)
        args = (*d, out, rec, np.int32(H), np.int32(dk), np.int32(dv))
        null_args = (*d, out, np.uint64(0), np.int32(H), np.int32(dk), np.int32(dv))
        for label, a in (("with record", args), ("no record", null_args)):
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                for _ in range(10):
                    kernel((B * H,), (threads,), a, shared_mem=shmem)
                # One graph of 20 steps, replayed: launch overhead out of the figure.
                stream.begin_capture()
                for _ in range(20):
                    kernel((B * H,), (threads,), a, shared_mem=shmem)
                graph = stream.end_capture()
                graph.launch()
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                reps = 10
                start.record()
                for _ in range(reps):
                    graph.launch()
                stop.record()
                stop.synchronize()
            us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / (reps * 20)
            state_bytes = B * H * dk * dv * 4 * 2  # read + write
            print(f"time B={B} H={H} 128x128 ({label}, graph replay): {us:.1f} us/step, "
                  f"{state_bytes / us / 1e6:.2f} TB/s of state traffic")

if __name__ == "__main__":
    main()
