"""`turborlhf plan --config X`: memory per role and per device, estimated before launch.

The planner reads the same YAML as the trainers, loads only each model's ``config.json`` (the
parameter count comes from building the model on PyTorch's meta device: shapes, no storage) and
adds up, per role:

- weights: fp32 master weights of trained models (4 B/param), fp32 references (they compute as
  the policy does), reward models in the configured dtype (bf16: 2 B/param), QLoRA bases in NF4
  (~0.52 B/param);
- gradients: 4 B per trainable parameter (LoRA: adapters only);
- optimizer states: AdamW exp_avg + exp_avg_sq, 8 B per trainable parameter (4 B with
  ``optim.state_dtype: bf16``, what ``auto`` gives on the CPU), in host memory with
  ``optim.offload`` (plus 4 B fp32 copies of the weights and of the gradients);
- activations of the configured micro-batch at the configured lengths (the worst case: every
  sequence at ``max_len``, every response at ``max_new_tokens``): the bytes autograd saves for
  backward, from `train_activation_bytes` (`turborlhf.models.memory`, with the other per-model
  formulas), whose terms were read off the tensors the model code
  saves (tests compare the formula with the exact saved-tensor bytes of tiny models), plus the
  transient of the LM-head chunk in backward;
- the rollout engine: its own weights (``rollout.dtype``, or bf16 with ``rollout.weight_dtype``
  bf16) and the static KV cache
  ``2·layers·rows·kv_heads·ceil64(prompt+new)·head_dim``.

Roles are then placed on devices: one process for ``distributed.backend: local`` (the default
and the only placement of the non-PPO commands), or one worker per device of each role for
``backend: ray`` with the colocation options (``colocate_actor_ref``, ``colocate_critic_reward``,
``colocate_all_models``, ``ref_reward_offload``, ``rollout_sleep``, ``dp_strategy: fsdp``).
A device's peak is its persistent memory (weights, optimizer states) plus the largest phase
(generation, experience, training of each role, optimizer step) and, on the CPU, the measured
memory of a Python process with torch and transformers imported (`PROCESS_BASELINE`). The phases
and their order are the trainer's own (each trainer module's ``phases(cfg)``); `SPECS` sizes them,
and a trainer phase it does not size is an error, not a silently stale plan.

Accuracy: on this machine's CPU the estimates were compared with the peak RSS of real SmolLM2
runs (docs/memory.md). GPU figures use the same formulas plus `CUDA_CONTEXT` per process and were
not measured (no GPU here).

    turborlhf plan --config configs/hh_smollm2/ppo.yaml
    turborlhf plan --config configs/hh_smollm2/dpo.yaml --json
    turborlhf plan --config X --device-memory 24GiB      # will it fit on a 24 GiB GPU?
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from turborlhf.models.memory import (ModelShape, fused_layers_for, inference_activation_bytes, kv_cache_bytes,
                                     model_shape, shared_prompt_train_bytes, train_activation_bytes)
from turborlhf.models.zoo import ModelFetchError
from turborlhf.command_guess import guess_command
from turborlhf.plan_data import batches_from_data

__all__ = ["ModelShape", "model_shape", "train_activation_bytes", "inference_activation_bytes",
           "kv_cache_bytes", "Role", "Device", "Plan", "plan_config", "main", "PROCESS_BASELINE",
           "CUDA_CONTEXT", "parse_bytes"]

GIB = 2 ** 30
# RSS of `python -m turborlhf <command>` after importing torch, transformers and the trainer and
# loading a tokenizer, before any model: measured on this machine (torch 2.13 CPU, transformers
# 5.23), docs/memory.md. Added once per process.
PROCESS_BASELINE = int(0.40 * GIB)
# glibc malloc keeps freed activation chunks (below its 32 MiB mmap threshold) resident in the heap,
# so peak RSS exceeds the live-tensor peak. Calibrated on one real run (SmolLM2 SFT, 8 × 384 tokens,
# 3 steps: 0.59 of the activation peak); the other runs of docs/memory.md needed 0.44-0.76. The
# heap settles after 2-3 steps (a 25-step RM run peaked 2% above its 3-step peak). CPU devices only.
CPU_ALLOCATOR_RETENTION = 0.60
# CUDA context and kernels per process on a GPU: the commonly reported 0.3-0.6 GiB; not measured here.
CUDA_CONTEXT = int(0.5 * GIB)
# NF4 weight + double-quantised block constants (QLoRA paper: 4.127 bits per parameter).
NF4_BYTES = 4.127 / 8


def _engine_weight_bytes(roll) -> int:
    """Bytes per parameter of the rollout engine's weights: 2 for a bf16 engine or bf16 weight
    storage (`rollout.weight_dtype`, resolved by `resolve_hardware`), else 4."""
    return 2 if roll.dtype == "bf16" or getattr(roll, "weight_dtype", "same") == "bf16" else 4


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"80GB"``, ``"512MiB"``, ``"1e9"`` → bytes. Raises ValueError otherwise."""
    units = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
             "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in units or not num:
        raise ValueError(f"cannot read a memory size from {text!r} (examples: 24GiB, 80GB, 512MiB)")
    return int(float(num) * units[unit])


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


