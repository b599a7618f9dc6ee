"""The PPO roles as worker objects: each holds its model(s) and answers the driver's calls; the
driver (`turborlhf.trainers.ppo.train`) computes rewards and advantages with pure functions
(verl's single controller). The same classes run in this process (``distributed.backend:
local``) or inside Ray workers, one object per rank (``backend: ray``); `turborlhf.distributed`
places them and knows nothing of what they do.

Roles and their methods (tensors in and out are CPU tensors; B rows, P prompt columns, R response
columns, S = P + R, see `turborlhf.trainers.ppo`). What the trained roles compute is in
`turborlhf.trainers.ppo_compute`; this module never imports the driver (`turborlhf.trainers.ppo`).

- `ActorWorker`: ``logprobs`` (old log-probs), ``train`` (its share of each mini-batch, gradients
  summed over the data-parallel ranks), ``weights`` (for the rollout engines), ``save``/``export``;
- `CriticWorker`: ``values``, ``train``, ``save``;
- `ReferenceWorker`: ``logprobs`` (optionally offloaded to the CPU between uses);
- `RewardWorker`: ``score`` (Σ weight·score over the reward sources);
- `RolloutWorker`: ``generate``, ``load_weights``, ``sleep`` (free the engine while training).

Data parallelism (world size > 1): every rank takes every ``world``-th micro-batch of each
mini-batch; losses are reduced with the mini-batch's global counts, so summing the gradients
(`turborlhf.engine.parallel.allreduce_gradients`, or FSDP's reduce-scatter) gives the update of
one rank doing all micro-batches. Stats come back as per-rank sums and are added by the driver.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import torch

from turborlhf.config import ModelCfg
from turborlhf.data.loaders import load_sft
from turborlhf.data.tokenize import encode_examples
from turborlhf.engine.checkpoint import _write_hf
from turborlhf.engine.malloc import keep_freed_memory
from turborlhf.engine.parallel import (allreduce_gradients, dp_rank_world, full_state_dict, is_fsdp, root_forward,
                                      shard_fsdp)
from turborlhf.engine.run import export_model
from turborlhf.engine.train import (autocast, clip_and_step, make_optimizer, make_scheduler, seed_everything,
                                    set_threads)
from turborlhf.metrics import M, console_logging
from turborlhf.models.forward import response_logprobs
from turborlhf.models.load import load_causal_lm, load_tokenizer, load_trainable, merged_named_parameters
from turborlhf.models.reference import LoraReference, reference_view
from turborlhf.models.zoo import resolve_model_path
from turborlhf.rewards.combine import RewardInputs, build_reward, rows_to_columns
from turborlhf.rollout import make_engine
from turborlhf.rollout.sync import check_engine, make_canary, trainer_logprobs
from turborlhf.trainers.ppo_compute import (EmaModel, KeptForward, PtxStream, actor_forward, actor_micro_step,
                                            critic_forward, critic_micro_step, minibatch_counts, policy_mask, ptx_step,
                                            row_shards, sampling_temperature)

__all__ = ["ActorWorker", "CriticWorker", "ReferenceWorker", "RewardWorker", "RolloutWorker"]

STATE_FILE = "worker_state.pt"


def _device(cfg) -> torch.device:
    """cuda:0 (Ray gives each GPU worker one visible device) with ``distributed.device: gpu`` (or
    ``auto`` where torch sees CUDA: `turborlhf.engine.run.resolve_hardware` decides it up front)."""
    if cfg.distributed.device == "gpu" or (cfg.distributed.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("distributed.device=gpu but this worker sees no CUDA device")
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _setup(cfg, threads: int) -> None:
    keep_freed_memory()           # a Ray worker is its own process (in this process: already done)
    console_logging()             # the same: its messages on its console (Ray forwards them to the driver's)
    set_threads(threads or cfg.train.threads)
    seed_everything(cfg.train.seed)


def _in_chunks(fn, B: int, chunk: int) -> torch.Tensor:
    return torch.cat([fn(slice(s, s + chunk)) for s in range(0, B, chunk)])


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A full, unsharded CPU copy of an FSDP model (collective: every rank calls it), for saving."""
    sd = full_state_dict(model)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if hasattr(model, "score") else AutoModelForCausalLM
    copy = cls.from_config(model.config)
    copy.load_state_dict(sd, strict=False)
    return copy


