"""The PPO roles' shared worker plumbing and the frozen roles. Each role is a worker object that
holds its model(s) and answers the driver's calls; the same classes run in this process
(``distributed.backend: local``) or inside Ray workers, one object per rank (``backend: ray``);
`turborlhf.distributed` places them and knows nothing of what they do.

- plumbing: `worker_device`, `setup_worker`, `in_chunks`, `sampling_temperature`, `add_stats` /
  `stats_as_floats` (stats summed on the device, read once per update);
- `Trainable`: the base of the trained roles (`actor.ActorWorker`, `critic.CriticWorker`):
  placement (DDP/FSDP), the optimizer step with the data-parallel gradient sum, saving, and the
  fused update's kept forwards (`KeptForward`, kept under the name the driver gives);
- `ReferenceWorker`: ``logprobs`` (optionally offloaded to the CPU between uses);
- `RewardWorker`: ``score`` (Σ weight·score over the reward sources);
- `RolloutWorker`: ``generate``, ``load_weights``, ``sleep`` (free the engine while training).

Tensors in and out are CPU tensors; B rows, P prompt columns, R response columns, S = P + R
(`turborlhf.trainers.ppo.experience`).

Data parallelism (world size > 1): every rank takes a contiguous block of whole micro-batches of
each mini-batch (`experience.row_shards`); losses are reduced with the mini-batch's global counts,
so summing the gradients (`turborlhf.engine.parallel.allreduce_gradients`, or FSDP's
reduce-scatter) gives the update of one rank doing all micro-batches. Stats come back as per-rank
sums and are added by the driver.

Imports: `experience` only among the PPO modules (never the driver, the actor or the critic).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from turborlhf.config import PPOConfig
from turborlhf.engine.malloc import keep_freed_memory
from turborlhf.engine.parallel import allreduce_gradients, dp_rank_world, full_state_dict, is_fsdp, shard_fsdp
from turborlhf.engine.train import autocast, clip_and_step, rng_state, seed_everything, set_rng_state, set_threads
from turborlhf.metrics import console_logging
from turborlhf.models.attention import attention_for_compute_device, kernels_of_training
from turborlhf.models.forward import response_logprobs
from turborlhf.models.load import load_causal_lm, load_tokenizer
from turborlhf.models.zoo import resolve_model_path
from turborlhf.rewards.combine import RewardInputs, build_reward, rows_to_columns
from turborlhf.rollout import make_engine
from turborlhf.rollout.backends import vllm_kwargs
from turborlhf.rollout.sync import check_engine, make_canary
from turborlhf.rollout.tools import make_tool
from turborlhf.trainers.ppo.experience import Experience, logprobs_mode, shares_prompts

__all__ = ["Trainable", "KeptForward", "KeptForwards", "ReferenceWorker", "RewardWorker", "RolloutWorker",
           "worker_device", "has_model_rewards", "setup_worker", "gpu_worker_threads", "in_chunks",
           "sampling_temperature", "add_stats", "stat_dtype", "stats_as_floats", "role_models"]

STATE_FILE = "worker_state.pt"


# ----------------------------------------------------------------------------------------------
# Plumbing every role uses
# ----------------------------------------------------------------------------------------------

def worker_device(cfg) -> torch.device:
    """cuda:0 (Ray gives each GPU worker one visible device) with ``distributed.device: gpu`` (or
    ``auto`` where torch sees CUDA: `turborlhf.engine.run.resolve_hardware` decides it up front)."""
    if cfg.distributed.device == "gpu" or (cfg.distributed.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("distributed.device=gpu but this worker sees no CUDA device")
        return torch.device("cuda", 0)
    return torch.device("cpu")


def has_model_rewards(cfg) -> bool:
    """Whether the run scores with a reward model (``reward_model`` or a ``kind: model`` source)."""
    return bool(cfg.reward_model) or any(r.kind == "model" for r in cfg.rewards)


def setup_worker(cfg, threads: int) -> None:
    """Allocator, console logging, torch threads and seed of a worker (a Ray worker is its own process).

    Threads: `threads`, ``train.threads`` or $TURBORLHF_THREADS where set; otherwise every core
    (roles take turns on a CPU cluster), except in a Ray worker holding a GPU, whose node's cores
    are shared among the node's GPUs (`gpu_worker_threads`)."""
    keep_freed_memory()           # a Ray worker is its own process (in this process: already done)
    console_logging()             # the same: its messages on its console (Ray forwards them to the driver's)
    set_threads(threads or cfg.train.threads or int(os.environ.get("TURBORLHF_THREADS", "0"))
                or gpu_worker_threads())
    seed_everything(cfg.train.seed)


