"""TRL GRPOTrainer (current trl) on CPU, at the harness's precision (--dtype), timed per optimizer step.

Adapted from shared/peers/trl_grpo.py: 2 prompts x 4 completions per step (per_device_train_batch_size
8, num_generations 4), `--new-tokens` completion tokens, TRL's defaults otherwise (beta 0: no
reference model; loss_type dapo; group-scaled rewards; one generation per step), the toy reward of
toy_reward.py. Prompts (first HH user turn as a chat message) come from the harness's file. With
`--force-length` EOS is suppressed until `--new-tokens` (generation_kwargs min_new_tokens), so every
completion has exactly that many tokens on both sides; gradient checkpointing (TRL's default) is
off unless `--gradient-checkpointing`.

usage: PYTHONPATH=<trl folder> python trl_grpo.py --model DIR --data prompts.jsonl --steps N --out DIR
"""
import time

import _common as C

p = C.base_parser(__doc__)
p.add_argument("--prompts", type=int, default=2, help="prompts per step")
p.add_argument("--group", type=int, default=4, help="completions per prompt")
p.add_argument("--new-tokens", type=int, default=48)
p.add_argument("--lr", type=float, default=1e-6)
p.add_argument("--force-length", action="store_true")
a = p.parse_args()
C.setup_threads(a.threads)

import datasets  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from toy_reward import trl_reward  # noqa: E402

tok = AutoTokenizer.from_pretrained(a.model)
tok.padding_side = "left"
rows = C.read_jsonl(a.data)
ds = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
timer = C.step_timer()
gen_kwargs = {"min_new_tokens": a.new_tokens} if a.force_length else None
cfg = trl.GRPOConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.prompts * a.group,
                     num_generations=a.group, max_completion_length=a.new_tokens, learning_rate=a.lr, logging_steps=1,
                     save_strategy="no", report_to="none", use_cpu=True, bf16=C.resolve_dtype(a.dtype) == "bf16", seed=a.seed, disable_tqdm=True,
                     gradient_checkpointing=a.gradient_checkpointing, generation_kwargs=gen_kwargs)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
t0 = time.perf_counter()
trainer = trl.GRPOTrainer(model=model, reward_funcs=trl_reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[timer])
t_init = time.perf_counter() - t0
t0 = time.perf_counter()
trainer.train()
lens = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
C.emit({"step_times": timer.times, "response_length": lens, "init_s": t_init, "train_s": time.perf_counter() - t0,
        "samples_per_step": a.prompts * a.group, "versions": C.versions()})
