"""Rollout speed: FastEngine vs HF `generate`, alternating, in one process (issue 4, part 2).

usage: python benchmarks/rollout_speed.py MODEL_DIR [--bs 1,8,32] [--new 64] [--repeats 3]
           [--threads 2] [--dtype bf16|fp32] [--compile] [--int8 N] [--mkldnn] [--also dense,...]
           [--json out.json]

Setting (same as shared/peers/hf_generate.py): SmolLM2 chat-templated questions (8, cycled), left
padding, exactly `--new` sampled tokens (min_new_tokens = max_new_tokens), temperature 1, `--dtype`
(bf16 by default; both engines use it),
prompt de-duplication off (the 8 questions repeat, which would flatter prefill). Per batch size:
one warm-up call per engine, then `--repeats` rounds of (HF call, FastEngine call); each engine's
best round is reported as whole-call tokens/s (prefill included). The CPU's instruction sets as
this process may use them (`turborlhf.engine.hardware.host_summary`, which honours
ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA) are printed first. Also measured: a weight update
(`load_weights` from the trainer's fp32 model: cast + pack), and with `--compile` the
compiled engine's cold start per (batch, cache) bucket. The 1-minute load average is printed
before and after: on a shared machine, compare ratios from one run, not absolute figures.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
      "Give me three tips for sleeping better.", "What is 17 times 23?", "Name a famous painter.",
      "Why is the sky blue?", "Suggest a name for a cat."]


def _timed(eng, prompts, sp):
    t0 = time.perf_counter()
    out = eng.generate(prompts, sp)
    return time.perf_counter() - t0, sum(len(r) for r in out.response_ids), out.timings


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bs", default="1,8,32")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also run FastEngine(compile=True)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate reference")
    ap.add_argument("--int8", type=int, default=0, help="also run FastEngine(int8_max_batch=N)")
    ap.add_argument("--mkldnn", action="store_true",
                    help="also run FastEngine(linear_backend='mkldnn') (oneDNN linears; 'fast' is the default backend)")
    ap.add_argument("--also", default="",
                    help="comma-separated linear backends to also run as FastEngine(linear_backend=...)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turborlhf.rollout import SamplingParams
    from turborlhf.rollout.fast import FastEngine
    from turborlhf.rollout.hf import HFEngine

    from turborlhf.engine.hardware import host_summary

    torch.set_num_threads(a.threads)
    print(f"host: {host_summary()}", flush=True)
    print(f"load average before: {os.getloadavg()[0]:.2f}; threads {a.threads}", flush=True)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    bss = [int(x) for x in a.bs.split(",")]
    sp = SamplingParams(max_new_tokens=a.new, min_new_tokens=a.new, temperature=1.0, seed=0,
                        stop_token_ids=(tok.eos_token_id,))
    engines = {}
    if not a.no_hf:
        engines["hf"] = HFEngine(a.model_dir, dtype=a.dtype)
    t0 = time.perf_counter()
    engines["fast"] = FastEngine(a.model_dir, dtype=a.dtype, dedupe_prompts=False, max_batch_size=max(bss))
    res = {"build_fast_s": time.perf_counter() - t0, "tok_s": {}, "load_before": os.getloadavg()[0],
           "fast_linear_backend": engines["fast"].linear_backend}
    print(f"FastEngine linear backend: {engines['fast'].linear_backend}", flush=True)
    for be in filter(None, a.also.split(",")):
        engines[f"fast-{be}"] = FastEngine(a.model_dir, dtype=a.dtype, dedupe_prompts=False, max_batch_size=max(bss),
                                           linear_backend=be)
    if a.int8:
        engines["fast-int8"] = FastEngine(a.model_dir, dtype=a.dtype, dedupe_prompts=False, max_batch_size=max(bss),
                                          int8_max_batch=a.int8)
    if a.mkldnn:
        engines["fast-mkldnn"] = FastEngine(a.model_dir, dtype=a.dtype, dedupe_prompts=False, max_batch_size=max(bss),
                                            linear_backend="mkldnn")
    if a.compile:
        engines["fast-compile"] = FastEngine(a.model_dir, dtype=a.dtype, dedupe_prompts=False,
                                             max_batch_size=max(bss), compile=True, compact=False)
    for bs in bss:
        prompts = [tok.apply_chat_template([{"role": "user", "content": QS[i % len(QS)]}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]
                   for i in range(bs)]
        warm = {}
        for name, eng in engines.items():
            warm[name] = _timed(eng, prompts, sp)[0]
        best = {name: (float("inf"), 0, {}) for name in engines}
        for _ in range(a.repeats):
            for name, eng in engines.items():
                r = _timed(eng, prompts, sp)
                if r[0] < best[name][0]:
                    best[name] = r
        for name, (dt, ntok, tim) in best.items():
            extra = ""
            if "prefill_s" in tim:
                extra = (f"  prefill {tim['prefill_s'] * 1e3:.0f} ms, decode "
                         f"{tim['decode_s'] / max(tim['steps'], 1) * 1e3:.1f} ms/step")
            print(f"[{name:12s}] bs={bs:3d}: {ntok / dt:7.1f} tok/s ({dt:.2f} s, warm-up {warm[name]:.1f} s){extra}",
                  flush=True)
            res["tok_s"].setdefault(name, {})[bs] = ntok / dt
    if a.compile:
        res["compile_cold_s"] = {f"{b}x{t}": s for (b, t), s in engines["fast-compile"].compile_seconds.items()}
        print(f"compile cold start per (batch, cache) bucket: {res['compile_cold_s']}", flush=True)
    # weight update: the trainer's fp32 model → engine (copy + cast + re-pack), best of 3
    trainer = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    upd = []
    for _ in range(3):
        t0 = time.perf_counter()
        engines["fast"].load_weights(trainer.named_parameters())
        upd.append((time.perf_counter() - t0, engines["fast"].last_weight_update))
    total, parts = min(upd, key=lambda x: x[0])
    res["weight_update"] = {"total_s": total, **parts}
    print(f"weight update (fp32 trainer → {a.dtype} engine): {total * 1e3:.0f} ms "
          f"(copy {parts['copy_s'] * 1e3:.0f} ms, re-pack {parts['repack_s'] * 1e3:.0f} ms)", flush=True)
    res["load_after"] = os.getloadavg()[0]
    print(f"load average after: {res['load_after']:.2f}")
    print("\n| engine | " + " | ".join(f"bs {b}" for b in bss) + " |")
    print("| --- |" + " --- |" * len(bss))
    for name, row in res["tok_s"].items():
        print(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in bss) + " |")
    if "hf" in res["tok_s"]:
        print("| fast / hf | " + " | ".join(f"{res['tok_s']['fast'][b] / res['tok_s']['hf'][b]:.2f}×"
                                            for b in bss) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