class _Trainable:
    """Shared mechanics of the trained roles (optimizer step with the DP gradient sum, saving)."""

    # The fused update's experience forwards, kept with their autograd graphs from the experience
    # call (``logprobs``/``values`` with ``keep_graph``) to the next ``train``, which consumes them:
    # the only state a worker holds between calls besides its model and optimizer (why: `KeptForward`).
    _kept: Optional[list[KeptForward]] = None

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        _, world = dp_rank_world()
        model.to(self.device)
        if world > 1 and self.cfg.distributed.dp_strategy == "fsdp":
            model = shard_fsdp(model, self.device)
        return model.train()

    def _step(self, opt, sched) -> float:
        allreduce_gradients(self.model)
        return clip_and_step(self.model, opt, sched, self.cfg.optim.max_grad_norm,
                             role=type(self).__name__.removesuffix("Worker").lower())   # actor / critic

    def _savable(self) -> torch.nn.Module:
        return _plain_copy(self.model) if is_fsdp(self.model) else self.model

    def _optim_state(self, opt) -> dict:
        if is_fsdp(self.model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                      cpu_offload=True))
        return opt.state_dict()

    def _load_optim_state(self, opt, st: dict) -> None:
        if is_fsdp(self.model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model, opt, st, options=StateDictOptions(full_state_dict=True))
        else:
            opt.load_state_dict(st)

    def _keep_forwards(self, ids_BS: torch.Tensor, forward) -> torch.Tensor:
        """Fused update, experience side: `forward(slice)` → (out_BR, ent_BR or None) with autograd
        on each micro-batch; the outputs are kept (with their graphs) for the next `train`, the
        detached outputs are returned on the CPU."""
        mb = self.cfg.train.micro_batch_size
        self._kept, out = [], []
        for s in range(0, ids_BS.shape[0], mb):
            sl = slice(s, s + mb)
            o, ent = forward(sl)
            self._kept.append(KeptForward(ids_BS[sl], o, ent))
            out.append(o.detach().cpu())
        return torch.cat(out)

    def _train_minibatches(self, exp, schedule: list, micro_fn, step_fn,
                           mask_of=lambda exp: exp.mask_BR) -> tuple[dict, int]:
        """Run `micro_fn(sub_experience, counts, kept)` on this rank's micro-batches of every
        mini-batch (a contiguous block of whole micro-batches, as `row_shards` gave it in the
        experience phase), then `step_fn()`; returns (stats summed over steps, number of optimizer
        steps). `kept` is the micro-batch's `KeptForward` after a fused experience pass (consumed
        here, so the graphs are freed with this update), else None. `mask_of(exp)`: the mask whose
        token counts reduce the losses (the actor's: `ppo_rlvr.policy_mask`, less filtered rows)."""
        rank, world = dp_rank_world()
        mb = self.cfg.train.micro_batch_size
        sums: dict[str, float] = {}

        def add(stats: dict) -> None:
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v

        kept, self._kept = self._kept, None
        for mini in schedule:
            counts = minibatch_counts(mask_of(exp)[mini], self.cfg)
            shard = row_shards(len(mini), mb, world).get(rank)     # the rows the experience gave this rank
            for micro in (mini[shard].split(mb) if shard is not None else []):
                if kept is not None and not kept:
                    raise RuntimeError("fused update: more micro-batches than experience forwards "
                                       "(set algo.fused_update=never and report this)")
                add(micro_fn(exp.rows(micro), counts, kept.pop(0) if kept is not None else None))
            add(step_fn())
        return sums, len(schedule)


# ----------------------------------------------------------------------------------------------
# Actor
# ----------------------------------------------------------------------------------------------

