"""Training efficiency: achieved matmul GFLOP/s of real SFT steps as a fraction of the host's
matmul peak at the same precision (the peak of benchmarks/hw_peak.py, measured in this process).

FLOPs of a step are the model FLOPs of its linears: 6 × (non-embedding parameters) per token
(forward 2, backward 4) plus 6 × hidden × vocabulary per scored (response) token for the LM head,
which turborlhf applies to the response positions only. Attention scores and element-wise ops
are left out, so the fraction is conservative.

usage: PYTHONPATH=src python benchmarks/train_efficiency.py [--dtype auto|bf16|fp32] [--steps 4]
           [--seqs 16] [--micro 4] [--threads 2] [--model smollm2-135m-instruct]
Prints a line per step and one JSON object last: ``{"dtype", "peak_gflops", "steps": [...],
"achieved_gflops", "fraction"}``.
"""
import argparse
import json
import os
import sys
import time

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "data", "hh-rlhf",
                                                   "harmless-base-1800.jsonl.gz"))
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps (after one warm-up step)")
    ap.add_argument("--seqs", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--micro", type=int, default=4, help="sequences per forward/backward")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch

    from turborlhf.config import OptimCfg, SFTConfig, load_config
    from turborlhf.data.loaders import load_pairs
    from turborlhf.engine.hardware import compute_dtype, host_summary
    from turborlhf.engine.malloc import keep_freed_memory
    from turborlhf.engine.train import clip_and_step, make_optimizer, set_threads
    from turborlhf.models.load import load_tokenizer, load_trainable
    from turborlhf.trainers.sft import encode_examples, sft_step

    set_threads(a.threads)
    keep_freed_memory()             # as every training command does: freed activations stay in the heap
    dtype = compute_dtype(a.dtype, "cpu")
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32

    def peak(n: int = 2048, iters: int = 6) -> float:
        x, y = torch.randn(n, n, dtype=tdt), torch.randn(n, n, dtype=tdt)
        for _ in range(2):
            x @ y
        best = min((lambda t0: (x @ y, time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(iters))
        return 2 * n ** 3 / best / 1e9

    cfg = load_config(SFTConfig, overrides=["data.train_file=x", f"model.name_or_path={a.model}",
                                            f"model.dtype={dtype}", "model.device=cpu"])
    tok = load_tokenizer(a.model)
    model = load_trainable("causal", cfg.model, tok)
    opt = make_optimizer(model, OptimCfg(lr=1e-6, state_dtype=dtype))
    rows = load_pairs(a.data, tok)
    enc = encode_examples(tok, [{"prompt": r["prompt"], "response": r["chosen"]} for r in rows], a.max_len)
    E = model.get_input_embeddings().weight
    n_body = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    H, V = E.shape[1], E.shape[0]
    pk = max(peak(), peak())
    out = []
    for step in range(a.steps + 1):
        batch = enc[step * a.seqs:(step + 1) * a.seqs]
        tokens = sum(len(e["input_ids"]) for e in batch)
        scored = sum(sum(e["loss_mask"]) for e in batch)
        t0 = time.perf_counter()
        sft_step(model, tok, batch, a.micro, dtype)
        clip_and_step(model, opt, None, 1.0)
        dt = time.perf_counter() - t0
        gflop = (6 * n_body * tokens + 6 * H * V * scored) / 1e9
        if step:
            out.append({"s": dt, "tokens": tokens, "gflop": gflop, "gflops": gflop / dt})
            print(f"step {step}: {dt:.2f} s, {tokens} tokens, {gflop / dt:.1f} GFLOP/s "
                  f"({gflop / dt / pk:.0%} of the {dtype} peak {pk:.0f})", file=sys.stderr, flush=True)
    ach = sum(r["gflop"] for r in out) / sum(r["s"] for r in out)
    print(json.dumps({"dtype": dtype, "peak_gflops": pk, "steps": out, "achieved_gflops": ach,
                      "fraction": ach / pk, "host": host_summary(), "threads": a.threads}))
