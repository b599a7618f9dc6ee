"""`turborlhf rm`: pairwise Bradley-Terry reward model (Ouyang et al. 2022, Eq. 1).

    loss = mean_pairs[-log σ(r_chosen - r_rejected - margin)]   (+ c·mean((r_c + r_r)^2), TRL)

The model is a causal-LM backbone with a scalar head (`AutoModelForSequenceClassification`,
num_labels=1) read at the EOS token. Chosen and rejected sequences of a micro-batch go through
one forward pass; the LM head is never computed. The exported directory loads with
``AutoModelForSequenceClassification.from_pretrained``.

    turborlhf rm --config configs/tiny/rm.yaml
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from turborlhf.algo import pairwise_rm_loss
from turborlhf.config import RMConfig
from turborlhf.data.jsonl import file_sha256
from turborlhf.data.loaders import load_pairs
from turborlhf.engine.checkpoint import PlanDigest, record_export_config, restore, save_checkpoint, trainer_state
from turborlhf.engine.lifecycle import checkpointed_steps, eval_due, log_due, run_to_end, start_run
from turborlhf.engine.run import export_model, plan_steps, print_batch_table, resolve_hardware
from turborlhf.engine.train import (clip_and_step, count_parameters, make_optimizer, make_scheduler,
                                    seed_everything, set_threads)
from turborlhf.metrics import M, MetricsLogger, tracker_kwargs
from turborlhf.models.forward import packed_pair_len
from turborlhf.models.load import backbone_of, load_tokenizer, load_trainable
from turborlhf.rewards.model import encode_pairs, pair_row_len, pair_scores

__all__ = ["phases", "plan_pair_steps", "train", "train_steps", "evaluate_pairs", "score_pairs", "summarize_scores"]

logger = logging.getLogger(__name__)


def phases(cfg: RMConfig) -> tuple[str, ...]:
    """The memory phases of one optimizer step, in order (`turborlhf plan` sizes each one and refuses a config whose phases it does not model)."""
    return ("train", "optimizer step")


@torch.no_grad()
def score_pairs(model, tokenizer, encoded: list[dict], dtype: str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_N, rejected_N) fp32 scores of N encoded pairs, in their order, batched by the length
    of the rows `pair_scores` builds (`pair_row_len`). (Sorted by the pairs' summed lengths, the
    demo's 184 held-out pairs were padded by 18% instead of 4%.)"""
    was_training = model.training
    model.eval()
    order = sorted(range(len(encoded)), key=lambda i: pair_row_len(model, encoded[i]))
    ch, rj = torch.empty(len(encoded)), torch.empty(len(encoded))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        c, r = pair_scores(model, tokenizer, [encoded[i] for i in idx], dtype)
        ch[idx], rj[idx] = c.float(), r.float()
    model.train(was_training)
    return ch, rj


def evaluate_pairs(model, tokenizer, encoded: list[dict], dtype: str, batch_size: int,
                   use_margin: bool = False) -> dict:
    """Accuracy (strict >, ties wrong), mean loss and margin, and score mean/std over pairs; the
    loss with each pair's ``margin`` where `use_margin` (``train.margin``) and every pair has one."""
    return summarize_scores(*score_pairs(model, tokenizer, encoded, dtype, batch_size),
                            pair_margins(encoded, use_margin))


def pair_margins(encoded: list[dict], use_margin: bool) -> Optional[torch.Tensor]:
    """The pairs' ``margin`` fields as an N tensor, or None (not asked for, or a pair lacks one)."""
    if not use_margin or any(e.get("margin") is None for e in encoded):
        return None
    return torch.tensor([float(e["margin"]) for e in encoded])