class ActorWorker(_Trainable):
    """The trained policy, its optimizer, schedule, EMA and PPO-ptx stream.

    Args:
        cfg: the `PPOConfig`. ckpt: checkpoint directory to resume from (its ``actor/``).
        total_updates: optimizer steps of the whole run (for the schedule).
        threads: torch intra-op threads (0 = ``train.threads`` / $TURBORLHF_THREADS).
    """

    def __init__(self, cfg, ckpt: Optional[str], total_updates: int, threads: int = 0) -> None:
        _setup(cfg, threads)
        A = cfg.algo
        self.cfg, self.device = cfg, _device(cfg)
        self.tok = load_tokenizer(cfg.actor.name_or_path)
        # LoRA / QLoRA / gradient checkpointing as cfg.actor says; resumes from the checkpoint's actor
        self.model = self._wrap(load_trainable("causal", cfg.actor, self.tok,
                                               ckpt_dir=Path(ckpt) / "actor" if ckpt else None))
        if A.ema_beta is not None and is_fsdp(self.model):
            raise ValueError("algo.ema_beta with distributed.dp_strategy=fsdp is not supported; use ddp")
        self.opt = make_optimizer(self.model, cfg.optim)
        self.sched = make_scheduler(self.opt, cfg.optim, total_updates)
        self.ema = EmaModel(self.model, A.ema_beta) if A.ema_beta is not None else None
        self.ptx = None
        if A.ptx_coef > 0:
            self.ptx = PtxStream(encode_examples(self.tok, load_sft(cfg.data.ptx_file, self.tok, **cfg.data.loader_kwargs()), cfg.data.ptx_max_len),
                                 cfg.train.seed)
        if ckpt:
            st = torch.load(Path(ckpt) / "actor" / STATE_FILE, weights_only=False)
            self._load_optim_state(self.opt, st["opt"])
            self.sched.load_state_dict(st["sched"])
            if self.ema is not None:
                self.ema.load_state_dict(st["ema"])
            if self.ptx is not None:
                self.ptx.pos = st["ptx_pos"]

    def info(self) -> dict:
        return {"ptx_examples": len(self.ptx.examples) if self.ptx else 0, "lr": self.sched.get_last_lr()[0]}

    def logprobs(self, ids_BS: torch.Tensor, attn_BS: torch.Tensor, mask_BR: torch.Tensor, P: int,
                 keep_graph: bool = False) -> torch.Tensor:
        """Log-probs ``B×R`` of the response tokens under the current actor (micro-batched).

        keep_graph: fused update (`ppo_compute.use_fused_update`): run with autograd and keep each
        micro-batch's log-probs and entropies for the next `train`, which backpropagates through
        them instead of a second forward. The returned tensor is detached either way."""
        B, mb = ids_BS.shape[0], self.cfg.train.micro_batch_size
        target = torch.cat([torch.zeros(B, P), mask_BR], dim=1).to(self.device)
        ids, attn = ids_BS.to(self.device), attn_BS.to(self.device)
        if not keep_graph:
            with torch.no_grad(), autocast(self.cfg.actor.dtype):
                return _in_chunks(lambda s: root_forward(self.model, response_logprobs, ids[s], attn[s], target[s],
                                                         temperature=sampling_temperature(self.cfg))[0][:, P:].cpu(),
                                  B, mb)
        return self._keep_forwards(ids_BS, lambda s: actor_forward(self.model, self.cfg, ids[s], attn[s], target[s], P))

    @torch.no_grad()
    def ref_logprobs(self, ids_BS: torch.Tensor, attn_BS: torch.Tensor, mask_BR: torch.Tensor, P: int) -> torch.Tensor:
        """Reference log-probs ``B×R`` from the LoRA actor with its adapters disabled (the frozen base
        is the initial policy): PPO's reference without a second copy of the model."""
        with reference_view(LoraReference(self.model)):
            return self.logprobs(ids_BS, attn_BS, mask_BR, P)

    def train(self, exp, schedule: list, kl_coef: float) -> tuple[dict, int]:
        """Policy (+ KL, − entropy, + ptx) updates over `schedule` (mini-batches of row indices)."""
        def micro(sub, counts, kept):
            return actor_micro_step(self.model, self.cfg, sub, counts, kl_coef, self.device, kept)

        def step():
            stats = self._ptx() if self.ptx is not None else {}
            stats[M.POLICY_GRAD_NORM] = self._step(self.opt, self.sched)
            if self.ema is not None:
                self.ema.update()
            return stats

        return self._train_minibatches(exp, schedule, micro, step, mask_of=policy_mask)

    def _ptx(self) -> dict:
        """PPO-ptx on one micro-batch of SFT data, split over the ranks with the global token count."""
        batch = self.ptx.next(self.cfg.train.micro_batch_size)   # every rank advances the same stream
        n_tok = sum(sum(e["loss_mask"]) for e in batch)
        rank, world = dp_rank_world()
        mine = batch[rank::world]
        return ptx_step(self.model, self.tok, self.cfg, mine, n_tok) if mine else {M.PTX_LOSS: 0.0}

    def weights(self) -> Optional[dict[str, torch.Tensor]]:
        """The actor's parameters by HF name (rank 0; None elsewhere), for the rollout engines.
        Collective for FSDP (every rank gathers)."""
        if is_fsdp(self.model):
            sd = full_state_dict(self.model)
            return sd if dp_rank_world()[0] == 0 else None
        if dp_rank_world()[0] != 0:
            return None
        return {n: p.detach().cpu() for n, p in merged_named_parameters(self.model)}   # LoRA merged

    def canary_logprobs(self, canary) -> Optional[list[list[float]]]:
        """The trainer side of the weight-sync check (`turborlhf.rollout.sync.trainer_logprobs`),
        LoRA merged as the engines see it; rank 0 only (None elsewhere)."""
        if is_fsdp(self.model) or dp_rank_world()[0] != 0:
            return None
        return trainer_logprobs(self.model, canary, self.cfg.rollout.dtype)

    def save(self, out_dir: str) -> None:
        """Write ``out_dir`` (HF dir + worker_state.pt) from rank 0; collective for FSDP."""
        model, opt_state = self._savable(), self._optim_state(self.opt)
        if dp_rank_world()[0] != 0:
            return
        _write_hf(model, self.tok, Path(out_dir), merge=False)     # LoRA: the adapter directory
        torch.save({"opt": opt_state, "sched": self.sched.state_dict(),
                    "ema": self.ema.state_dict() if self.ema else None, "ptx_pos": self.ptx.pos if self.ptx else 0},
                   Path(out_dir) / STATE_FILE)

    def export(self, out_dir: str) -> None:
        """The final actor (and its EMA under ``<out_dir>/ema``) as HF directories (rank 0)."""
        model = self._savable()
        if dp_rank_world()[0] != 0:
            return
        export_model(model, self.tok, out_dir)
        if self.ema is not None:
            export_model(self.ema.model, self.tok, Path(out_dir) / "ema")