def gpu_worker_threads() -> int:
    """Cores of this node ÷ its GPUs for a Ray worker that holds a GPU; 0 (= every core) elsewhere.

    GPU workers run at once (eight on an eight-GPU node), so each taking every core would
    oversubscribe the CPU-side work (tokenising, `optim.offload`'s AdamW, host copies)."""
    if not torch.cuda.is_available():
        return 0
    try:
        import ray

        if not ray.is_initialized() or not ray.get_gpu_ids():       # the driver or a CPU slot
            return 0
        node = ray.get_runtime_context().get_node_id()
        gpus = next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == node), 0)
    except Exception:          # no Ray, or an older API: every core, as before
        return 0
    return max(1, (os.cpu_count() or 1) // max(1, int(gpus)))


def in_chunks(fn: Callable[[slice], torch.Tensor], B: int, chunk: int) -> torch.Tensor:
    """``fn`` over consecutive row slices of `chunk` rows (micro-batches), concatenated."""
    return torch.cat([fn(slice(s, s + chunk)) for s in range(0, B, chunk)])


def sampling_temperature(cfg: PPOConfig) -> float:
    """The temperature the policy's log-probs are taken at (actor and reference): the rollout's
    sampling temperature (1 for greedy rollouts), so the trainer's π(a|s) is the distribution the
    samples came from and the engine's own log-probs (rollout correction) compare like with like."""
    t = cfg.rollout.temperature
    return t if t > 0 else 1.0


def stat_dtype(device: torch.device) -> torch.dtype:
    """The dtype a worker's stats are summed in on `device`: float64 (as Python floats sum), float32
    on MPS, which has no float64."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def add_stats(sums: dict, stats: dict) -> None:
    """``sums[k] += stats[k]`` for every stat (a worker's stats summed over micro-batches and steps).

    A stat is a Python number or a 0-d tensor; a tensor's sum stays a tensor on its device (in
    `stat_dtype`), so summing never waits for the device (a ``float()`` per stat and micro-batch
    waited for the GPU's queue to drain). `stats_as_floats` reads the sums once at the end."""
    for k, v in stats.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().to(stat_dtype(v.device))
        sums[k] = sums.get(k, 0.0) + v


def stats_as_floats(sums: dict) -> dict[str, float]:
    """`add_stats`' sums as Python floats (what a worker's ``train`` returns, through Ray too), the
    tensors read with one copy from their device rather than one per stat."""
    keys = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    read = dict(zip(keys, torch.stack([sums[k].to(sums[keys[0]]) for k in keys]).tolist())) if keys else {}
    return {k: read[k] if k in read else float(v) for k, v in sums.items()}


def plain_copy(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A full, unsharded CPU copy of an FSDP model on rank 0, None on the other ranks (collective:
    every rank calls it), for saving and the weight-sync check. Raises RuntimeError if the
    gathered state does not fill the copy (a tied LM head may be absent: it is the embedding)."""
    sd = full_state_dict(model)
    if dp_rank_world()[0] != 0:          # the gather lands on rank 0 only
        return None
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if hasattr(model, "score") else AutoModelForCausalLM
    copy = cls.from_config(model.config)
    res = copy.load_state_dict(sd, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in res.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or res.unexpected_keys:
        raise RuntimeError(f"the gathered FSDP state does not fit a plain {cls.__name__}: missing {missing[:3]}, "
                           f"unexpected {res.unexpected_keys[:3]}")
    return copy


# ----------------------------------------------------------------------------------------------
# The fused update's kept forward, and the trained roles' base
# ----------------------------------------------------------------------------------------------

@dataclass
class KeptForward:
    """A micro-batch's experience forward kept with its graph for the fused update: the input ids
    (CPU, to check the update sees the same rows) and the outputs over all R response columns
    (actor: log-probs and entropies; critic: values), on the worker's device.

    Why a worker keeps state between two calls: with one PPO epoch of one mini-batch
    (`experience.use_fused_update`) the update's forward would recompute exactly the experience
    forward, so the driver asks the worker's ``logprobs``/``values`` to keep these objects under a
    name (``keep_as``) and passes that name to the worker's next ``train`` (``kept``), which
    backpropagates through them (and frees them). An autograd graph cannot travel through the
    driver with the rest of the experience (under Ray it lives in another process, on that
    worker's device), so it stays where it was built and the driver holds only its name; `take`
    checks the rows, so a different micro-batch grouping fails loudly instead of training on
    wrong rows."""

    ids_BS: torch.Tensor
    out_BR: torch.Tensor
    ent_BR: Optional[torch.Tensor] = None

    def take(self, sub: Experience) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The outputs trimmed to `sub`'s response width; RuntimeError if `sub` has other rows.
        `sub`: the micro-batch on the CPU, as the worker received it (its device copy would have
        to come back to the CPU for the check, a copy that waits for the device)."""
        S = sub.ids_BS.shape[1]
        if self.ids_BS.shape[0] != sub.ids_BS.shape[0] or not torch.equal(self.ids_BS[:, :S], sub.ids_BS):
            raise RuntimeError("fused update: the micro-batch differs from the experience forward's rows "
                               "(set algo.fused_update=never and report this)")
        r = sub.mask_BR.shape[1]
        return self.out_BR[:, :r], (self.ent_BR[:, :r] if self.ent_BR is not None else None)


class KeptForwards:
    """The kept forwards of one experience pass, one per micro-batch, handed out in order."""

    def __init__(self, name: str, forwards: list[KeptForward]) -> None:
        self.name, self._left = name, list(forwards)

    def next(self) -> KeptForward:
        """The next micro-batch's forward; RuntimeError when the update has more micro-batches."""
        if not self._left:
            raise RuntimeError("fused update: more micro-batches than experience forwards "
                               "(set algo.fused_update=never and report this)")
        return self._left.pop(0)


class Trainable:
    """Shared mechanics of the trained roles (`actor.ActorWorker`, `critic.CriticWorker`):
    placement, the optimizer step with the DP gradient sum, saving, and the fused update's kept
    forwards. Each subclass owns its forward, micro-step and mini-batch loop."""

    # The fused update's experience forwards, kept with their autograd graphs from the experience
    # call (``logprobs``/``values`` with ``keep_as``) to the ``train`` that names them (``kept``),
    # which consumes them: the only state a worker holds between calls besides its model and
    # optimizer (why: `KeptForward`).
    _kept: Optional[KeptForwards] = None

    @contextlib.contextmanager
    def _eval(self):
        """The model in eval mode for the experience's no-grad passes (old log-probs, values, the
        LoRA reference): LoRA dropout, which peft adds after loading switched dropout off, would make
        them a dropout sample instead of the policy's (a ratio ≠ 1 on-policy)."""
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    def _shards(self) -> bool:
        """True where the role's model is FSDP-sharded over the data-parallel ranks."""
        return dp_rank_world()[1] > 1 and self.cfg.distributed.dp_strategy == "fsdp"

    def _load_cfg(self, model_cfg):
        """`model_cfg` as the role loads its model: on the CPU where FSDP shards it (`_wrap`), else
        as it says (the worker's device)."""
        return model_cfg.model_copy(update={"device": "cpu"}) if self._shards() else model_cfg

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` (loaded per `_load_cfg`) on the worker's device: moved whole, or under FSDP
        sharded from the CPU unit by unit (``fully_shard`` moves each unit to the device as it
        shards it, so a GPU never holds more than one decoder layer's full weights beside the
        shards; with ``optim.offload`` the shards stay in host memory: `shard_fsdp`), its attention
        then chosen for the device it computes on."""
        if self._shards():
            model = shard_fsdp(model, self.device, offload=self.cfg.optim.offload)
            return attention_for_compute_device(model, self.device).train()
        return model.to(self.device).train()

    def _step(self, opt, sched) -> float:
        """All-reduce the gradients over the data-parallel ranks, clip, step; returns the grad norm."""
        allreduce_gradients(self.model)
        return clip_and_step(self.model, opt, sched, self.cfg.optim.max_grad_norm,
                             role=type(self).__name__.removesuffix("Worker").lower())   # actor / critic

    def _savable(self) -> Optional[torch.nn.Module]:
        """The model to write: itself, or for FSDP a plain copy on rank 0 (None elsewhere; collective)."""
        return plain_copy(self.model) if is_fsdp(self.model) else self.model

    def _optim_state(self, opt) -> dict:
        if is_fsdp(self.model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                      cpu_offload=True))
        return opt.state_dict()

    def _rank_rngs(self) -> list[dict]:
        """Every data-parallel rank's random states, in rank order (collective; rank 0 saves them
        in `STATE_FILE`): a Ray worker is a process of its own, whose draws (LoRA or model dropout
        in the training forwards) the driver's saved states do not cover."""
        _, world = dp_rank_world()
        if world == 1:
            return [rng_state()]
        import torch.distributed as dist

        states: list = [None] * world
        dist.all_gather_object(states, rng_state())
        return states

    def _restore_rng(self, st: dict) -> None:
        """This rank's random states from a `STATE_FILE` written by as many ranks (`_rank_rngs`;
        else the seeding of `setup_worker` stands). In the driver's own process (the local
        backend) the driver restores its states after building the workers, which is the same."""
        states = st.get("rng")
        rank, world = dp_rank_world()
        if states and len(states) == world:
            set_rng_state(states[rank])

    def _read_state(self, ckpt: str, role: str) -> dict:
        """The role's `STATE_FILE` in checkpoint `ckpt`. Under FSDP the ranks other than 0 map the
        file instead of reading it and never touch its optimizer state (`_load_optim_state` takes
        it from rank 0), so a node's host memory holds that state once, not once per rank."""
        peer = is_fsdp(self.model) and dp_rank_world()[0] != 0
        return torch.load(Path(ckpt) / role / STATE_FILE, map_location="cpu", weights_only=False, mmap=peer)

    def _load_optim_state(self, opt, st: dict) -> None:
        """Restore `opt` from the full state `st` (`_optim_state`'s). FSDP: collective; rank 0's
        `st` is broadcast tensor by tensor and each rank keeps its shard (torch's
        ``broadcast_from_rank0``), the other ranks' `st` is ignored."""
        if is_fsdp(self.model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            rank0 = dp_rank_world()[0] == 0
            set_optimizer_state_dict(self.model, opt, st if rank0 else {},
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        else:
            opt.load_state_dict(st)

    def _keep_forwards(self, name: str, ids_BS: torch.Tensor, forward) -> torch.Tensor:
        """Fused update, experience side: `forward(slice)` → (out_BR, ent_BR or None) with autograd
        on each micro-batch; the outputs are kept (with their graphs) under `name` for the `train`
        that names them (any earlier kept forwards are dropped), the detached outputs are returned
        on the CPU."""
        mb = self.cfg.train.micro_batch_size
        self._kept, kept, out = None, [], []
        for s in range(0, ids_BS.shape[0], mb):
            sl = slice(s, s + mb)
            o, ent = forward(sl)
            kept.append(KeptForward(ids_BS[sl], o, ent))
            out.append(o.detach().cpu())
        self._kept = KeptForwards(name, kept)
        return torch.cat(out)

    def _take_kept(self, name: Optional[str]) -> Optional[KeptForwards]:
        """Fused update, training side: the forwards kept under `name` (consumed: their graphs are
        freed with this update), or None for `name` None (any kept forwards are dropped).
        RuntimeError when this worker holds none under that name."""
        kept, self._kept = self._kept, None
        if name is None:
            return None
        if kept is None or kept.name != name:
            raise RuntimeError(f"fused update: this worker kept no experience forward named {name!r} "
                               f"(it holds {kept.name if kept else 'none'!r}); set algo.fused_update=never "
                               "and report this")
        return kept


# ----------------------------------------------------------------------------------------------
# Frozen roles
# ----------------------------------------------------------------------------------------------

class _Offload:
    """Keep frozen models on the CPU between uses (``distributed.ref_reward_offload``) and on the
    device only inside ``with self._on_device():`` (on a CPU-only worker both places are the CPU)."""

    def _on_device(self):
        @contextlib.contextmanager
        def ctx():
            if self.offload:
                for m in self._models():
                    m.to(self.device)
            try:
                yield
            finally:
                if self.offload:
                    for m in self._models():
                        m.to("cpu")
        return ctx()


class ReferenceWorker(_Offload):
    """The frozen reference policy (`cfg.reference`, default the actor's initial weights)."""

    def __init__(self, cfg, threads: int = 0) -> None:
        setup_worker(cfg, threads)
        self.cfg, self.device = cfg, worker_device(cfg)
        self.offload = cfg.distributed.ref_reward_offload
        tok = load_tokenizer(cfg.actor.name_or_path)
        # fp32 weights under the actor's autocast, as the actor computes (and DPO's reference): bf16
        # weights round the residual stream too, a KL of ~0.2 nats per sequence at step 0
        self.model = load_causal_lm(cfg.reference or cfg.actor.name_or_path, tok, dtype=torch.float32,
                                    device="cpu" if self.offload else self.device)
        attention_for_compute_device(self.model, self.device)
        self.model.eval().requires_grad_(False)
        self.model.to("cpu" if self.offload else self.device)

    def _models(self):
        return [self.model]

    @torch.no_grad()
    def logprobs(self, ids_BS: torch.Tensor, attn_BS: torch.Tensor, mask_BR: torch.Tensor, P: int) -> torch.Tensor:
        B = ids_BS.shape[0]
        target = torch.cat([torch.zeros(B, P), mask_BR], dim=1).to(self.device)
        ids, attn = ids_BS.to(self.device), attn_BS.to(self.device)
        with self._on_device(), autocast(self.cfg.actor.dtype, self.device), kernels_of_training():   # as the actor's
            return in_chunks(lambda s: response_logprobs(self.model, ids[s], attn[s], target[s],
                                                          temperature=sampling_temperature(self.cfg),
                                                          share_prompts=shares_prompts(self.cfg.algo))[0][:, P:].cpu(),
                              B, self.cfg.train.micro_batch_size)


class RewardWorker(_Offload):
    """Every reward source of the run (`turborlhf.rewards.combine.build_reward`)."""

    def __init__(self, cfg, threads: int = 0, callables=None) -> None:
        """`callables`: the ``kind: callable`` sources' functions (`turborlhf.rewards.callables`)."""
        setup_worker(cfg, threads)
        # reward functions alone need no GPU: on a GPU cluster such a worker holds a CPU slot
        self.cfg, self.device = cfg, worker_device(cfg) if has_model_rewards(cfg) else torch.device("cpu")
        self.offload = cfg.distributed.ref_reward_offload
        self.tok = load_tokenizer(cfg.actor.name_or_path)
        # loaded where it computes (on the CPU with the fused layers, or straight onto the GPU);
        # offloaded models wait on the CPU between uses
        self.reward = build_reward(cfg.rewards, cfg.reward_model, self.tok, cfg.actor.dtype, cfg.train.micro_batch_size,
                                   callables, device="cpu" if self.offload else self.device,
                                   compute_device=self.device)
        for m in self._models():
            m.to("cpu" if self.offload else self.device)

    def _models(self):
        return [fn.model for _, _, fn in self.reward.sources if hasattr(fn, "model")]

    def sources(self) -> list[tuple[str, float]]:
        return [(n, w) for n, w, _ in self.reward.sources]

    @torch.no_grad()
    def score(self, ids_BS, attn_BS, prompt_ids, response_ids, columns=None) -> tuple[torch.Tensor, dict]:
        """``(score_B, {source: score_B})`` for the rows, as CPU tensors; ``columns``: per row, the
        prompts file's other fields (passed to reward functions by name)."""
        with self._on_device():
            total, per = self.reward(RewardInputs(ids_BS.to(self.device), attn_BS.to(self.device), prompt_ids,
                                                  response_ids, self.tok, rows_to_columns(columns)))
        return total.cpu(), {k: v.cpu() for k, v in per.items()}


def role_models(worker) -> list[torch.nn.Module]:
    """The models a role worker of this process holds: the trained model of the actor or critic,
    the reference model, every reward model (the driver's trunk sharing looks at them)."""
    return worker._models() if isinstance(worker, _Offload) else [worker.model]


class RolloutWorker:
    """One rollout engine (`turborlhf.rollout.make_engine`), built from the actor's initial weights
    (or the resumed checkpoint's) and kept in sync by `load_weights`.

    With ``distributed.rollout_sleep`` the engine sleeps while the actor trains (`sleep`: vLLM's
    sleep mode on a GPU build, else closed, dropped and rebuilt by the next `load_weights`, which
    always precedes the next generation)."""

    def __init__(self, cfg, ckpt: Optional[str], threads: int = 0) -> None:
        setup_worker(cfg, threads)
        self.cfg = cfg
        # a LoRA checkpoint holds only adapters: start from the base; the driver pushes the merged
        # weights right after a resume
        lora_ckpt = ckpt and (Path(ckpt) / "actor" / "adapter_config.json").exists()
        self.path = str(Path(ckpt) / "actor") if ckpt and not lora_ckpt else cfg.actor.name_or_path
        self.engine = self._build()
        tool = getattr(cfg.rollout, "tool", "none")
        self.tool = make_tool(tool, load_tokenizer(cfg.actor.name_or_path)) if tool != "none" else None

    def _build(self):
        roll = self.cfg.rollout
        # vLLM fixes its log-prob mode per engine (the other engines take it per call)
        kw = ({"logprobs_mode": logprobs_mode(self.cfg), "sleep_mode": self.cfg.distributed.rollout_sleep}
              if roll.engine == "vllm" else {})
        dist = self.cfg.distributed
        ray = dist.backend == "ray"
        kw.update(vllm_kwargs(roll, shares_gpu=not ray or dist.colocate_all_models,
                              engines_per_host=dist.rollout.devices_per_node if ray else 1))
        return make_engine(roll.engine, str(resolve_model_path(self.path)), dtype=roll.dtype, device=roll.device,
                           device_field="rollout.device", weight_dtype=roll.weight_dtype,
                           max_batch_size=roll.batch_size, **kw)

    def engine_name(self) -> str:
        return type(self.engine).__name__ if self.engine is not None else "asleep"

    def generate(self, prompts: list[list[int]], params) -> tuple[list[list[int]], list[bool], Optional[list],
                                                                  Optional[list]]:
        """Responses (stop token included), finished flags, the engine's log-probs of the sampled
        tokens (None unless ``params.return_logprobs``) and the tool mask (True where
        ``rollout.tool`` wrote the token; None without a tool), samples of a prompt consecutive."""
        if self.engine is None:
            self.engine = self._build()
        out = (self.engine.generate(prompts, params, tool=self.tool) if self.tool is not None
               else self.engine.generate(prompts, params))
        return out.response_ids, out.finished, out.logprobs, out.tool_mask

    def load_weights(self, state) -> None:
        """`state`: anything whose `items()` gives (HF name, tensor) pairs (a dict, or the actor's
        `MergedWeights` under LoRA)."""
        if self.engine is None:
            self.engine = self._build()
        self.engine.load_weights(state.items())

    def make_canary(self, prompts: list[list[int]]):
        """Fixed canary batch for the weight-sync checks (`turborlhf.rollout.sync.make_canary`)."""
        if self.engine is None:
            self.engine = self._build()
        return make_canary(self.engine, prompts)

    def check_sync(self, canary, trainer_logprobs: list[list[float]], tol: float) -> dict:
        """Compare this engine's canary log-probs with the trainer's; WeightSyncError if they
        disagree by more than `tol` (the run then stops naming this rollout worker)."""
        if self.engine is None:
            self.engine = self._build()
        return check_engine(self.engine, trainer_logprobs, canary, tol).metrics()

    def sleep(self) -> None:
        """With ``distributed.rollout_sleep``, free the engine's memory while the actor trains:
        vLLM's sleep mode where the engine has it (`VLLMEngine.can_sleep`), else the engine is
        closed (a vLLM engine keeps its device reservation until closed) and dropped, and the next
        call builds it again."""
        if not self.cfg.distributed.rollout_sleep or self.engine is None:
            return
        if getattr(self.engine, "can_sleep", False):
            self.engine.sleep()
            return
        if hasattr(self.engine, "close"):
            self.engine.close()
        self.engine = None
