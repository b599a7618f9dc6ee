"""Rollout throughput probe: FastEngine (eager / compiled) vs HF generate, same process.

usage: python benchmarks/generate_probe.py MODEL_DIR [--threads 2] [--bs 1,8,32] [--new 64]
           [--engines hf,fast,fast-compile] [--repeats 3] [--dedupe]

Same setting as shared/peers/hf_generate.py: SmolLM2 chat-templated questions (8, cycled),
left padding, exactly `--new` sampled tokens (min_new_tokens = max_new_tokens), temperature 1,
bf16. Reports best-of-N whole-call tokens/s after one warm-up call per (engine, batch size).
Prompt deduplication is off by default (the 8 questions repeat, which would flatter prefill).
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
      "Give me three tips for sleeping better.", "What is 17 times 23?", "Name a famous painter.",
      "Why is the sky blue?", "Suggest a name for a cat."]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bs", default="1,8,32")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--engines", default="hf,fast,fast-compile")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--dedupe", action="store_true")
    a = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from turborlhf.rollout import SamplingParams
    from turborlhf.rollout.fast import FastEngine
    from turborlhf.rollout.hf import HFEngine

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    bss = [int(x) for x in a.bs.split(",")]
    sp = SamplingParams(max_new_tokens=a.new, min_new_tokens=a.new, temperature=1.0, seed=0,
                        stop_token_ids=(tok.eos_token_id,))
    warm = SamplingParams(max_new_tokens=a.new, min_new_tokens=a.new, temperature=1.0, seed=1)
    rows = []
    for name in a.engines.split(","):
        t0 = time.perf_counter()
        if name == "hf":
            eng = HFEngine(a.model_dir, dtype=a.dtype)
        else:
            eng = FastEngine(a.model_dir, dtype=a.dtype, compile=name == "fast-compile",
                             dedupe_prompts=a.dedupe, max_batch_size=max(bss))
        print(f"[{name}] built in {time.perf_counter() - t0:.1f} s", flush=True)
        for bs in bss:
            prompts = [tok.apply_chat_template([{"role": "user", "content": QS[i % len(QS)]}],
                                               add_generation_prompt=True, tokenize=True)["input_ids"]
                       for i in range(bs)]
            t0 = time.perf_counter()
            eng.generate(prompts, warm)
            tw = time.perf_counter() - t0
            best, tim = float("inf"), {}
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                out = eng.generate(prompts, sp)
                dt = time.perf_counter() - t0
                if dt < best:
                    best, tim = dt, out.timings
            ntok = sum(len(r) for r in out.response_ids)
            extra = ""
            if "prefill_s" in tim:
                extra = f" prefill {tim['prefill_s']*1e3:.0f} ms, decode {tim['decode_s']/max(tim['steps'],1)*1e3:.1f} ms/step"
            print(f"[{name}] bs={bs:3d} P={max(map(len, prompts))} new={a.new}: {best:6.2f} s "
                  f"{ntok/best:7.1f} tok/s (warm-up {tw:.1f} s){extra}", flush=True)
            rows.append((name, bs, ntok / best))
        del eng
    print("\n| engine | " + " | ".join(f"bs {b}" for b in bss) + " |")
    print("| --- |" + " --- |" * len(bss))
    for name in a.engines.split(","):
        print(f"| {name} | " + " | ".join(f"{r[2]:.1f}" for r in rows if r[0] == name) + " |")


if __name__ == "__main__":
    main()