# ----------------------------------------------------------------------------------------------
# Critic
# ----------------------------------------------------------------------------------------------

class CriticWorker(_Trainable):
    """The value model (gae only) and its optimizer; initialised from `cfg.critic_init`."""

    def __init__(self, cfg, ckpt: Optional[str], total_updates: int, threads: int = 0) -> None:
        _setup(cfg, threads)
        self.cfg, self.device = cfg, _device(cfg)
        self.tok = load_tokenizer(cfg.actor.name_or_path)
        # without a critic section: full fine-tuning of the critic_init model, no checkpointing
        self.model = self._wrap(load_trainable("scalar", cfg.critic or ModelCfg(name_or_path=cfg.critic_init), self.tok,
                                               init=cfg.critic_init, ckpt_dir=Path(ckpt) / "critic" if ckpt else None))
        self.opt = make_optimizer(self.model, cfg.optim, lr=cfg.algo.critic_lr)
        self.sched = make_scheduler(self.opt, cfg.optim, total_updates)
        if ckpt:
            st = torch.load(Path(ckpt) / "critic" / STATE_FILE, weights_only=False)
            self._load_optim_state(self.opt, st["opt"])
            self.sched.load_state_dict(st["sched"])

    def values(self, ids_BS: torch.Tensor, attn_BS: torch.Tensor, P: int, R: int,
               keep_graph: bool = False) -> torch.Tensor:
        """Values ``B×R``: column j is the value of the state in which response token j is chosen.
        keep_graph: as `ActorWorker.logprobs` (the next `train` backpropagates through them)."""
        ids, attn = ids_BS.to(self.device), attn_BS.to(self.device)
        fwd = lambda s: critic_forward(self.model, self.cfg, ids[s], attn[s], P, R)      # noqa: E731
        if not keep_graph:
            with torch.no_grad():
                return _in_chunks(lambda s: fwd(s)[0].cpu(), ids.shape[0], self.cfg.train.micro_batch_size)
        return self._keep_forwards(ids_BS, fwd)

    def train(self, exp, schedule: list) -> tuple[dict, int]:
        """Clipped value-loss updates over `schedule`."""
        def micro(sub, counts, kept):
            return critic_micro_step(self.model, self.cfg, sub, counts, self.device, kept)

        return self._train_minibatches(exp, schedule, micro,
                                       lambda: {M.VALUE_GRAD_NORM: self._step(self.opt, self.sched)})

    def save(self, out_dir: str) -> None:
        model, opt_state = self._savable(), self._optim_state(self.opt)
        if dp_rank_world()[0] != 0:
            return
        _write_hf(model, self.tok, Path(out_dir), merge=False)     # LoRA: the adapter directory
        torch.save({"opt": opt_state, "sched": self.sched.state_dict()}, Path(out_dir) / STATE_FILE)


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
        _setup(cfg, threads)
        self.cfg, self.device = cfg, _device(cfg)
        self.offload = cfg.distributed.ref_reward_offload
        tok = load_tokenizer(cfg.actor.name_or_path)
        dtype = torch.bfloat16 if cfg.actor.dtype == "bf16" else torch.float32
        self.model = load_causal_lm(cfg.reference or cfg.actor.name_or_path, tok, dtype=dtype)
        self.model.eval().requires_grad_(False)
        self.model.to("cpu" if self.offload else self.device)

    def _models(self):
        return [self.model]

    @torch.no_grad()
    def logprobs(self, ids_BS: torch.Tensor, attn_BS: torch.Tensor, mask_BR: torch.Tensor, P: int) -> torch.Tensor:
        B = ids_BS.shape[0]
        target = torch.cat([torch.zeros(B, P), mask_BR], dim=1).to(self.device)
        ids, attn = ids_BS.to(self.device), attn_BS.to(self.device)
        with self._on_device(), autocast(self.cfg.actor.dtype):
            return _in_chunks(lambda s: response_logprobs(self.model, ids[s], attn[s], target[s],
                                                          temperature=sampling_temperature(self.cfg))[0][:, P:].cpu(),
                              B, self.cfg.train.micro_batch_size)


