"""The machine's physical limits for the roofline of `turborlhf bench generate` (from
shared/peers/hw_peak.py): bf16 and fp32 matmul GFLOP/s (n x n @ n x n, best of `--iters` after 3 warm-ups)
and memory bandwidth over a 1 GiB fp32 tensor (read: `sum`; copy: read + write), best of `--iters`,
at `--threads`. The roofline uses the read figure (decoding reads weights). `--dtypes auto` (the
default) measures bf16 only where the CPU computes it natively (AVX-512-BF16 or AMX, as
`turborlhf.engine.hardware` decides), else fp32 alone (`bf16_gflops` null): emulated bf16 runs at
~1 GFLOP/s, and measuring it would take many minutes for a precision no run there uses.

usage: python benchmarks/hw_peak.py [--threads 2] [--n 2048] [--iters 10] [--dtypes auto|bf16,fp32|fp32]
"""
import argparse
import json
import time

RESULT_TAG = "BENCH_RESULT "

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--dtypes", default="auto",
                    help="matmul precisions to measure (bf16, fp32), or auto: bf16 only where it is native")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)

    def matmul_gflops(dtype) -> float:
        x = torch.randn(a.n, a.n, dtype=dtype)
        y = torch.randn(a.n, a.n, dtype=dtype)
        for _ in range(3):
            x @ y
        best = float("inf")
        for _ in range(a.iters):
            t = time.perf_counter()
            x @ y
            best = min(best, time.perf_counter() - t)
        return 2 * a.n ** 3 / best / 1e9

    if a.dtypes == "auto":
        import os
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
        from turborlhf.engine.hardware import compute_dtype

        a.dtypes = "bf16,fp32" if compute_dtype("auto", "cpu") == "bf16" else "fp32"
    dtypes = set(a.dtypes.split(","))
    if not dtypes <= {"bf16", "fp32"}:
        raise SystemExit(f"--dtypes: expected bf16 and/or fp32, got {a.dtypes!r}")
    gflops = matmul_gflops(torch.bfloat16) if "bf16" in dtypes else None
    fp32_gflops = matmul_gflops(torch.float32) if "fp32" in dtypes else None
    buf = torch.ones(a.mib * 2 ** 20 // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(a.iters):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    read_gbs = buf.numel() * 4 / best / 1e9
    dst = torch.empty_like(buf)
    dst.copy_(buf)
    best = float("inf")
    for _ in range(a.iters):
        t = time.perf_counter()
        dst.copy_(buf)
        best = min(best, time.perf_counter() - t)
    copy_gbs = 2 * buf.numel() * 4 / best / 1e9   # read + write
    def fmt(g):
        return "-" if g is None else f"{g:.0f}"

    print(f"matmul {a.n}: bf16 {fmt(gflops)}, fp32 {fmt(fp32_gflops)} GFLOP/s; memory read {read_gbs:.1f} GB/s, copy (read+write) "
          f"{copy_gbs:.1f} GB/s ({a.threads} threads)", flush=True)
    print(RESULT_TAG + json.dumps({"bf16_gflops": gflops, "fp32_gflops": fp32_gflops, "read_gb_s": read_gbs, "copy_gb_s": copy_gbs,
                                   "threads": a.threads}), flush=True)
