"""Weight-sync tolerance per engine precision: the canary statistic of a correct push (precision
noise) against realistic sync faults, on a real model (docs/rollout.md, "Sync tolerance").

usage: python benchmarks/sync_tolerance.py [--model smollm2-135m-instruct] [--dtypes bf16,fp32]
           [--sets 4] [--layers 0,15,29] [--stale 1,5,20] [--lr 1e-5] [--threads 2] [--json out.json]

Canaries: `--sets` disjoint sets of 8 HH-RLHF prompts (the trainers' `make_canary`: last 16
prompt tokens, 16 greedy response tokens at the initial weights). Statistic: `verify_sync`'s
mean over rows of |Δ mean per-token log-prob| (nats), engine = FastEngine at `dtype`, trainer =
the fp32 model (under bf16 autocast for a bf16 engine, as the trainers do). Faults, pushed into
the engine while the trainer keeps the correct weights:
  heads   3 of 9 attention heads of one layer silenced (their o_proj input columns zeroed)
  cols    10% of one layer's down_proj input columns zeroed (every 10th)
  stale   the trainer takes N AdamW steps (causal-LM loss on HH chosen texts, `--batch` sequences x
          tokens, `--lr`, bf16 moments as in production) that never reach the engine
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HH = os.path.join(os.path.dirname(__file__), "..", "data", "hh-rlhf", "harmless-base-1800.jsonl.gz")


def _hh_texts(n: int) -> list[str]:
    with gzip.open(HH, "rt") as f:
        return [json.loads(line)["chosen"] for _, line in zip(range(n), f)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--layers", default="0,15,29")
    ap.add_argument("--stale", default="1,5,20")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--batch", default="4x64", help="training batch of the stale trainer: sequences x tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from turborlhf.config import OptimCfg
    from turborlhf.data.loaders import load_prompts
    from turborlhf.data.tokenize import encode_prompt
    from turborlhf.engine.train import make_optimizer
    from turborlhf.models.load import load_tokenizer
    from turborlhf.models.zoo import resolve_model_path
    from turborlhf.rollout import make_engine
    from turborlhf.rollout.sync import make_canary, verify_sync

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    path = resolve_model_path(a.model) if not os.path.isdir(a.model) else a.model
    tok = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    cfg = model.config
    layers = [int(x) for x in a.layers.split(",")]
    prompts = [encode_prompt(tok, p, 256) for p in load_prompts(HH, tok)[: 8 * a.sets]]
    clean = {n: p.detach().clone() for n, p in model.named_parameters()}

    # trainer copies a few AdamW steps ahead (stale engine)
    bs, seq = (int(x) for x in a.batch.split("x"))
    texts = _hh_texts(bs * max(int(x) for x in a.stale.split(",")))
    stale_models = {}
    trained = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    trained.train()
    opt = make_optimizer(trained, OptimCfg(lr=a.lr))
    done = 0
    for n_steps in sorted(int(x) for x in a.stale.split(",")):
        while done < n_steps:
            batch = tok(texts[bs * done: bs * done + bs], return_tensors="pt", padding="max_length", truncation=True,
                        max_length=seq)
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            trained(**batch, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(trained.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            done += 1
            print(f"[train] step {done}", flush=True)
        stale_models[n_steps] = {n: p.detach().clone() for n, p in trained.named_parameters()}
    del trained, opt

    hd = cfg.hidden_size // cfg.num_attention_heads
    faults = {}
    for L in layers:
        o = f"model.layers.{L}.self_attn.o_proj.weight"
        w = clean[o].clone()
        w[:, : 3 * hd] = 0
        faults[f"heads 3/{cfg.num_attention_heads} silenced, layer {L}"] = ("engine", {o: w})
        d = f"model.layers.{L}.mlp.down_proj.weight"
        w = clean[d].clone()
        w[:, ::10] = 0
        faults[f"down_proj 10% columns zeroed, layer {L}"] = ("engine", {d: w})
    for n_steps, sd in stale_models.items():
        faults[f"stale: {n_steps} AdamW steps (lr {a.lr:g}) not pushed"] = ("trainer", sd)

    results = {}
    for dtype in a.dtypes.split(","):
        eng = make_engine("fast", model, dtype=dtype)
        canaries = [make_canary(eng, prompts[8 * k: 8 * k + 8]) for k in range(a.sets)]
        res = {"noise": [verify_sync(eng, model, c, tol=1e9).mean_diff for c in canaries]}
        for name, (side, tensors) in faults.items():
            vals = []
            for c in canaries:
                if side == "engine":
                    eng.load_weights(tensors.items())
                    vals.append(verify_sync(eng, model, c, tol=1e9).mean_diff)
                    eng.load_weights((n, clean[n]) for n in tensors)
                else:
                    with torch.no_grad():
                        for n, p in model.named_parameters():
                            p.copy_(tensors[n])
                    vals.append(verify_sync(eng, model, c, tol=1e9).mean_diff)
                    with torch.no_grad():
                        for n, p in model.named_parameters():
                            p.copy_(clean[n])
            res[name] = vals
        results[dtype] = res
        print(f"\n== FastEngine {dtype}: mean over rows of |Δ mean log-prob| (nats), {a.sets} canary sets of 8 rows")
        for name, vals in res.items():
            print(f"  {name:<48} min {min(vals):.4f}  mean {statistics.mean(vals):.4f}  max {max(vals):.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