class RewardWorker(_Offload):
    """Every reward source of the run (`turborlhf.rewards.combine.build_reward`)."""

    def __init__(self, cfg, threads: int = 0, callables=None) -> None:
        """`callables`: the ``kind: callable`` sources' functions (`turborlhf.rewards.callables`)."""
        _setup(cfg, threads)
        self.cfg, self.device = cfg, _device(cfg)
        self.offload = cfg.distributed.ref_reward_offload
        self.tok = load_tokenizer(cfg.actor.name_or_path)
        self.reward = build_reward(cfg.rewards, cfg.reward_model, self.tok, cfg.actor.dtype, cfg.train.micro_batch_size,
                                   callables)
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


class RolloutWorker:
    """One rollout engine (`turborlhf.rollout.make_engine`), built from the actor's initial weights
    (or the resumed checkpoint's) and kept in sync by `load_weights`.

    With ``distributed.rollout_sleep`` the engine is dropped by `sleep` (while the actor trains)
    and rebuilt by the next `load_weights` (which always precedes the next generation)."""

    def __init__(self, cfg, ckpt: Optional[str], threads: int = 0) -> None:
        _setup(cfg, threads)
        self.cfg = cfg
        # a LoRA checkpoint holds only adapters: start from the base; the driver pushes the merged
        # weights right after a resume
        lora_ckpt = ckpt and (Path(ckpt) / "actor" / "adapter_config.json").exists()
        self.path = str(Path(ckpt) / "actor") if ckpt and not lora_ckpt else cfg.actor.name_or_path
        self.engine = self._build()

    def _build(self):
        roll = self.cfg.rollout
        return make_engine(roll.engine, str(resolve_model_path(self.path)), dtype=roll.dtype, device=roll.device,
                           max_batch_size=roll.batch_size)

    def engine_name(self) -> str:
        return type(self.engine).__name__ if self.engine is not None else "asleep"

    def generate(self, prompts: list[list[int]], params) -> tuple[list[list[int]], list[bool], Optional[list]]:
        """Responses (stop token included), finished flags and the engine's log-probs of the sampled
        tokens (None unless ``params.return_logprobs``), samples of a prompt consecutive."""
        if self.engine is None:
            self.engine = self._build()
        out = self.engine.generate(prompts, params)
        return out.response_ids, out.finished, out.logprobs

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
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
        if self.cfg.distributed.rollout_sleep:
            self.engine = None
