"""turborlhf's rollout engine (`make_engine("fast", ...)`, as the trainers build it) throughput: the
"ours" side of `turborlhf bench generate`. Same prompts, token counts, sampling and timing as
peers/hf_generate.py (whose options it shares); prompts go in as unpadded token ids.

Also reports the model's parameter count and the engine's weight storage, from which the harness
derives the roofline (2 FLOP per parameter per generated token; weights of 2 (bf16) or 4 (fp32)
bytes per parameter). `--dtype auto` (default) is what the trainers' `rollout.dtype: auto` chooses:
bf16 where the CPU has native bf16, else fp32, as on the HF side, except that FastEngine computes
in fp32 on bf16 weights where its decode probe measures that faster than its bf16 arithmetic
(`turborlhf.rollout.backends.choose_rollout_dtype`); `--weight-dtype auto` (default) then stores the
weights in bf16 where FastEngine computes in fp32 with its kernel linears, as the trainers'
`rollout.weight_dtype: auto` does.

usage: PYTHONPATH=src python benchmarks/ours_generate.py --model DIR --data prompts.jsonl --batch-sizes 1,8,32
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import _common as C  # noqa: E402
from hf_generate import parser  # noqa: E402

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--engine", default="fast", help="turborlhf rollout engine kind (fast | hf | auto)")
    p.add_argument("--weight-dtype", default="auto",
                   help="the engine's weight storage, as rollout.weight_dtype (auto | bf16 | same; auto: bf16 where "
                        "FastEngine computes in fp32 with its kernel linears, as the trainers choose)")
    a = p.parse_args()
    C.setup_threads(a.threads)
    import torch

    from turborlhf.models.load import load_causal_lm, load_tokenizer
    from turborlhf.rollout import SamplingParams, make_engine
    from turborlhf.rollout.backends import choose_rollout_dtype, choose_weight_dtype

    tok = load_tokenizer(a.model)
    model = load_causal_lm(a.model, tok)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    t0 = time.perf_counter()
    dtype = C.resolve_dtype(a.dtype)
    dtype = choose_rollout_dtype(dtype, "", a.dtype, a.engine, "cpu", a.weight_dtype)[0]
    weight_dtype = choose_weight_dtype(a.weight_dtype, dtype, a.engine, "cpu")[0]
    eng = make_engine(a.engine, model, dtype=dtype, weight_dtype=weight_dtype,
                      max_batch_size=max(int(x) for x in a.batch_sizes.split(",")))
    t_build = time.perf_counter() - t0
    del model
    rows = C.read_jsonl(a.data)
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    ids = [tok(t, add_special_tokens=False)["input_ids"][-a.max_prompt_len:] for t in texts]
    res = {"tokens_per_s": {}, "s_per_call": {}, "prompt_tokens": {}, "n_params": n_params,
           "engine": type(eng).__name__, "build_s": t_build, "dtype": dtype,
           "weight_dtype": {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(getattr(eng, "weight_dtype", None), dtype),
           "linear_backend": getattr(eng, "linear_backend", None)}
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        if bs > len(ids):
            raise SystemExit(f"batch size {bs} needs {bs} prompts; {a.data} has {len(ids)}")
        prompts = ids[:bs]
        res["prompt_tokens"][str(bs)] = sum(len(x) for x in prompts)
        tps, spc = [], []
        for i in range(a.warmup + a.calls):
            sp = SamplingParams(max_new_tokens=a.new, min_new_tokens=a.new, temperature=1.0, top_p=1.0, top_k=0,
                                stop_token_ids=(tok.eos_token_id,), seed=a.seed * 1000 + i)
            t = time.perf_counter()
            out = eng.generate(prompts, sp)
            dt = time.perf_counter() - t
            n = sum(len(r) for r in out.response_ids)
            if i >= a.warmup:
                tps.append(n / dt)
                spc.append(dt)
            print(f"[ours] bs={bs} call {i + 1}: {dt:.2f} s, {n / dt:.1f} tok/s"
                  + (" (warm-up)" if i < a.warmup else ""), flush=True)
        res["tokens_per_s"][str(bs)], res["s_per_call"][str(bs)] = tps, spc
    res["versions"] = C.versions()
    C.emit(res)