def summarize_scores(ch: torch.Tensor, rj: torch.Tensor, margin: Optional[torch.Tensor] = None) -> dict:
    """Accuracy (strict >, ties wrong), mean loss (−log σ(rc − rr − margin), the training loss
    without its centering term) and mean score difference, score mean/std of (chosen_N, rejected_N)."""
    loss, stats = pairwise_rm_loss(ch, rj, margin)
    both = torch.cat([ch, rj])
    return {"accuracy": float((ch > rj).float().mean()), "loss": float(loss.mean()),
            "margin": float((ch - rj).mean()), "score_mean": float(both.mean()), "score_std": float(both.std()),
            "n": len(ch)}


def plan_pair_steps(encoded: list[dict], loop) -> list[list[int]]:
    """`plan_steps` over the pairs' packed row lengths (`pair_scores` packs each pair as one row,
    its prompt once), each step's pairs in increasing packed length, so the micro-batches cut
    from a step hold rows of similar length. `loop`: the config's ``train`` section."""
    lens = [packed_pair_len(e["chosen"], e["rejected"]) for e in encoded]
    plan = plan_steps(lens, loop.pairs_per_step, loop.epochs, loop.max_steps, loop.seed)
    return [sorted(step, key=lambda i: lens[i]) for step in plan]


def train(cfg: RMConfig, resume: bool = False) -> Path:
    """`turborlhf rm`: the whole run (`train_steps` to its end); returns the output directory."""
    return run_to_end(train_steps(cfg, resume))


