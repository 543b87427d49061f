"""Peers of handoff's device kernels, measured on the same GPU in the same call.

Run on the GPU machine (torch, triton and the fla-core wheel installed):
    python3 benches/peers/fla_kda.py            # prints one JSON object per line
    python3 benches/peers/fla_kda.py --kernels  # chunk_kda's kernels one by one (torch.profiler)

Figures:
- copy: a device-to-device copy through torch, bytes read plus bytes written,
  the bandwidth ceiling the state and KV traffic is compared against;
- fused_recurrent_kda: FLA's KDA decode step (one token per sequence, state in
  place, the gate, beta sigmoid and q/k L2 norm fused, as handoff's step does)
  at the issue's shapes, timed by CUDA graph replay;
- chunk_kda: FLA's chunked KDA prefill at T = 8K and 32K tokens, 12 heads,
  with bf16 inputs (as FLA is run in serving: the peer the issue names) and
  with f32 inputs (handoff's prefill takes f32 and keeps f32 accuracy; FLA's
  products then run in TF32), each row labelled with its dtype.

Each time is the median of many replays after a warm-up; inputs are random
(never zeros) and the state is f32, as handoff keeps it.
"""

import json
import statistics
import sys

import torch


def median_ms(fn, warmup=5, reps=50, graph=True):
    """Median time of fn() in ms: graph replays when graph=True, else launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
        for _ in range(3):
            run()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth():
    n = 1 << 30  # 4 GiB of f32 read, 4 GiB written: far past the 60 MB L2
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps=20, graph=False)
    gbs = 2 * n * 4 / (ms * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return {"peer": "torch copy_", "bytes": 2 * n * 4, "us": ms * 1e3, "GB_s": gbs}


def fla_decode(batch, heads, dk=128, dv=128):
    from fla.ops.kda import fused_recurrent_kda

    dev = "cuda"
    q = torch.randn(batch, 1, heads, dk, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, 1, heads, dk, device=dev, dtype=torch.bfloat16)
    v = torch.randn(batch, 1, heads, dv, device=dev, dtype=torch.bfloat16)
    g = torch.randn(batch, 1, heads, dk, device=dev, dtype=torch.bfloat16)
    beta = torch.randn(batch, 1, heads, device=dev, dtype=torch.bfloat16)
    a_log = torch.randn(heads, device=dev, dtype=torch.float32) * 0.1
    dt_bias = torch.randn(heads * dk, device=dev, dtype=torch.float32) * 0.1
    state = torch.randn(batch, heads, dk, dv, device=dev, dtype=torch.float32) * 0.1

    def step():
        fused_recurrent_kda(
            q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, inplace_final_state=True,
        )

    ms = median_ms(step)
    state_bytes = 2 * batch * heads * dk * dv * 4  # read once, written once
    return {"peer": "fla fused_recurrent_kda", "batch": batch, "heads": heads, "us": ms * 1e3,
            "state_bytes": state_bytes, "GB_s": state_bytes / (ms * 1e-3) / 1e9}


def fla_prefill(tokens, heads=12, dk=128, dv=128, dtype=torch.bfloat16, kernels=False):
    from fla.ops.kda import chunk_kda

    dev = "cuda"
    q = torch.randn(1, tokens, heads, dk, device=dev, dtype=dtype)
    k = torch.randn(1, tokens, heads, dk, device=dev, dtype=dtype)
    v = torch.randn(1, tokens, heads, dv, device=dev, dtype=dtype)
    g = torch.randn(1, tokens, heads, dk, device=dev, dtype=dtype)
    beta = torch.randn(1, tokens, heads, device=dev, dtype=dtype)
    a_log = torch.randn(heads, device=dev, dtype=torch.float32) * 0.1
    dt_bias = torch.randn(heads * dk, device=dev, dtype=torch.float32) * 0.1

    def run():
        chunk_kda(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True)

    if kernels:
        return fla_kernels(run, tokens, dtype)
    ms = median_ms(run, reps=20, graph=False)
    return {"peer": "fla chunk_kda", "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "heads": heads,
            "us": ms * 1e3, "tokens_per_s": tokens / (ms * 1e-3)}


def fla_kernels(run, tokens, dtype, reps=10):
    """Each device kernel of one chunk_kda call: its mean time over `reps` calls
    (torch.profiler's CUDA activity), so that FLA's phases can be set beside
    handoff's (kda_chunk_prep / _state / _out under ncu)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = e.device_time_total / reps
        if us > 0:
            rows.append({"kernel": e.key[:90], "us_per_call": round(us, 1), "launches_per_call": e.count / reps})
    rows.sort(key=lambda r: -r["us_per_call"])
    return {"peer": "fla chunk_kda kernels", "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
            "sum_us": round(sum(r["us_per_call"] for r in rows), 1), "kernels": rows}


def main():
    torch.manual_seed(0)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__}), flush=True)
    if "--kernels" in sys.argv[1:]:
        for tokens in [8192, 32768]:
            print(json.dumps(fla_prefill(tokens, kernels=True)), flush=True)
        return
    print(json.dumps(copy_bandwidth()), flush=True)
    for batch, heads in [(88, 12), (32, 96), (88, 96)]:
        try:
            print(json.dumps(fla_decode(batch, heads)), flush=True)
        except Exception as e:  # report, do not hide: the row says why it is missing
            print(json.dumps({"peer": "fla fused_recurrent_kda", "batch": batch, "heads": heads, "error": repr(e)}), flush=True)
    for dtype in [torch.bfloat16, torch.float32]:
        for tokens in [8192, 32768]:
            try:
                print(json.dumps(fla_prefill(tokens, dtype=dtype)), flush=True)
            except Exception as e:
                print(json.dumps({"peer": "fla chunk_kda", "dtype": str(dtype), "tokens": tokens, "error": repr(e)}), flush=True)


if __name__ == "__main__":
    main()
