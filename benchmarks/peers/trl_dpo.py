"""TRL DPOTrainer (current trl) on CPU, at the harness's precision (--dtype), timed per optimizer step.

Adapted from shared/peers/trl_dpo.py: the pairs come from the harness's file (HH harmless-base,
``{prompt, chosen, rejected}`` as plain text, the same file `turborlhf dpo` reads); the reference
model is TRL's default (a copy of the policy, run every step); gradient checkpointing (TRL's
default) is off unless ``--gradient-checkpointing``, to match turborlhf's default.

usage: PYTHONPATH=<trl folder> python trl_dpo.py --model DIR --data pairs.jsonl --steps N --out DIR
"""
import time

import _common as C

p = C.base_parser(__doc__)
p.add_argument("--batch", type=int, default=4, help="pairs per optimizer step")
p.add_argument("--max-length", type=int, default=512)
p.add_argument("--lr", type=float, default=5e-6)
p.add_argument("--beta", type=float, default=0.1)
a = p.parse_args()
C.setup_threads(a.threads)

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

tok = AutoTokenizer.from_pretrained(a.model)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
rows = C.read_jsonl(a.data)
ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in rows])
timer = C.step_timer()
cfg = DPOConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
                learning_rate=a.lr, beta=a.beta, max_length=a.max_length, logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=True, bf16=C.resolve_dtype(a.dtype) == "bf16", dataloader_num_workers=0, seed=a.seed, disable_tqdm=True,
                gradient_checkpointing=a.gradient_checkpointing)
t0 = time.perf_counter()
trainer = DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[timer])
t_init = time.perf_counter() - t0
t0 = time.perf_counter()
trainer.train()
C.emit({"step_times": timer.times, "init_s": t_init, "train_s": time.perf_counter() - t0,
        "samples_per_step": a.batch, "versions": C.versions()})