# ----------------------------------------------------------------------------------------------
# Roles, devices, phases
# ----------------------------------------------------------------------------------------------

@dataclass
class Role:
    """Memory of one role (bytes). Persistent: weights, optimizer (device part); per phase:
    gradients (while its backward runs until the optimizer step), activations, KV cache."""

    name: str
    model: str
    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    optimizer_host: int = 0
    step_transient: int = 0          # extra bytes during the optimizer step: torch's AdamW keeps one fp32
                                     # temporary per parameter, the bf16-moment CPU kernel none
    activations: int = 0
    kv_cache: int = 0
    trainable_params: int = 0
    notes: list[str] = field(default_factory=list)
    offloaded: bool = False          # weights live in host memory between uses (ref_reward_offload)
    sleeps: bool = False             # rollout engine frees its weights while training (rollout_sleep)
    reserves: Optional[float] = None  # vLLM: the share of its device it takes whatever it needs


@dataclass
class Device:
    """One device (or the host CPU of a process) and the roles placed on it."""

    name: str
    kind: str                        # cpu | gpu
    capacity: Optional[int]
    roles: list[str]
    processes: int
    persistent: int = 0
    phases: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    peak_phase: str = ""
    allocator: int = 0               # CPU: freed activation memory glibc keeps resident

    @property
    def fits(self) -> Optional[bool]:
        return None if self.capacity is None else self.peak <= self.capacity


@dataclass
class Plan:
    command: str
    roles: list[Role]
    devices: list[Device]
    assumptions: list[str]
    stage: str = ""

    def to_dict(self) -> dict:
        return {"command": self.command, "stage": self.stage, "assumptions": self.assumptions,
                "roles": [asdict(r) for r in self.roles],
                "devices": [{**asdict(d), "fits": d.fits} for d in self.devices]}


def _vllm_reserve(engine: Role, roll, shares_device: bool, engines_per_host: int = 1) -> None:
    """A vLLM engine takes ``gpu_memory_utilization`` of its device up front (weights and a KV pool
    sized to fill it) however small the model: `_assemble` counts that share instead of its
    weights and KV cache (`turborlhf.rollout.backends.vllm_kwargs` chooses it as the run does)."""
    from turborlhf.rollout.backends import vllm_kwargs

    kw = vllm_kwargs(roll, shares_gpu=shares_device, engines_per_host=engines_per_host)
    if kw:
        engine.reserves = kw["llm_kwargs"]["gpu_memory_utilization"]
        engine.notes.append(f"vLLM reserves {engine.reserves:g} of its device (gpu_memory_utilization)")


