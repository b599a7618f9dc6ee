"""Shared prompts in the GRPO trainer's forwards: groups of G responses to real GSM8K prompts (the
first `--groups` training problems as `prepare-data gsm8k` writes them, in the chat template), scored by the actor the way `turborlhf
ppo` scores them (micro-batches of `--micro` rows), with and without ``share_prompts``
(`turborlhf.models.forward.shared_prompt_hidden_states`).

Measures, at the host's training precision (``auto``), the median of `--reps` timed calls after a
warm-up call:
- ``experience``: one no-grad log-prob forward (the actor's old log-probs; the reference's is the same);
- ``update``: forward + backward of the same rows (one micro-batch of the update).
Response lengths are drawn (seeded) from a range like the GSM8K demo's rollouts, and the
response tokens are random ids (the cost does not depend on them).

usage: PYTHONPATH=src python benchmarks/shared_prompts.py [--group 8] [--groups 4] [--micro 8] [--reps 3]
           [--min-response 40] [--max-response 200] [--threads 2] [--dtype auto]
Prints one JSON object: the host, tokens with and without sharing, and seconds and ratios per pass.
"""
import argparse
import gzip
import json
import os
import statistics
import time

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "data", "gsm8k", "train.jsonl.gz"))
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (G)")
    ap.add_argument("--groups", type=int, default=4, help="prompts (rows = groups × G)")
    ap.add_argument("--micro", type=int, default=8, help="rows per forward (train.micro_batch_size)")
    ap.add_argument("--min-response", type=int, default=40)
    ap.add_argument("--max-response", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    a = ap.parse_args()
    import torch

    from turborlhf.config import SFTConfig, load_config
    from turborlhf.data.gsm8k import gsm8k_messages
    from turborlhf.data.tokenize import assemble_prompt_response
    from turborlhf.engine.hardware import compute_dtype, host_summary
    from turborlhf.engine.train import autocast, set_threads
    from turborlhf.models.forward import response_logprobs
    from turborlhf.models.load import load_tokenizer, load_trainable

    set_threads(a.threads)
    dtype = compute_dtype(a.dtype, "cpu")
    cfg = load_config(SFTConfig, overrides=["data.train_file=x", f"model.name_or_path={a.model}",
                                            f"model.dtype={dtype}", "model.device=cpu"])
    tok = load_tokenizer(a.model)
    model = load_trainable("causal", cfg.model, tok)
    g = torch.Generator().manual_seed(0)
    with gzip.open(a.data, "rt") as f:
        questions = [json.loads(next(f))["question"] for _ in range(a.groups)]
    prompts, responses = [], []
    for q in questions:
        p = tok.apply_chat_template(gsm8k_messages(q), add_generation_prompt=True, tokenize=False)
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        for _ in range(a.group):
            n = int(torch.randint(a.min_response, a.max_response + 1, (1,), generator=g))
            prompts.append(p_ids)
            responses.append(torch.randint(100, 40000, (n,), generator=g).tolist())
    ids, attn, P, mask = assemble_prompt_response(prompts, responses, tok.pad_token_id)
    target = torch.cat([torch.zeros(ids.shape[0], P), mask], dim=1)

    def run(share: bool, grad: bool) -> float:
        t0 = time.perf_counter()
        for s in range(0, ids.shape[0], a.micro):
            rows = slice(s, s + a.micro)
            with torch.set_grad_enabled(grad), autocast(dtype):
                lp, _ = response_logprobs(model, ids[rows], attn[rows], target[rows], with_entropy=grad,
                                          share_prompts=share)
            if grad:
                lp.sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    out = {"host": host_summary(), "dtype": dtype, "group": a.group, "groups": a.groups,
           "prompt_tokens": [len(p) for p in prompts[::a.group]], "response_tokens": int(mask.sum()),
           "row_tokens": int(attn.sum()),
           "shared_tokens": int(attn.sum()) - sum((a.group - 1) * len(p) for p in prompts[::a.group])}
    for name, grad in (("experience", False), ("update", True)):
        res = {}
        for share in (False, True):
            run(share, grad)
            res["shared" if share else "rows"] = statistics.median(run(share, grad) for _ in range(a.reps))
        out[name] = {k: round(v, 3) for k, v in res.items()} | {"speedup": round(res["rows"] / res["shared"], 2)}
    print(json.dumps(out))