def train_steps(cfg: RMConfig, resume: bool = False) -> Iterator[tuple[int, int, dict]]:
    """`train` as a generator: yields ``(done, total, metrics)`` after each optimizer step (``done``:
    steps finished, 1-based, of ``total``; ``metrics``: that step's, logged or not); the final evaluation,
    checkpoint and export run when it is resumed after the last step; returns the output directory."""
    # 1. run directory, threads, seed
    cfg = resolve_hardware(cfg, "rm")      # device and precision: auto → this host's choice
    out, ckpt = start_run(cfg, resume, "rm")
    set_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    loop = cfg.train

    # 2. tokenizer; pairs → token ids (read and checked before any model loads); deterministic plan
    tok = load_tokenizer(cfg.model.name_or_path)
    pairs = load_pairs(cfg.data.train_file, tok, **cfg.data.loader_kwargs())
    if cfg.data.max_samples:
        pairs = pairs[:cfg.data.max_samples]
    train_enc = encode_pairs(tok, pairs, cfg.data.max_len, tag="rm")
    test_pairs = load_pairs(cfg.data.test_file, tok, **cfg.data.loader_kwargs()) if cfg.data.test_file else []
    if cfg.data.max_test_samples:
        test_pairs = test_pairs[:cfg.data.max_test_samples]
    test_enc = encode_pairs(tok, test_pairs, cfg.data.max_len)
    plan = plan_pair_steps(train_enc, loop)

    # 3. scalar model (new head on a causal LM, or a saved RM to continue)
    model = load_trainable("scalar", cfg.model, tok, ckpt_dir=ckpt / "reward_model" if ckpt else None)
    if loop.freeze_embeddings:
        backbone_of(model).get_input_embeddings().weight.requires_grad_(False)
    print_batch_table("rm", [("pairs", len(train_enc)), ("pairs_per_step", loop.pairs_per_step),
                             ("micro_batch_size (pairs)", loop.micro_batch_size), ("optimizer_steps", len(plan)),
                             ("trainable_params", count_parameters(model, trainable_only=True))])

    # 4. optimizer, schedule, resume state
    optim = make_optimizer(model, cfg.optim)
    sched = make_scheduler(optim, cfg.optim, len(plan))
    steps_digest = PlanDigest(plan, train_enc)      # resuming with other data or batches is refused
    start = restore(ckpt, optim, sched, "rm", steps_digest)
    log = MetricsLogger(out, "rm", len(plan), show=(M.LOSS, M.RM_ACC, M.EVAL_ACC, M.LR), **tracker_kwargs(cfg),
                        progress=cfg.log.progress, resume=bool(ckpt), start_step=start)
    try:
        def checkpoint(step: int) -> Path:
            return save_checkpoint(out, step, {"reward_model": model}, tok,
                                   trainer_state(optim, sched, step, steps_digest),
                                   keep=loop.keep_checkpoints)

        # 5. training loop: per-pair losses summed over micro-batches, divided by pairs_per_step
        for step in checkpointed_steps(start, len(plan), checkpoint, loop.save_every, "rm"):
            t0 = time.perf_counter()
            batch = [train_enc[i] for i in plan[step]]
            n_pairs = len(batch)
            loss_sum, correct, margin_sum = 0.0, 0.0, 0.0
            for s in range(0, n_pairs, loop.micro_batch_size):
                mb = batch[s:s + loop.micro_batch_size]
                ch, rj = pair_scores(model, tok, mb, cfg.model.dtype)
                margin = torch.tensor([e["margin"] for e in mb]) if loop.margin else None
                loss_B, stats = pairwise_rm_loss(ch, rj, margin, center_coef=loop.center_rewards_coef)
                (loss_B.sum() / n_pairs).backward()
                loss_sum += float(loss_B.detach().sum())
                correct += float((ch > rj).float().sum().detach())
                margin_sum += float((ch - rj).detach().sum())
            lr = sched.get_last_lr()[0]
            gnorm = clip_and_step(model, optim, sched, cfg.optim.max_grad_norm)
            dt = time.perf_counter() - t0
            n_tok = sum(len(e["chosen"]) + len(e["rejected"]) for e in batch)
            metrics = {M.LOSS: loss_sum / n_pairs, M.RM_ACC: correct / n_pairs, M.RM_MARGIN: margin_sum / n_pairs,
                       M.LR: lr, M.GRAD_NORM: gnorm, M.TOKENS_PER_S: n_tok / dt, M.T_STEP: dt}
            done = step + 1
            evaluated = eval_due(done, len(plan), loop.eval_every, bool(test_enc))
            if evaluated:
                ev = evaluate_pairs(model, tok, test_enc, cfg.model.dtype, 2 * loop.micro_batch_size, loop.margin)
                metrics[M.EVAL_ACC], metrics[M.EVAL_LOSS] = ev["accuracy"], ev["loss"]
            if log_due(done, len(plan), cfg.log.every, evaluated):
                log.log(done, metrics)
            yield done, len(plan), metrics

        # 6. (the loop wrote the last step's checkpoint: a signal during the evaluation finds it) final
        #    evaluation (stored in the model config as reward_mean/std, like OpenRLHF, and noted in that
        #    checkpoint, whose export by `turborlhf export` gets them too; without a test set there are
        #    none: `load_trainable` dropped those of a reward model the run started from), export
        extra = {}
        if test_enc:
            from turborlhf.evaluate import length_strata

            ch, rj = score_pairs(model, tok, test_enc, cfg.model.dtype, 2 * loop.micro_batch_size)
            ev = summarize_scores(ch, rj, pair_margins(test_enc, loop.margin))
            # eval-rm's fields, so the pipeline's evaluation reads this file instead of scoring the pairs again
            ev.update({"length": length_strata(test_pairs, (ch > rj).tolist()), "data": str(cfg.data.test_file),
                       # a file's content digest (a Dataset, a save_to_disk directory or a hub id has none)
                       "data_sha256": (file_sha256(cfg.data.test_file) if Path(str(cfg.data.test_file)).is_file()
                                       else None),
                       "max_len": cfg.data.max_len})
            log.log(len(plan), {M.EVAL_ACC: ev["accuracy"], M.EVAL_LOSS: ev["loss"]})
            extra = {"reward_mean": ev["score_mean"], "reward_std": ev["score_std"]}
            record_export_config(out, len(plan), "reward_model", extra)
            (out / "eval.json").write_text(__import__("json").dumps(ev, indent=2))
            logger.info(f"[rm] test accuracy {ev['accuracy']:.3f} on {ev['n']} pairs")
        export_model(model, tok, out, extra_config=extra)
    finally:
        log.close()   # trackers and callbacks end whatever stops the run
    logger.info(f"[rm] saved reward model to {out}")
    return out
