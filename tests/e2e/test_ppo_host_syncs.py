"""The PPO micro-steps queue their work without waiting for it: on a GPU every ``float(t)``,
``int(t)``, ``t.item()``, ``t.tolist()``, ``bool(t)`` of a device tensor, and every boolean-mask
index (its result's size depends on the data), blocks the CPU until the GPU's queue drains, so the
next kernels are not queued while the GPU works. A float() per logged stat did so several times
per micro-batch.

There is no GPU here: a `TorchFunctionMode` records those calls during one micro-step of a model
set up as on a GPU (SDPA attention, no packed sequences, plain layers), on CPU tensors standing for
the device's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from turborlhf.config import PPOConfig
from turborlhf.trainers.ppo.experience import Experience, minibatch_counts, rank_micro_batches

B, P, R, V = 4, 3, 6, 64

_CONVERSIONS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__float__: "float",
                torch.Tensor.__int__: "int", torch.Tensor.__bool__: "bool", torch.Tensor.__index__: "index"}
_WAITS = {torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero", torch.Tensor.masked_select: "masked_select",
          torch.masked_select: "masked_select", torch.argwhere: "argwhere", torch.Tensor.argwhere: "argwhere",
          torch.Tensor.cpu: "cpu"}


def _bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else None
    idx = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)


class HostSyncs(TorchFunctionMode):
    """Records ``(what, where)`` for every call that would wait for a GPU: a tensor's conversion to
    a Python value (non-empty tensors), the ops whose output size depends on the data, a copy to
    the CPU; ``where`` is the innermost function outside torch on the stack (``module:function``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _CONVERSIONS.get(func) or _WAITS.get(func)
        if func in _CONVERSIONS and not (args and isinstance(args[0], torch.Tensor) and args[0].numel() > 0):
            what = None
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _bool_index(args):
            what = "bool-index"
        if what:
            self.calls.append((what, _where()))
        return func(*args, **(kwargs or {}))


def _where() -> str:
    f = sys._getframe(2)
    while f is not None and "/torch/" in f.f_code.co_filename:
        f = f.f_back
    return f"{Path(f.f_code.co_filename).stem}:{f.f_code.co_name}" if f is not None else "?"


# The one wait a micro-step keeps: response_logprobs' indices of the scored positions, whose count
# sizes the LM head's work (the forward gets the target mask on the device, no count from the host);
# once per forward, where its boolean-mask indexes waited three or four times.
KEPT = {("nonzero", "forward:response_logprobs")}
# On the CPU only (not on a GPU): head_logprobs checks its labels on the host, since the C kernel
# indexes the logits with them (on CUDA the check is queued on the device instead).
CPU_ONLY = {("tolist", "head_logprobs:_check_labels")}
# transformers' own: its SDPA mask builder looks for padding on the host (``padding_mask.all()``) to
# let SDPA use its causal kernel; once per mask it builds.
LIBRARY = {("bool", "masking_utils:_ignore_causal_mask_sdpa")}


def _cfg(**algo) -> PPOConfig:
    critic = {"name_or_path": "x", "dtype": "fp32"} if algo["advantage_estimator"] == "gae" else None
    return PPOConfig(actor={"name_or_path": "x", "dtype": "fp32"}, critic=critic, reward_model="rm",
                     data={"prompts_file": "f"}, rollout={"max_new_tokens": R},
                     algo={"n_samples_per_prompt": 2, **algo})


def _experience(prompts_shared: bool = False) -> Experience:
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([6, 1, 4, 3])
    mask = (torch.arange(R)[None] < lens[:, None]).float()
    prompt = torch.randint(3, V, (B, P), generator=g)
    if prompts_shared:
        prompt = prompt[::2].repeat_interleave(2, 0)
    ids = torch.cat([prompt, torch.randint(3, V, (B, R), generator=g)], 1)
    attn = torch.cat([torch.ones(B, P), mask], 1).long()
    old = -torch.rand(B, R, generator=g) * 3 * mask
    adv = torch.randn(B, 1, generator=g).expand(B, R) * mask
    return Experience(ids, attn, P, mask, torch.ones(B, dtype=torch.bool), old, old - 0.1, old + 0.1,
                      torch.zeros(B), torch.zeros(B), torch.zeros(B, R), adv_BR=adv, returns_BR=adv,
                      is_weight_BR=torch.ones(B, R))


def _model(kind: str):
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from turborlhf.models.tiny import tiny_llama_config

    torch.manual_seed(0)
    cls = LlamaForCausalLM if kind == "causal" else LlamaForSequenceClassification
    return cls(tiny_llama_config(V, hidden_size=16, layers=1, heads=2, kv_heads=1, num_labels=1,
                                 attn_implementation="sdpa")).train()


def _syncs(step) -> list[tuple[str, str]]:
    """The calls of `step` that would wait for a GPU, less transformers' own (`LIBRARY`)."""
    mode = HostSyncs()
    with mode:
        step()
    return [c for c in mode.calls if c not in LIBRARY]


@pytest.mark.parametrize("algo", [
    {"advantage_estimator": "gae", "kl_use_loss": True},
    {"advantage_estimator": "grpo", "share_prompts": True, "policy_loss": "gspo", "entropy_coef": 0.01,
     "loss_reduction": "seq_mean_token_mean"},
    {"advantage_estimator": "grpo", "policy_loss": "cispo", "loss_reduction": "seq_mean_token_mean"},
], ids=["ppo-kl-loss", "gspo-entropy-bonus", "cispo"])
def test_an_actor_micro_step_waits_for_nothing_but_its_scored_positions(algo):
    from turborlhf.trainers.ppo.actor import actor_micro_step

    cfg, model, exp = _cfg(**algo), _model("causal"), _experience(prompts_shared=True)
    mini = torch.arange(B)
    counts = minibatch_counts(exp.mask_BR, cfg)
    sub = next(rank_micro_batches(exp, mini, B))
    stats: dict = {}
    calls = _syncs(lambda: stats.update(actor_micro_step(model, cfg, sub, counts, 0.05)))
    assert set(calls) <= KEPT | CPU_ONLY, calls
    assert len([c for c in calls if c in KEPT]) <= 1, calls
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_a_fused_actor_micro_step_checks_its_rows_on_the_host_copy():
    """The fused update's row check compared the kept CPU ids with the micro-batch's device ids
    (``.cpu()``, a copy that waits for the GPU)."""
    from turborlhf.trainers.ppo.actor import actor_forward, actor_micro_step
    from turborlhf.trainers.ppo.roles import KeptForward

    cfg, model, exp = _cfg(advantage_estimator="grpo"), _model("causal"), _experience()
    target = torch.cat([torch.zeros(B, P), exp.mask_BR], 1)
    kept = KeptForward(exp.ids_BS, *actor_forward(model, cfg, exp.ids_BS, exp.attn_BS, target, P))
    counts = minibatch_counts(exp.mask_BR, cfg)
    sub = next(rank_micro_batches(exp, torch.arange(B), B))
    calls = _syncs(lambda: actor_micro_step(model, cfg, sub, counts, 0.05, kept=kept))
    assert calls == [], calls


@pytest.mark.parametrize("value_clip", [None, 0.2])
def test_a_critic_micro_step_waits_for_nothing(value_clip):
    from turborlhf.trainers.ppo.critic import critic_micro_step

    cfg, model, exp = _cfg(advantage_estimator="gae", value_clip=value_clip), _model("scalar"), _experience()
    counts = minibatch_counts(exp.mask_BR, cfg)
    sub = next(rank_micro_batches(exp, torch.arange(B), B))
    stats: dict = {}
    calls = _syncs(lambda: stats.update(critic_micro_step(model, cfg, sub, counts)))
    assert calls == [], calls
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_stats_are_summed_on_the_device_and_read_once_as_floats():
    from turborlhf.trainers.ppo.roles import add_stats, stats_as_floats

    sums: dict = {}
    add_stats(sums, {"a": torch.tensor(0.1, dtype=torch.float32), "n": 1.5})
    add_stats(sums, {"a": torch.tensor(0.2, dtype=torch.float32), "b": torch.tensor(2.0), "n": 0.5})
    assert isinstance(sums["a"], torch.Tensor) and sums["a"].dtype == torch.float64
    mode = HostSyncs()
    with mode:
        out = stats_as_floats(sums)
    assert [w for w, _ in mode.calls] == ["tolist"]
    assert out == {"a": float(torch.tensor(0.1)) + float(torch.tensor(0.2)), "n": 2.0, "b": 2.0}
    assert all(type(v) is float for v in out.values())
