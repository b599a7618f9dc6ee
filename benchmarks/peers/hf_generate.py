"""HF `generate` throughput (the peer of `turborlhf bench generate`): bf16 weights (`--dtype`: auto
picks fp32 on CPUs without native bf16), sampling.

Adapted from shared/peers/hf_generate.py: the prompts are the harness's (first HH user turn, chat
template, the first B of them for batch size B, left-padded, last `--max-prompt-len` tokens);
exactly `--new` sampled tokens per row (min_new_tokens = max_new_tokens), temperature 1, top-p 1
and top-k off (HF's default top-k 50 is switched off so both sides sample the same distribution);
dynamic KV cache (HF's default). Per batch size: `--warmup` untimed calls, then `--calls` timed
whole calls (tokenisation outside the timer).

usage: python hf_generate.py --model DIR --data prompts.jsonl --batch-sizes 1,8,32 [--new 64]
"""
import time

import _common as C


def parser(description):
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=96)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="weights and compute; auto: bf16 where the CPU has AVX-512-BF16/AMX, else fp32")
    return p


if __name__ == "__main__":
    a = parser(__doc__).parse_args()
    C.setup_threads(a.threads)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    dtype = C.resolve_dtype(a.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
    rows = C.read_jsonl(a.data)
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    ids = [tok(t, add_special_tokens=False)["input_ids"][-a.max_prompt_len:] for t in texts]
    kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
              use_cache=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    res = {"tokens_per_s": {}, "s_per_call": {}, "prompt_tokens": {}, "dtype": dtype}
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        if bs > len(ids):
            raise SystemExit(f"batch size {bs} needs {bs} prompts; {a.data} has {len(ids)}")
        enc = tok.pad({"input_ids": ids[:bs]}, return_tensors="pt")
        res["prompt_tokens"][str(bs)] = sum(len(x) for x in ids[:bs])
        tps, spc = [], []
        with torch.inference_mode():
            for i in range(a.warmup + a.calls):
                t = time.perf_counter()
                out = model.generate(**enc, **kw)
                dt = time.perf_counter() - t
                n = int((out.shape[1] - enc["input_ids"].shape[1]) * bs)
                if i >= a.warmup:
                    tps.append(n / dt)
                    spc.append(dt)
                print(f"[peer] bs={bs} call {i + 1}: {dt:.2f} s, {n / dt:.1f} tok/s"
                      + (" (warm-up)" if i < a.warmup else ""), flush=True)
        res["tokens_per_s"][str(bs)], res["s_per_call"][str(bs)] = tps, spc
    res["versions"] = C.versions()
    C.emit(res)