def _train_role(name: str, shape: ModelShape, model_cfg, optim_cfg, scalar: bool, device_kind: str) -> Role:
    """Weights/grads/optimizer of a trained model under `model_cfg` (LoRA, QLoRA) and `optim_cfg`."""
    total = shape.scalar_params() if scalar else shape.params
    r = model_cfg.lora.rank
    role = Role(name=name, model=shape.name)
    if r > 0:
        lora = r * shape.lora_in_out
        head = 2 * shape.hidden if scalar else 0     # modules_to_save: a trainable copy of `score`
        trainable = lora + head
        if model_cfg.load_in_4bit:
            quant = shape.layer_linear
            role.weights = int(quant * NF4_BYTES) + 4 * (total - quant) + 4 * trainable
            role.notes.append("QLoRA: NF4 base (~0.52 B/param), GPU only")
        else:
            role.weights = 4 * total + 4 * trainable
        role.notes.append(f"LoRA r={r}: {trainable / 1e6:.2f}M trainable of {total / 1e6:.1f}M")
    else:
        n = getattr(model_cfg, "freeze_layers", 0)      # embeddings + the first n layers (their norms too)
        if n >= shape.layers:
            role.notes.append(f"model.freeze_layers={n} is not below this model's {shape.layers} layers: "
                              "the run stops at start-up (planned as if nothing were frozen)")
            n = 0
        frozen = shape.vocab * shape.hidden + n * (shape.layer_linear // shape.layers + 2 * shape.hidden) if n else 0
        trainable = total - frozen
        role.weights = 4 * total
        if n:
            role.notes.append(f"freeze_layers={n}: {trainable / 1e6:.1f}M trainable of {total / 1e6:.1f}M "
                              "(activations still counted for every layer)")
    role.trainable_params = trainable
    role.grads = 4 * trainable
    if getattr(optim_cfg, "offload", False) and device_kind == "gpu":
        role.optimizer_host = 16 * trainable           # moments, fp32 weights and fp32 gradients (CPUOffloadAdamW)
        role.notes.append("optimizer states offloaded to host memory")
    else:
        from turborlhf.engine.hardware import state_dtype_for

        state_dtype = state_dtype_for(getattr(optim_cfg, "state_dtype", "fp32"),     # as make_optimizer does
                                      "cuda" if device_kind == "gpu" else "cpu")
        bf16_states = state_dtype == "bf16"
        role.optimizer = (4 if bf16_states else 8) * trainable
        role.step_transient = 0 if bf16_states and device_kind == "cpu" else 4 * trainable
        if bf16_states:
            role.notes.append("AdamW moments in bf16 (optim.state_dtype)")
        if getattr(optim_cfg, "offload", False):
            role.notes.append("optim.offload: parameters already in CPU memory, no effect")
    return role


def _frozen_role(name: str, shape: ModelShape, dtype: str, scalar: bool) -> Role:
    total = shape.scalar_params() if scalar else shape.params
    return Role(name=name, model=shape.name, weights=(2 if dtype == "bf16" else 4) * total)


# ----------------------------------------------------------------------------------------------
# Per command
# ----------------------------------------------------------------------------------------------

@dataclass
class _Spec:
    """What a command builds: roles and the phases, each phase = {role: transient bytes}."""

    roles: dict[str, Role]
    phases: dict[str, dict[str, int]]
    assumptions: list[str]


def _shape(name: str, lora_cfg, resolver) -> ModelShape:
    return resolver(name, tuple(lora_cfg.target_modules) if lora_cfg is not None else ())


def _sft_like(cfg, shape: ModelShape, kind: str, rows: int, row_len: int, resp: int, tag: str) -> _Spec:
    policy = _train_role(tag, shape, cfg.model, cfg.optim, scalar=False, device_kind=kind)
    act = train_activation_bytes(shape, rows, row_len, resp, cfg.model.dtype, "lm",
                                 gradient_checkpointing=cfg.model.gradient_checkpointing, lora_rank=cfg.model.lora.rank,
                                 fused_layers=fused_layers_for(shape, kind))
    policy.activations = act["peak"]
    return _Spec({tag: policy}, {"train": {tag: policy.grads + act["peak"]},
                                 "optimizer step": {tag: policy.grads + policy.step_transient}}, [])


def _spec_sft(cfg, resolve, kind, data: Optional[dict] = None) -> _Spec:
    loop = cfg.train
    s = _shape(cfg.model.name_or_path, cfg.model.lora, resolve)
    mb = min(loop.micro_batch_size, loop.sequences_per_step)
    rows, L, resp = (data["rows"], data["row_len"], data["resp"]) if data else (mb, cfg.data.max_len,
                                                                                mb * cfg.data.max_len)
    sp = _sft_like(cfg, s, kind, rows, L, resp, "policy")
    sp.assumptions.append(data["note"] if data else f"micro-batch of {mb} sequences × {cfg.data.max_len} tokens, "
                          "every token a response token (worst case)")
    return sp


def _spec_rm(cfg, resolve, kind, data: Optional[dict] = None) -> _Spec:
    loop = cfg.train
    s = _shape(cfg.model.name_or_path, cfg.model.lora, resolve)
    rm = _train_role("reward_model", s, cfg.model, cfg.optim, scalar=True, device_kind=kind)
    mb = min(loop.micro_batch_size, loop.pairs_per_step)
    L = 2 * cfg.data.max_len
    if data:
        mb, L = data["rows"], data["row_len"]
    act = train_activation_bytes(s, mb, L, 0, cfg.model.dtype, "score", packed=True,
                                 gradient_checkpointing=cfg.model.gradient_checkpointing, lora_rank=cfg.model.lora.rank,
                                 fused_layers=fused_layers_for(s, kind))
    rm.activations = act["peak"]
    return _Spec({"reward_model": rm}, {"train": {"reward_model": rm.grads + act["peak"]},
                                        "optimizer step": {"reward_model": rm.grads + rm.step_transient}},
                 [data["note"] if data else f"micro-batch of {mb} pairs packed as rows of ≤ {L} tokens (chosen + "
                  "rejected, prompt shared)"])


def _spec_pref(cfg, resolve, kind, name: str, data: Optional[dict] = None) -> _Spec:
    """DPO (pairs: 2 sequences each) and KTO (single examples + a no-grad z0 pass)."""
    loop = cfg.train
    s = _shape(cfg.model.name_or_path, cfg.model.lora, resolve)
    per_step = loop.pairs_per_step if name == "dpo" else loop.examples_per_step
    mb = min(loop.micro_batch_size, per_step)
    rows = 2 * mb if name == "dpo" else mb
    Lm = cfg.data.max_len
    if data:
        sp = _sft_like(cfg, s, kind, data["rows"], data["row_len"], data["resp"], "policy")
    else:
        sp = _sft_like(cfg, s, kind, rows, Lm, rows * Lm, "policy")
    ref_rows = 4 * loop.micro_batch_size
    infer = inference_activation_bytes(s, ref_rows, Lm, ref_rows * Lm, cfg.model.dtype)
    ref_free = getattr(getattr(cfg, "algo", None), "reference_free", False)
    if not ref_free:
        phase = {"policy": infer}
        from turborlhf.models.reference import same_model

        if cfg.reference is not None and not same_model(cfg.reference, cfg.model.name_or_path):
            ref = _frozen_role("reference", _shape(cfg.reference, None, resolve), "fp32", scalar=False)
            ref.notes.append("loaded for the one-off reference pass, then freed")
            phase["reference"] = ref.weights
            sp.roles["reference"] = Role(name="reference", model=ref.model, notes=ref.notes)
        else:
            sp.roles["policy"].notes.append("the policy computes the reference log-probs itself "
                                            "(adapters disabled with LoRA): no second copy")
        sp.phases = {"reference log-probs (once)": phase, **sp.phases}
    if name == "kto":
        z0_rows = 2 * loop.micro_batch_size
        sp.phases["z0 (no grad)"] = {"policy": inference_activation_bytes(s, z0_rows, Lm, z0_rows * Lm, cfg.model.dtype)}
    sp.assumptions.append((data["note"] + "; " if data else f"training forward of {rows} sequences × {Lm} tokens; ")
                          + f"reference pass in batches of {ref_rows} sequences")
    return sp


def _spec_ppo(cfg, resolve, kind, data: Optional[dict] = None) -> _Spec:
    A, roll, loop = cfg.algo, cfg.rollout, cfg.train
    actor_s = _shape(cfg.actor.name_or_path, cfg.actor.lora, resolve)
    rows = A.prompts_per_step * A.n_samples_per_prompt
    mb = min(loop.micro_batch_size, rows)
    prompt_len = data["prompt_len"] if data else roll.max_prompt_len
    L = prompt_len + roll.max_new_tokens
    roles: dict[str, Role] = {}
    actor = _train_role("actor", actor_s, cfg.actor, cfg.optim, scalar=False, device_kind=kind)
    if A.share_prompts and A.n_samples_per_prompt > 1 and kind == "cpu" and not cfg.actor.gradient_checkpointing:
        # each prompt once per group, the segment attention's own tensors (the CPU training attention)
        act_a = shared_prompt_train_bytes(actor_s, mb, A.n_samples_per_prompt, prompt_len, roll.max_new_tokens,
                                          cfg.actor.dtype, lora_rank=cfg.actor.lora.rank,
                                          fused_layers=fused_layers_for(actor_s, kind))
    else:
        act_a = train_activation_bytes(actor_s, mb, L, mb * roll.max_new_tokens, cfg.actor.dtype, "lm",
                                       gradient_checkpointing=cfg.actor.gradient_checkpointing,
                                       lora_rank=cfg.actor.lora.rank, fused_layers=fused_layers_for(actor_s, kind))
    actor.activations = act_a["peak"]
    roles["actor"] = actor
    phases: dict[str, dict[str, int]] = {}
    train_a = {"actor": actor.grads + act_a["peak"]}
    if A.ptx_coef > 0:
        ptx = train_activation_bytes(actor_s, mb, cfg.data.ptx_max_len, mb * cfg.data.ptx_max_len, cfg.actor.dtype,
                                     "lm", gradient_checkpointing=cfg.actor.gradient_checkpointing,
                                     lora_rank=cfg.actor.lora.rank, fused_layers=fused_layers_for(actor_s, kind))
        train_a["actor"] = actor.grads + max(act_a["peak"], ptx["peak"])
    if A.ema_beta is not None:
        actor.notes.append("EMA: an fp32 copy of the actor")
        actor.weights += 4 * actor_s.params
    frozen_dtype = cfg.actor.dtype
    # One process (backend local) runs the roles one after another: the actor trains and steps
    # (its gradients freed, set_to_none) before the critic trains. Under Ray both train at once.
    sequential = getattr(getattr(cfg, "distributed", None), "backend", "local") == "local"
    fused_a = _fused_update(cfg, rows, "actor", kind)
    fused_c = A.needs_critic and _fused_update(cfg, rows, "critic", kind)
    infer_a = inference_activation_bytes(actor_s, mb, L, mb * roll.max_new_tokens, cfg.actor.dtype)
    exp = {"actor": infer_a}
    if fused_a:   # the experience forward ran with autograd and its graph waits for the update
        exp["actor"] = act_a["saved"]
        actor.notes.append("fused update: experience graph kept")
    step = {"actor": actor.grads + actor.step_transient}
    if A.needs_critic:
        from turborlhf.config import ModelCfg

        ccfg = cfg.critic or ModelCfg(name_or_path=cfg.critic_init)
        critic_s = _shape(cfg.critic_init, ccfg.lora, resolve)
        critic = _train_role("critic", critic_s, ccfg, cfg.optim, scalar=True, device_kind=kind)
        act_c = train_activation_bytes(critic_s, mb, L, 0, cfg.actor.dtype, "values",
                                       gradient_checkpointing=ccfg.gradient_checkpointing, lora_rank=ccfg.lora.rank,
                                       fused_layers=fused_layers_for(critic_s, kind))
        critic.activations = act_c["peak"]
        roles["critic"] = critic
        exp["critic"] = (act_c["saved"] if fused_c
                         else inference_activation_bytes(critic_s, mb, L, 0, cfg.actor.dtype, head="values"))
        if fused_c:
            critic.notes.append("fused update: experience graph kept")
        phases["train actor"] = train_a
        if fused_c:   # the critic's kept graph waits through the actor's update for the critic's
            train_a["critic"] = step["critic"] = act_c["saved"]
        if sequential:
            phases["actor step"] = step
            phases["train critic"] = {"critic": critic.grads + act_c["peak"]}
            step = {"critic": critic.grads + critic.step_transient}
        else:
            phases["train critic"] = {"actor": actor.grads, "critic": critic.grads + act_c["peak"]}
            step = {"actor": actor.grads + actor.step_transient, "critic": critic.grads}
    else:
        phases["train actor"] = train_a
    rm_paths = ([cfg.reward_model] if cfg.reward_model else []) + [r.path for r in cfg.rewards if r.kind == "model"]
    for i, p in enumerate(rm_paths):
        rs = _shape(p, None, resolve)
        name = "reward" if i == 0 else f"reward{i}"
        roles[name] = _frozen_role(name, rs, frozen_dtype, scalar=True)
        exp[name] = inference_activation_bytes(rs, mb, L, 0, frozen_dtype, head="score")
    if A.needs_reference:
        ref_path = cfg.reference or cfg.actor.name_or_path
        from turborlhf.models.reference import same_model

        if cfg.actor.lora.rank > 0 and same_model(ref_path, cfg.actor.name_or_path):
            roles["reference"] = Role(name="reference", model=actor_s.name,
                                      notes=["the LoRA actor with adapters disabled: no second copy"])
        else:
            rs = _shape(ref_path, None, resolve)
            roles["reference"] = _frozen_role("reference", rs, "fp32", scalar=False)   # computes as the actor
        exp["reference"] = infer_a
    engine = Role(name="rollout", model=actor_s.name, weights=_engine_weight_bytes(roll) * actor_s.params)
    gen_rows = min(rows, roll.batch_size)
    engine.kv_cache = kv_cache_bytes(actor_s, gen_rows, prompt_len, roll.max_new_tokens, roll.dtype)
    prefill = (kv_cache_bytes(actor_s, gen_rows, prompt_len, 0, roll.dtype)
               + inference_activation_bytes(actor_s, gen_rows, prompt_len, 0, roll.dtype, head="score")
               + gen_rows * prompt_len ** 2)
    engine.activations = prefill
    engine.notes.append(f"KV cache for {gen_rows} rows × {prompt_len}+{roll.max_new_tokens} tokens")
    dist = cfg.distributed
    _vllm_reserve(engine, roll, dist.backend == "local" or dist.colocate_all_models, dist.rollout.devices_per_node)
    roles["rollout"] = engine
    if sequential:   # one forward at a time: kept graphs stay, each no-grad forward's activations go
        kept = {r: b for r, b in exp.items() if (r == "actor" and fused_a) or (r == "critic" and fused_c)}
        free = {r: b for r, b in exp.items() if r not in kept}
        exp = dict(kept)
        if free:
            top = max(free, key=free.get)
            exp[top] = exp.get(top, 0) + free[top]
    last_step = "critic step" if "actor step" in phases else "optimizer step"
    phases = {"generate": {"rollout": engine.kv_cache + prefill},
              ("experience" if fused_a or fused_c else "experience (no grad)"): exp, **phases, last_step: step}
    notes = [f"rollout batch {rows} sequences, micro-batch {mb} × ({prompt_len} prompt + {roll.max_new_tokens} "
             "response tokens), responses at max_new_tokens (worst case)" + (f"; {data['note']}" if data else "")]
    if roll.max_staleness > 0:    # the next steps' rollouts generate while this one trains (async_rollout)
        for parts in phases.values():
            parts.setdefault("rollout", engine.kv_cache + prefill)
        notes.append(f"rollout.max_staleness={roll.max_staleness}: generation overlaps every phase")
    return _Spec(roles, phases, notes)


def _fused_update(cfg, rows: int, role: str, kind: str) -> bool:
    """Whether PPO keeps `role`'s experience graph for its update on a `kind` device
    (`trainers.ppo.experience.use_fused_update`, imported lazily: it pulls in torch)."""
    from turborlhf.trainers.ppo.experience import use_fused_update

    d = getattr(cfg, "distributed", None)
    if d is not None and d.device == "auto":      # as resolve_hardware would decide it for this device
        cfg = cfg.model_copy(update={"distributed": d.model_copy(update={"device": "gpu" if kind == "gpu" else "cpu"})})
    world = getattr(getattr(d, role, None), "world_size", 1) if d is not None else 1
    return use_fused_update(cfg, rows, SimpleNamespace(role=role, world_size=world))


def _spec_rs(cfg, resolve, kind, data: Optional[dict] = None) -> _Spec:
    roll, loop = cfg.rollout, cfg.train
    s = _shape(cfg.model.name_or_path, cfg.model.lora, resolve)
    mb = min(loop.micro_batch_size, loop.sequences_per_step)
    sp = _sft_like(cfg, s, kind, mb, cfg.data.max_len, mb * cfg.data.max_len, "policy")
    pol = sp.roles["policy"]
    # a fresh AdamW per round: its states exist only during the SFT phase, not while generating
    sp.phases["train"]["policy"] += pol.optimizer
    sp.phases["optimizer step"]["policy"] += pol.optimizer
    pol.notes.append("AdamW re-created every round: states only during the SFT phase")
    pol.optimizer = 0
    sp.assumptions.append(f"SFT micro-batch of {mb} sequences × {cfg.data.max_len} tokens (worst case); "
                          f"{cfg.algo.n_samples_per_prompt} samples per prompt generated "
                          f"{min(cfg.algo.prompts_per_round * cfg.algo.n_samples_per_prompt, roll.batch_size)} at once")
    rm_s = _shape(cfg.reward_model, None, resolve)
    sp.roles["reward"] = _frozen_role("reward", rm_s, cfg.model.dtype, scalar=True)
    rows = min(cfg.algo.prompts_per_round * cfg.algo.n_samples_per_prompt, roll.batch_size)
    engine = Role(name="rollout", model=s.name, weights=_engine_weight_bytes(roll) * s.params,
                  kv_cache=kv_cache_bytes(s, rows, roll.max_prompt_len, roll.max_new_tokens, roll.dtype))
    _vllm_reserve(engine, roll, shares_device=True)
    sp.roles["rollout"] = engine
    L = roll.max_prompt_len + roll.max_new_tokens
    sp.phases = {"generate": {"rollout": engine.kv_cache + inference_activation_bytes(
                     s, rows, roll.max_prompt_len, 0, roll.dtype, head="score")},
                 "score": {"reward": inference_activation_bytes(rm_s, cfg.algo.score_batch_size, L, 0,
                                                                cfg.model.dtype, head="score")},
                 **sp.phases}
    return sp


def _spec_csft(cfg, resolve, kind, data: Optional[dict] = None) -> _Spec:
    sp = _spec_sft(cfg, resolve, kind)
    rm_s = _shape(cfg.reward_model, None, resolve)
    rm = _frozen_role("reward", rm_s, cfg.model.dtype, scalar=True)
    rm.notes.append("loaded for the one-off scoring pass, then freed")
    sp.roles["reward"] = Role(name="reward", model=rm.model, notes=rm.notes)
    sp.phases = {"score (once)": {"reward": rm.weights + inference_activation_bytes(
        rm_s, cfg.data.score_batch_size, cfg.data.max_len, 0, cfg.model.dtype, head="score")}, **sp.phases}
    return sp


def _trainer_phases(command: str, spec: _Spec, cfg) -> _Spec:
    """`spec` with its phases in the order the trainer declares them (its module's ``phases(cfg)``),
    so the plan follows the trainer's structure instead of a copy of it. RuntimeError naming the
    phases when the two differ: the trainer gained (or lost) a phase this planner does not size."""
    import importlib

    from turborlhf.cli import TRAIN_COMMANDS

    module = TRAIN_COMMANDS[command][0]
    declared = tuple(importlib.import_module(module).phases(cfg))
    if sorted(declared) != sorted(spec.phases):
        raise RuntimeError(f"plan: {module}.phases declares {list(declared)}, the planner sizes "
                           f"{list(spec.phases)}; update turborlhf.plan.SPECS[{command!r}]")
    spec.phases = {name: spec.phases[name] for name in declared}
    return spec


SPECS = {"sft": _spec_sft, "rm": _spec_rm, "dpo": lambda c, r, k, d=None: _spec_pref(c, r, k, "dpo", d),
         "kto": lambda c, r, k, d=None: _spec_pref(c, r, k, "kto", d), "ppo": _spec_ppo,
         "grpo": _spec_ppo, "rloo": _spec_ppo,       # `ppo` with the presets' defaults (presets.py)
         "rejection-sampling": _spec_rs, "conditional-sft": _spec_csft}


# ----------------------------------------------------------------------------------------------
# Placement
# ----------------------------------------------------------------------------------------------

def _placement(cfg, roles: dict[str, Role]) -> tuple[str, list[tuple[str, list[str], int]], dict]:
    """(device kind, [(group name, roles, workers)], options) from ``cfg.distributed`` when the
    config has one (PPO), else one local process."""
    d = getattr(cfg, "distributed", None)
    kind = _device_kind(cfg)
    opts = {"offload": bool(getattr(d, "ref_reward_offload", False)), "sleep": bool(getattr(d, "rollout_sleep", False)),
            "fsdp": getattr(d, "dp_strategy", "ddp") == "fsdp", "backend": getattr(d, "backend", "local")}
    names = list(roles)
    if d is None or opts["backend"] == "local":
        return kind, [("local", names, 1)], opts
    size = {r: getattr(getattr(d, r, None), "world_size", 1) for r in ("actor", "critic", "reward", "reference",
                                                                     "rollout")}
    groups: list[list[str]] = []
    if getattr(d, "colocate_all_models", False):
        groups = [names]
    else:
        if getattr(d, "colocate_actor_ref", False):
            groups.append([r for r in ("actor", "reference") if r in roles])
        if getattr(d, "colocate_critic_reward", False):
            groups.append([r for r in names if r == "critic" or r.startswith("reward")])
        placed = {r for g in groups for r in g}
        groups += [[r] for r in names if r not in placed]
    out = []
    for g in groups:
        workers = max(size.get(r if not r.startswith("reward") else "reward", 1) for r in g)
        out.append(("+".join(g), g, workers))
    return kind, out, opts


def _assemble(command: str, spec: _Spec, cfg, device_memory: Optional[int], host_memory: int) -> Plan:
    """Place the roles (`_placement`) and add up each device group: persistent memory (weights and
    optimizer states of resident roles, one process overhead per worker process), each phase's
    transient memory, and on the CPU the allocator's retention."""
    kind, groups, opts = _placement(cfg, spec.roles)
    ray = opts["backend"] == "ray"
    devices = []
    trained = ("actor", "critic", "policy", "reward_model")
    for gname, members, workers in groups:
        shard = workers if opts["fsdp"] else 1
        persistent, host_extra = 0, 0
        cap = device_memory if device_memory is not None else (host_memory if kind == "cpu" else None)
        for r in members:
            role = spec.roles[r]
            role.offloaded = opts["offload"] and (r == "reference" or r.startswith("reward"))
            role.sleeps = opts["sleep"] and r == "rollout"
            if role.reserves is not None and cap is not None:
                # its share of the device, held throughout (while asleep: during generation only)
                role.weights, role.kv_cache, role.activations = int(role.reserves * cap), 0, 0
                for parts in spec.phases.values():
                    if r in parts:
                        parts[r] = 0
            if opts["fsdp"] and r in trained and role.optimizer_host:
                # optim.offload under FSDP (CPUOffloadPolicy): the weight and gradient shards live in
                # host memory too, beside the moments; the device holds a gathered unit at a time
                host_extra += (role.weights + role.optimizer_host - 4 * role.trainable_params) // shard
                continue
            if not (role.offloaded or role.sleeps):
                persistent += (role.weights + role.optimizer) // (shard if r in trained else 1)
            host_extra += role.optimizer_host // (shard if r in trained else 1)
        processes = len(members) if ray else 1
        overhead = (PROCESS_BASELINE if kind == "cpu" else CUDA_CONTEXT) * processes
        phases = {}
        for ph, parts in spec.phases.items():
            mine = {r: b for r, b in parts.items() if r in members}
            if not mine:
                continue
            extra = 0
            for r, b in mine.items():
                role = spec.roles[r]
                if role.offloaded or (role.sleeps and ph == "generate"):
                    extra += role.weights                  # brought to the device for this phase only
                extra += b // (shard if r in trained and ph != "generate" else 1)
            phases[ph] = extra
        retained = 0
        if kind == "cpu":
            retained = int(CPU_ALLOCATOR_RETENTION * max((spec.roles[r].activations for r in members), default=0))
        peak_phase, peak_extra = max(phases.items(), key=lambda kv: kv[1]) if phases else ("idle", 0)
        label = f"{kind}:{gname}" + (f" (each of {workers} workers)" if workers > 1 else "")
        dev = Device(name=label, kind=kind, capacity=cap, roles=members, processes=processes,
                     persistent=persistent + overhead, phases=phases, peak_phase=peak_phase, allocator=retained)
        dev.peak = dev.persistent + peak_extra + retained
        devices.append(dev)
        if host_extra:
            devices.append(Device(name=f"host:{gname}", kind="cpu", capacity=host_memory, roles=members, processes=0,
                                  persistent=host_extra, peak=host_extra, peak_phase="offloaded optimizer states"))
    assumptions = list(spec.assumptions)
    if kind == "cpu":
        assumptions.append(f"per process: {_gib(PROCESS_BASELINE)} GiB measured baseline (python, torch, "
                           f"transformers, tokenizer); glibc keeps ~{CPU_ALLOCATOR_RETENTION:.0%} of the largest "
                           "activation peak as freed-but-resident memory (measured, docs/memory.md)")
    else:
        assumptions.append(f"per process: {_gib(CUDA_CONTEXT)} GiB CUDA context (not measured); the caching "
                           "allocator's fragmentation is not modelled; written for GPUs, never run on one here")
    return Plan(command=command, roles=list(spec.roles.values()), devices=devices, assumptions=assumptions)


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

def _host_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _resolver(model_config: Optional[str]):
    cache: dict = {}

    def resolve(name: str, targets: tuple[str, ...]) -> ModelShape:
        key = (name, targets)
        if key not in cache:
            try:
                cache[key] = model_shape(name, targets)
            except (FileNotFoundError, OSError, ModelFetchError) as e:     # a path or a zoo name not there yet
                if model_config is None:
                    raise FileNotFoundError(
                        f"{e}. The plan needs only the architecture: pass --model-config NAME_OR_DIR (e.g. "
                        f"smollm2-135m-instruct) to use that model's config.json for paths that do not exist yet"
                    ) from None
                cache[key] = model_shape(model_config, targets)
        return cache[key]

    return resolve


def plan_config(command: str, cfg, device_memory: Optional[int] = None, model_config: Optional[str] = None,
                host_memory: Optional[int] = None, from_data: bool = False) -> list[Plan]:
    """Plans for a validated config of `command` (a list: one per stage for ``pipeline``).

    `from_data`: size activations by the run's own heaviest micro-batch (`batches_from_data`)
    instead of the configured maxima."""
    from turborlhf.engine.run import resolve_hardware

    resolve = _resolver(model_config)
    host = host_memory if host_memory is not None else _host_memory()
    if command == "pipeline":
        from turborlhf.pipeline import stage_configs

        out = []
        resolve = _resolver(model_config or cfg.model)      # later stages start from earlier outputs
        for stage, scfg in stage_configs(cfg, cfg.model).items():
            if stage in cfg.stages:
                scfg = resolve_hardware(scfg, show=False, check_devices=False)   # auto → this host's choice
                kind = _device_kind(scfg)
                p = _assemble(stage, _trainer_phases(stage, SPECS[stage](scfg, resolve, kind), scfg), scfg,
                              device_memory, host)
                p.stage = stage
                out.append(p)
        return out
    cfg = resolve_hardware(cfg, show=False, check_devices=False)      # an explicit device: as given
    kind = _device_kind(cfg)
    data = None
    if from_data:
        model = cfg.actor.name_or_path if hasattr(cfg, "actor") else cfg.model.name_or_path
        tok_path = model if _has_tokenizer(model) else (model_config or model)
        data = batches_from_data(command, cfg, tok_path)
    spec = _trainer_phases(command, SPECS[command](cfg, resolve, kind, data), cfg)
    if from_data and data is None:
        spec.assumptions.append(f"--from-data: {command}'s batches come from generation; configured maxima used")
    return [_assemble(command, spec, cfg, device_memory, host)]


def _device_kind(cfg) -> str:
    """``"gpu"`` or ``"cpu"``: where a resolved config trains. PPO's ``distributed.device``; the
    other commands' ``model.device`` (``cuda`` → gpu; cpu and mps → cpu)."""
    d = getattr(cfg, "distributed", None)
    if d is not None:
        return getattr(d, "device", "cpu")
    return "gpu" if getattr(getattr(cfg, "model", None), "device", "cpu") == "cuda" else "cpu"


def _has_tokenizer(name: str) -> bool:
    from turborlhf.models.zoo import is_zoo_name

    return is_zoo_name(name) or (Path(name) / "tokenizer_config.json").exists() or not Path(name).parent.exists()


def format_plan(plans: list[Plan]) -> str:
    lines = []
    for p in plans:
        lines.append(f"== turborlhf {p.command}" + (f" (pipeline stage {p.stage})" if p.stage else "") + " ==")
        lines.append(f"{'role':<14}{'weights':>9}{'grads':>9}{'optim':>9}{'activ.':>9}{'KV':>9}  GiB  notes")
        for r in p.roles:
            opt = _gib(r.optimizer) + ("*" if r.optimizer_host else "")
            lines.append(f"{r.name:<14}{_gib(r.weights):>9}{_gib(r.grads):>9}{opt:>9}{_gib(r.activations):>9}"
                         f"{_gib(r.kv_cache):>9}       {'; '.join(r.notes)}")
        for d in p.devices:
            cap = f"{_gib(d.capacity)} GiB" if d.capacity else "unknown (pass --device-memory)"
            verdict = {True: "fits", False: "WILL NOT FIT", None: "?"}[d.fits]
            lines.append(f"device {d.name}: roles {', '.join(d.roles)}; persistent {_gib(d.persistent)} GiB; "
                         f"peak {_gib(d.peak)} GiB in '{d.peak_phase}' of {cap}: {verdict}")
            for ph, b in d.phases.items():
                lines.append(f"    {ph:<28} {_gib(d.persistent + b + d.allocator):>7} GiB")
            if d.allocator:
                lines.append(f"    (phases include {_gib(d.allocator)} GiB of allocator retention)")
            if d.fits is False:
                lines.append(f"    over by {_gib(d.peak - d.capacity)} GiB: try gradient checkpointing "
                             "(model.gradient_checkpointing), a smaller train.micro_batch_size, LoRA "
                             "(model.lora.rank), optim.offload on a GPU, or colocation/offload options")
        for a in p.assumptions:
            lines.append(f"  assumes: {a}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from turborlhf import config as C
    from turborlhf.cli import TRAIN_COMMANDS, _split_overrides

    p = argparse.ArgumentParser(prog="turborlhf plan", description="estimate memory per role and per device "
                                "before launching a run (reads only model configs, no weights)")
    p.add_argument("--config", required=True, help="the YAML file the training command would get")
    p.add_argument("--command", choices=sorted(SPECS) + ["pipeline"], help="which command the config is for "
                   "(default: guessed from its keys and file name; the plan's header names it)")
    p.add_argument("--device-memory", help="memory of one device, e.g. 24GiB or 80GB (default: this machine's "
                   "RAM for CPU placements)")
    p.add_argument("--model-config", help="model (zoo name or directory) whose config.json stands in for model "
                   "paths that do not exist yet (outputs of earlier stages)")
    p.add_argument("--from-data", action="store_true", help="size activations by the heaviest micro-batch of the "
                   "run's own data and step plan (tokenizer and data files are read; default: every sequence at "
                   "the configured maximum length)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args, rest = p.parse_known_args(argv)
    try:
        from turborlhf.config_io import read_yaml

        command = args.command or guess_command(args.config, read_yaml(args.config))
        cls = getattr(C, TRAIN_COMMANDS[command][2])
        cfg = C.load_config(cls, args.config, _split_overrides(rest, cls))
        dev = parse_bytes(args.device_memory) if args.device_memory else None
        if dev is not None and dev <= 0:
            raise ValueError(f"--device-memory {args.device_memory}: must be more than 0 bytes")
        plans = plan_config(command, cfg, dev, args.model_config, from_data=args.from_data)
    except (C.ConfigError, ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps([pl.to_dict() for pl in plans], indent=2) if args.json else format_plan(plans))
    return 0 if all(d.fits is not False for pl in plans for d in pl.devices) else 1
