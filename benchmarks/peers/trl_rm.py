"""TRL RewardTrainer (current trl) on CPU, at the harness's precision (--dtype): SmolLM2 + a fresh scalar head, timed per step.

Adapted from shared/peers/trl_rm.py: the pairs come from the harness's file (the same file
`turborlhf rm` reads); TRL gets ``chosen = prompt + chosen`` and ``rejected = prompt + rejected``
(implicit prompt, plain text). Gradient checkpointing (TRL's default) is off unless
``--gradient-checkpointing``, to match turborlhf's default.

usage: PYTHONPATH=<trl folder> python trl_rm.py --model DIR --data pairs.jsonl --steps N --out DIR
"""
import time

import _common as C

p = C.base_parser(__doc__)
p.add_argument("--batch", type=int, default=8, help="pairs per optimizer step")
p.add_argument("--max-length", type=int, default=384)
p.add_argument("--lr", type=float, default=1e-5)
a = p.parse_args()
C.setup_threads(a.threads)

import datasets  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

tok = AutoTokenizer.from_pretrained(a.model)
model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32)
model.config.pad_token_id = tok.pad_token_id
rows = C.read_jsonl(a.data)
ds = datasets.Dataset.from_list([{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                                 for r in rows])
timer = C.step_timer()
cfg = trl.RewardConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.batch, learning_rate=a.lr,
                       max_length=a.max_length, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                       bf16=C.resolve_dtype(a.dtype) == "bf16", seed=a.seed, disable_tqdm=True, dataloader_num_workers=0,
                       gradient_checkpointing=a.gradient_checkpointing)
t0 = time.perf_counter()
trainer = trl.RewardTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[timer])
t_init = time.perf_counter() - t0
t0 = time.perf_counter()
trainer.train()
C.emit({"step_times": timer.times, "init_s": t_init, "train_s": time.perf_counter() - t0,
        "samples_per_step": a.batch, "versions": C.versions()})
