"""The issue's reference reward-model loop, run on our split: held-out accuracy per step.

Issue 2 quotes "a plain PyTorch loop" on this machine: 0.63 held-out accuracy after 50 steps of
8 pairs at 384 tokens, 0.66 after 100, 0.67 after 150, at about 5.6 s/step and 16.8 GiB, measured
on pairs we do not have. This script is such a loop (no trainer library): fp32
``AutoModelForSequenceClassification`` (fresh scalar head, score at the last non-padding token),
``torch.optim.AdamW`` at a constant ``--lr``, 8 pairs per step in one forward of 16 sequences,
tokenizer truncation at ``--max-len``, Bradley-Terry loss ``-log σ(r_c - r_r)``. It trains on
the pair-format file `prepare-data` wrote and evaluates on the held-out one, so its accuracies
compare with `turborlhf rm` / `turborlhf eval-rm` on the very same pairs.

    python benchmarks/peers/plain_rm.py --model ~/.cache/turborlhf/models/smollm2-135m-instruct \
        --train runs/full/data/train_pairs.jsonl --test runs/full/data/test_pairs.jsonl --steps 150

Prints one line per step (loss, seconds) and per evaluation, and ends with
``BENCH_RESULT {json}``: ``eval`` ({step: {accuracy, loss, n, accuracy_chosen_shorter,
accuracy_chosen_not_shorter}}, the strata as in `turborlhf eval-rm`), ``step_times``, ``peak_rss_gib``.
"""
import argparse
import json
import random
import resource
import time

import _common as C

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", required=True, help="local Hugging Face model directory")
p.add_argument("--steps", type=int, default=150, help="optimizer steps")
p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
p.add_argument("--seed", type=int, default=0, help="data order and head initialisation")
p.add_argument("--train", required=True, help="pair-format JSONL ({prompt, chosen, rejected}) to train on")
p.add_argument("--test", required=True, help="pair-format JSONL of held-out pairs")
p.add_argument("--pairs", type=int, default=8, help="pairs per optimizer step")
p.add_argument("--max-len", type=int, default=384, help="training tokens per sequence (right truncation)")
p.add_argument("--eval-max-len", type=int, default=1024, help="tokens per sequence at evaluation "
                                                              "(`turborlhf eval-rm`'s default)")
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights (TRL's bf16=True); "
                                                   "fp32 takes ~30 s/step here")
p.add_argument("--eval-every", type=int, default=50)
a = p.parse_args()
C.setup_threads(a.threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

from turborlhf.evaluate import length_strata  # noqa: E402  (runs in the project's environment)

torch.manual_seed(a.seed)
tok = AutoTokenizer.from_pretrained(a.model)
tok.padding_side = "right"
model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, torch_dtype=torch.float32)
model.config.pad_token_id = tok.pad_token_id
train = C.read_jsonl(a.train)
test = C.read_jsonl(a.test)
random.Random(a.seed).shuffle(train)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)


def scores(pairs: list[dict], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_B, rejected_B) scores of B pairs in one forward of 2B sequences."""
    texts = [r["prompt"] + r[k] + tok.eos_token for k in ("chosen", "rejected") for r in pairs]
    enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_len,
              add_special_tokens=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
        s = model(**enc).logits.squeeze(-1).float()
    return s[:len(pairs)], s[len(pairs):]


@torch.no_grad()
def evaluate() -> dict:
    model.eval()
    ch, rj = [], []
    for i in range(0, len(test), 4):
        c, r = scores(test[i:i + 4], a.eval_max_len)
        ch.append(c)
        rj.append(r)
    model.train()
    c, r = torch.cat(ch), torch.cat(rj)
    correct = (c > r).tolist()
    strata = length_strata(test, correct)   # the very strata `turborlhf eval-rm` reports
    return {"accuracy": sum(correct) / len(test), "loss": float(-F.logsigmoid(c - r).mean()), "n": len(test),
            "accuracy_chosen_shorter": strata["accuracy_chosen_shorter"],
            "accuracy_chosen_not_shorter": strata["accuracy_chosen_not_shorter"]}


model.train()
times, evals = [], {}
for step in range(a.steps):
    batch = [train[(step * a.pairs + j) % len(train)] for j in range(a.pairs)]
    t0 = time.perf_counter()
    c, r = scores(batch, a.max_len)
    loss = -F.logsigmoid(c - r).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
    print(f"step {step + 1} loss {loss.item():.4f} {times[-1]:.2f} s", flush=True)
    if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
        evals[step + 1] = evaluate()
        print(f"eval step {step + 1}: {json.dumps(evals[step + 1])}", flush=True)

rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(C.RESULT_TAG + json.dumps({"eval": evals, "step_times": times, "peak_rss_gib": rss, **C.versions()}))
