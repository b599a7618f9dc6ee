"""TRL PPOTrainer (trl 1.12.0, `trl.experimental.ppo`; 1.13+ removed PPO) on CPU, timed per update.

Adapted from shared/peers/trl_ppo.py. Policy and reference = the model; reward and value model =
`AutoModelForSequenceClassification(num_labels=1)` from the same checkpoint (fresh scalar heads),
as `turborlhf ppo` builds them from `reward_model: <the model>`. One update = generate
`--batch` responses, reference/value/reward forwards, `num_ppo_epochs=1` over one mini-batch.

Adaptations, each to make the work per update identical to ours: prompts come from the harness's
file (first HH user turn, chat template, last `--max-prompt-len` tokens); with
`--force-length` generation suppresses EOS until `--resp-len` tokens (min_new_tokens), so every
response has exactly that many tokens on both sides; gradient checkpointing (TRL's default) is off
unless `--gradient-checkpointing`.

usage: PYTHONPATH=<trl-1.12 folder> python trl_ppo.py --model DIR --data prompts.jsonl --steps N --out DIR
"""
import time

import _common as C

p = C.base_parser(__doc__)
p.add_argument("--batch", type=int, default=8, help="prompts (= responses) per update")
p.add_argument("--resp-len", type=int, default=64)
p.add_argument("--max-prompt-len", type=int, default=96)
p.add_argument("--temperature", type=float, default=0.7, help="TRL PPOConfig default")
p.add_argument("--lr", type=float, default=3e-6)
p.add_argument("--force-length", action="store_true")
a = p.parse_args()
C.setup_threads(a.threads)

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback  # noqa: E402

import trl.experimental.ppo.ppo_trainer as P  # noqa: E402
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: E402

tok = AutoTokenizer.from_pretrained(a.model)
tok.padding_side = "left"
policy = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
ref = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
rm = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32)
vm = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32)
for m in (rm, vm):
    m.config.pad_token_id = tok.pad_token_id
rows = C.read_jsonl(a.data)
prompts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
ds = datasets.Dataset.from_dict(
    {"input_ids": [tok(x, add_special_tokens=False)["input_ids"][-a.max_prompt_len:] for x in prompts]})

# --- per-phase timers (PPOTrainer logs no breakdown itself) ---
T = {"generate": 0.0, "ref_fwd": 0.0, "value_fwd": 0.0, "reward_fwd": 0.0, "train_fwd": 0.0}
resp_lens: list[float] = []


def timed(name_of, fn):
    def w(*args, **kw):
        t = time.perf_counter()
        r = fn(*args, **kw)
        T[name_of(*args)] += time.perf_counter() - t
        return r
    return w


_gen = P.batch_generation


def batch_generation(model, queries, bs, pad_token_id, generation_config):
    if a.force_length:
        generation_config.min_new_tokens = a.resp_len
        generation_config.eos_token_id = tok.eos_token_id
    out = _gen(model, queries, bs, pad_token_id, generation_config)
    resp = out[0][:, queries.shape[1]:]
    is_eos = resp == tok.eos_token_id
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full_like(resp[:, 0], resp.shape[1]))
    resp_lens.append(float(first.float().mean()))
    return out


P.batch_generation = timed(lambda *x: "generate", batch_generation)
P.forward = timed(lambda *x: "train_fwd" if torch.is_grad_enabled() else "ref_fwd", P.forward)
P.get_reward = timed(lambda m, *x: "reward_fwd" if m is rm else "value_fwd", P.get_reward)


class StepTimer(TrainerCallback):
    def __init__(self):
        self.t, self.times, self.phases = None, [], []

    def on_train_begin(self, *x, **k):
        self.t = time.perf_counter()

    def on_step_end(self, *x, **k):
        now = time.perf_counter()
        self.times.append(now - self.t)
        self.t = now
        snap = dict(T)
        for key in T:
            T[key] = 0.0
        snap["backward_optim_other"] = self.times[-1] - sum(snap.values())
        self.phases.append(snap)
        print(f"[peer] update {len(self.times)}: {self.times[-1]:.2f} s = "
              + ", ".join(f"{k} {v:.2f}" for k, v in snap.items()), flush=True)


st = StepTimer()
cfg = PPOConfig(output_dir=a.out, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1, num_mini_batches=1,
                num_ppo_epochs=1, total_episodes=a.steps * a.batch, response_length=a.resp_len,
                local_rollout_forward_batch_size=a.batch, temperature=a.temperature, stop_token="eos",
                missing_eos_penalty=1.0, num_sample_generations=0, learning_rate=a.lr,
                gradient_checkpointing=a.gradient_checkpointing, use_cpu=True, bf16=C.resolve_dtype(a.dtype) == "bf16", report_to="none",
                save_strategy="no", logging_steps=1, seed=a.seed)
t0 = time.perf_counter()
trainer = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=ref, reward_model=rm, value_model=vm,
                     train_dataset=ds, callbacks=[st])
t_init = time.perf_counter() - t0
t0 = time.perf_counter()
trainer.train()
C.emit({"step_times": st.times, "phases": st.phases, "response_length": resp_lens, "init_s": t_init,
        "train_s": time.perf_counter() - t0, "samples_per_step": a.batch, "versions": C.versions()})
