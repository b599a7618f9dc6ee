"""`turborlhf conditional-sft`: reward-conditioned SFT (Hu et al. 2023, "Aligning Language Models
with Offline Learning from Human Feedback", arXiv 2308.12050; the idea of SteerLM, Dong et al. 2023).

1. score every training response with the reward model, s_i = r(x_i, y_i) — for preference pairs
   both the chosen AND the rejected response become examples, so the policy also sees what a
   low score looks like; with `data.policy_samples_per_prompt` the starting policy's own samples
   for the same prompts join them (on-policy examples, as SteerLM's bootstrapping round), or
   replace them with ``data.dataset_responses=false``;
2. bin the scores: edges e_1 < … < e_{K-1} (score quantiles q = k/K, or equal widths over
   [min s, max s]); bin k_i = #{m : e_m ≤ s_i} ∈ {0 … K-1}, monotone in s (higher = better);
3. tag the prompt with its bin, x̃_i = insert(x_i, format(k_i)), the default tag ``<rm_score>=k``
   going to the end of the last user message (see `condition_prompt` for the three placements);
4. SFT on (x̃_i, y_i) with the loss of `turborlhf sft` (token-mean NLL of response tokens,
   `trainers.common.sft_loss_on_batch`): the model learns p(y | x, k);
5. generate with the best tag k* = K-1 (or `tags.generation_bin`): sampling p(y | x, k*).

The mapping (format, placement, bin edges, best tag, chat-template anchors) is written to
``<output_dir>/conditional_sft.json``; `condition_prompt(prompt_text, tag_info)` reproduces the
conditioning anywhere (evaluation: `evaluate_conditional`). Scores and bins of every example are
in ``<output_dir>/scored.jsonl`` (a resumed run reuses them instead of scoring again).

    turborlhf conditional-sft --config configs/tiny/conditional_sft.yaml
"""
from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from turborlhf.config import ConditionalSFTConfig
from turborlhf.errors import RunError
from turborlhf.data.conditioning import TAG_FILE, chat_anchors, condition_prompt, load_tag_info
from turborlhf.data.jsonl import read_jsonl, write_jsonl
from turborlhf.data.chat import set_chat_template, stop_ids
from turborlhf.data.loaders import load_pairs, load_sft
from turborlhf.data.sources import open_rows
from turborlhf.data.tokenize import encode_examples, encode_prompts
from turborlhf.engine.checkpoint import atomic_write_text, check_plan, plan_digest
from turborlhf.engine.lifecycle import start_run
from turborlhf.engine.run import plan_steps, print_batch_table, resolve_hardware
from turborlhf.engine.train import seed_everything, set_threads
from turborlhf.evaluate import eval_policy
from turborlhf.models.load import load_tokenizer, load_trainable, merge_lora_for_save
from turborlhf.rewards.model import load_reward_model, score_texts
from turborlhf.rollout import make_engine
from turborlhf.rollout.backends import vllm_kwargs
from turborlhf.rollout.base import SamplingParams
from turborlhf.trainers.common import fit

__all__ = ["phases", "train", "bin_edges", "score_bins", "chat_anchors", "condition_prompt", "make_tag_info",
           "load_tag_info", "load_examples", "sample_policy_examples", "evaluate_conditional", "TAG_FILE"]

logger = logging.getLogger(__name__)


def phases(cfg: ConditionalSFTConfig) -> tuple[str, ...]:
    """The memory phases of the run, in order (`turborlhf plan` sizes each one and refuses a config whose phases it does not model): scoring every
    example once with the reward model (then freed), then the SFT loop's forward/backward and step."""
    return ("score (once)", "train", "optimizer step")

# ----------------------------------------------------------------------------------------------
# Score → bin (pure)
# ----------------------------------------------------------------------------------------------

def _quantile_edges(scores_B: torch.Tensor, n_bins: int) -> torch.Tensor:
    q = torch.arange(1, n_bins, dtype=torch.float64) / n_bins
    return torch.quantile(scores_B.double(), q)


def _uniform_edges(scores_B: torch.Tensor, n_bins: int) -> torch.Tensor:
    lo, hi = float(scores_B.min()), float(scores_B.max())
    return torch.linspace(lo, hi, n_bins + 1, dtype=torch.float64)[1:-1]


BINNINGS = {"quantile": _quantile_edges, "uniform": _uniform_edges}


def bin_edges(scores_B: torch.Tensor, n_bins: int, binning: str = "quantile") -> list[float]:
    """The K-1 inner edges e_1 ≤ … ≤ e_{K-1} (K = n_bins) of the score bins.

    binning: 'quantile' (e_k = k/K-quantile of scores_B, linear interpolation: equal counts) or
    'uniform' (equal widths over [min, max]). Raises ValueError for an unknown binning, K < 2,
    an empty `scores_B` or a NaN in it.
    """
    if binning not in BINNINGS:
        raise ValueError(f"unknown binning {binning!r}; choose one of {sorted(BINNINGS)}")
    if n_bins < 2 or scores_B.numel() == 0:
        raise ValueError(f"need n_bins >= 2 and at least one score, got {n_bins} and {scores_B.numel()}")
    if bool(torch.isnan(scores_B).any()):
        raise ValueError("a NaN score has no bin (its edges would all be NaN)")
    return [float(e) for e in BINNINGS[binning](scores_B.flatten(), n_bins)]


def _without_nan_scores(rows: list[dict], scores_B: torch.Tensor) -> tuple[list[dict], torch.Tensor]:
    """`rows` and their scores without those the reward model scored NaN, with a warning (a NaN made
    every bin edge NaN, which put every example in the best bin); `RunError` if none is left."""
    nan = torch.isnan(scores_B)
    if not bool(nan.any()):
        return rows, scores_B
    if bool(nan.all()):
        raise RunError(f"conditional SFT: the reward model scored all {len(rows)} examples NaN")
    logger.warning(f"[csft] the reward model scored {int(nan.sum())} of {len(rows)} examples NaN; they are left out")
    keep = (~nan).nonzero().flatten().tolist()
    return [rows[i] for i in keep], scores_B[keep]


def score_bins(scores_B: torch.Tensor, edges: list[float]) -> torch.Tensor:
    """Bin index k_i = #{m : e_m ≤ s_i} ∈ {0 … len(edges)} of each score (LongTensor ``B``);
    non-decreasing in the score. Raises ValueError if `edges` are not sorted."""
    e = torch.tensor(edges, dtype=torch.float64)
    if len(edges) > 1 and bool((e[1:] < e[:-1]).any()):
        raise ValueError(f"edges must be sorted, got {edges}")
    return torch.searchsorted(e, scores_B.double().contiguous(), right=True)


def make_tag_info(tags_cfg, edges: list[float], anchors: dict, scores_B: torch.Tensor, bins_B: torch.Tensor) -> dict:
    """The saved mapping: format, placement, edges, best (generation) bin and its tag, and the count
    and mean score of every bin. Raises ValueError if `generation_bin` ≥ n_bins."""
    K = tags_cfg.n_bins
    best = K - 1 if tags_cfg.generation_bin is None else tags_cfg.generation_bin
    if best >= K:
        raise ValueError(f"tags.generation_bin={best} must be < tags.n_bins={K}")
    counts = [int((bins_B == k).sum()) for k in range(K)]
    means = [float(scores_B[bins_B == k].mean()) if counts[k] else None for k in range(K)]
    return {"format": tags_cfg.format, "position": tags_cfg.position, "separator": tags_cfg.separator,
            "binning": tags_cfg.binning, "n_bins": K, "bin_edges": edges, "best_bin": best,
            "best_tag": tags_cfg.format.replace("{k}", str(best)), "anchors": anchors,
            "bin_counts": counts, "bin_score_means": means,
            "score_stats": {"mean": float(scores_B.mean()), "std": float(scores_B.std()) if len(scores_B) > 1 else 0.0,
                            "min": float(scores_B.min()), "max": float(scores_B.max()), "n": len(scores_B)}}


# ----------------------------------------------------------------------------------------------
# 1-2. Data and scores
# ----------------------------------------------------------------------------------------------

def _is_pair_file(path: str, rejected_key: str = "rejected") -> bool:
    for _, obj in open_rows(path)[1]:
        if isinstance(obj, dict):
            return rejected_key in obj
    return False


def load_examples(path: str, tok, max_samples: int = 0, **loader_kwargs) -> list[dict]:
    """``[{prompt, response, source}]``: both responses of every pair (source chosen/rejected) of a
    pair-format or raw HH file, or the examples of an SFT file (source sft). `max_samples` caps the
    lines' records (pairs or examples) before the expansion; `loader_kwargs`: `keys`, `chat_template`."""
    if _is_pair_file(path, (loader_kwargs.get("keys") or {}).get("rejected", "rejected")):
        pairs = load_pairs(path, tok, **loader_kwargs)
        pairs = pairs[:max_samples] if max_samples else pairs
        return [{"prompt": p["prompt"], "response": p[s], "source": s} for p in pairs for s in ("chosen", "rejected")]
    rows = load_sft(path, tok, **loader_kwargs)
    rows = rows[:max_samples] if max_samples else rows
    return [{"prompt": r["prompt"], "response": r["response"], "source": "sft"} for r in rows]


def sample_policy_examples(model, tok, prompts: list[str], cfg: ConditionalSFTConfig) -> list[dict]:
    """``data.policy_samples_per_prompt`` responses per prompt from `model` (the starting policy),
    seeded by ``train.seed``, as ``[{prompt, response, source: "policy", finished}]``: on-policy
    examples, so the tags also separate the policy's own good and bad responses."""
    roll, n = cfg.rollout, cfg.data.policy_samples_per_prompt
    engine = make_engine(roll.engine, merge_lora_for_save(model), dtype=roll.dtype, device=roll.device,    # LoRA merged
                         device_field="rollout.device", weight_dtype=roll.weight_dtype,
                         max_batch_size=roll.batch_size, **vllm_kwargs(roll, shares_gpu=True))
    params = SamplingParams(max_new_tokens=roll.max_new_tokens, min_new_tokens=roll.min_new_tokens,
                            temperature=roll.temperature, top_p=roll.top_p, top_k=roll.top_k,
                            stop_token_ids=stop_ids(tok), n=n, seed=cfg.train.seed)
    try:
        outs = engine.generate(encode_prompts(tok, prompts, roll.max_prompt_len), params)
    finally:
        if hasattr(engine, "close"):     # vLLM keeps its share of the GPU until closed: scoring and SFT need it
            engine.close()
    return [{"prompt": prompts[i // n], "response": tok.decode(r, skip_special_tokens=True), "source": "policy",
             "finished": f} for i, (r, f) in enumerate(zip(outs.response_ids, outs.finished))]


def _score_rows(cfg: ConditionalSFTConfig, sets: list[list[dict]]) -> list[torch.Tensor]:
    """RM scores of every (untagged prompt, response) of each set, EOS appended to every finished
    response; a policy sample cut at max_new_tokens is scored as cut, as `eval-policy` and `ppo`
    score it (closing it with an EOS inflated cut samples' scores, so the best tag taught the
    policy to run to the budget and stop nowhere). The RM is freed afterwards."""
    frozen_dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    rm_tok = load_tokenizer(cfg.reward_model)
    rm = load_reward_model(cfg.reward_model, rm_tok, dtype=frozen_dtype, device=cfg.model.device,
                           device_field="model.device").eval().requires_grad_(False)
    out = [score_texts(rm, rm_tok, [r["prompt"] for r in rows], [r["response"] for r in rows], cfg.data.max_len,
                       cfg.model.dtype, cfg.data.score_batch_size, add_eos=[r.get("finished", True) for r in rows])
           if rows else torch.empty(0) for rows in sets]
    del rm
    return out


def _log_bins(info: dict) -> None:
    logger.info(f"[csft] tags {info['format']!r} at {info['position']}, generation tag {info['best_tag']!r}")
    lo = ["-inf"] + [f"{e:.3f}" for e in info["bin_edges"]]
    hi = [f"{e:.3f}" for e in info["bin_edges"]] + ["inf"]
    for k in range(info["n_bins"]):
        m = info["bin_score_means"][k]
        logger.info(f"  bin {k}: [{lo[k]}, {hi[k]})  n={info['bin_counts'][k]:<5} mean score "
                    f"{'-' if m is None else f'{m:.3f}'}")


def _scored_examples(cfg: ConditionalSFTConfig, tok, policy: Callable, out: Path,
                     reuse: bool) -> tuple[list, list, dict]:
    """Training and test examples with ``score`` and ``bin``, and the tag info; written to
    ``scored.jsonl`` / ``scored_test.jsonl`` / the tag file, or read back from them (`reuse`).
    `policy()` returns the starting policy; it is called only to sample, after the data was read."""
    scored, scored_test = out / "scored.jsonl", out / "scored_test.jsonl"
    rows = load_examples(cfg.data.train_file, tok, cfg.data.max_samples, **cfg.data.loader_kwargs())
    test_rows = (load_examples(cfg.data.test_file, tok, cfg.data.max_test_samples, **cfg.data.loader_kwargs())
                 if cfg.data.test_file else [])
    data_sha256 = plan_digest([list(range(len(rows) + len(test_rows)))], rows + test_rows)
    if reuse and scored.exists() and (out / TAG_FILE).exists():
        info = load_tag_info(out)   # scored before: an edited data file would go unnoticed in the reused scores
        check_plan({"plan_sha256": info.get("data_sha256")}, data_sha256, out, "csft")
        test_rows = [obj for _, obj in read_jsonl(scored_test)] if scored_test.exists() else []
        return [obj for _, obj in read_jsonl(scored)], test_rows, info
    t0 = time.perf_counter()
    if cfg.data.policy_samples_per_prompt:
        prompts = list(dict.fromkeys(r["prompt"] for r in rows))
        samples = sample_policy_examples(policy(), tok, prompts, cfg)
        rows = rows + samples if cfg.data.dataset_responses else samples
        logger.info(f"[csft] sampled {len(prompts)}×{cfg.data.policy_samples_per_prompt} policy responses in "
                    f"{time.perf_counter() - t0:.1f}s")
        t0 = time.perf_counter()
    scores, test_scores = _score_rows(cfg, [rows, test_rows])
    logger.info(f"[csft] scored {len(rows) + len(test_rows)} responses in {time.perf_counter() - t0:.1f}s")
    (rows, scores), (test_rows, test_scores) = _without_nan_scores(rows, scores), _without_nan_scores(test_rows,
                                                                                                    test_scores)
    edges = bin_edges(scores, cfg.tags.n_bins, cfg.tags.binning)
    bins, test_bins = score_bins(scores, edges), score_bins(test_scores, edges)
    info = make_tag_info(cfg.tags, edges, chat_anchors(tok), scores, bins)
    info.update({"reward_model": cfg.reward_model, "train_file": cfg.data.train_file, "data_sha256": data_sha256})
    for rs, ss, bs in ((rows, scores, bins), (test_rows, test_scores, test_bins)):
        for r, s, b in zip(rs, ss.tolist(), bs.tolist()):
            r.update({"score": s, "bin": b})
    write_jsonl(scored, rows)
    if test_rows:
        write_jsonl(scored_test, test_rows)
    else:                       # an earlier run's test set must not come back on --resume
        scored_test.unlink(missing_ok=True)
    info["example"] = condition_prompt(rows[0]["prompt"], info)
    atomic_write_text(out / TAG_FILE, json.dumps(info, indent=2))
    return rows, test_rows, info


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

def train(cfg: ConditionalSFTConfig, resume: bool = False) -> Path:
    # 1. run directory, threads, seed
    cfg = resolve_hardware(cfg, "conditional-sft")      # device and precision: auto → this host's choice
    out, ckpt = start_run(cfg, resume, "csft")
    set_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    loop = cfg.train

    # 2. tokenizer; the policy, loaded when first needed (after the data was read and checked)
    tok = load_tokenizer(cfg.model.name_or_path)
    set_chat_template(tok, cfg.data.chat_template)   # also on resume, where the data is not loaded again
    policy = functools.cache(lambda: load_trainable("causal", cfg.model, tok,
                                                    ckpt_dir=ckpt / "policy" if ckpt else None))

    # 3. examples (data responses, optionally the policy's own samples), their scores on the
    #    untagged prompts and their bins: computed once, reused on resume
    rows, test_rows, info = _scored_examples(cfg, tok, policy, out, reuse=bool(ckpt))
    model = policy()
    _log_bins(info)

    # 4. tagged prompts → token ids + response masks (as `sft.encode_examples`; a policy sample cut
    #    at max_new_tokens gets no EOS); a deterministic plan of optimizer steps
    def tagged(rs: list[dict]) -> list[dict]:
        return [{"prompt": condition_prompt(r["prompt"], info, r["bin"]), "response": r["response"],
                 "finished": r.get("finished", True)} for r in rs]

    train_enc = encode_examples(tok, tagged(rows), cfg.data.max_len)
    test_enc = encode_examples(tok, tagged(test_rows), cfg.data.max_len)
    plan = plan_steps([len(e["input_ids"]) for e in train_enc], loop.sequences_per_step,
                      loop.epochs, loop.max_steps, loop.seed)
    print_batch_table("csft", [("examples", len(train_enc)), ("sequences_per_step", loop.sequences_per_step),
                               ("micro_batch_size", loop.micro_batch_size), ("optimizer_steps", len(plan))])

    # 5-7. the SFT loop of `turborlhf sft` (micro-batches share the step's token count; resumable
    #      checkpoints; final tagged NLL; exported HF model, the tag mapping beside it)
    fit(cfg, model, tok, train_enc, test_enc, plan, out, ckpt, "csft")
    logger.info(f"[csft] saved policy and {TAG_FILE} to {out}")
    return out


# ----------------------------------------------------------------------------------------------
# Evaluation with the best tag
# ----------------------------------------------------------------------------------------------

def evaluate_conditional(policy_dir: str, reward_model_dir: str, prompts_file: str, n: int = 64,
                         max_new_tokens: int = 64, temperature: float = 0.7, top_p: float = 0.9, seed: int = 1234,
                         engine: str = "auto", reference_dir: Optional[str] = None,
                         samples_out: Optional[str] = None, tag_bin: Optional[int] = None) -> dict:
    """`turborlhf.evaluate.eval_policy` (= `turborlhf eval-policy`) for a conditional-SFT policy:
    prompts are conditioned with the tag of bin `tag_bin` (default: the best bin of
    ``<policy_dir>/conditional_sft.json``) before generation; the reward model and the reference
    see the untagged prompt, and a response cut at `max_new_tokens` is scored as cut. Returns
    eval_policy's keys plus ``tag`` and ``tag_bin``. Raises FileNotFoundError without the tag file.
    """
    if not (Path(policy_dir) / TAG_FILE).exists():
        raise FileNotFoundError(f"{policy_dir}/{TAG_FILE} not found: not a conditional-SFT policy directory")
    return eval_policy(policy_dir, reward_model_dir, prompts_file, n, max_new_tokens, temperature, top_p, seed, engine,
                       reference_dir, samples_out, tag_bin=tag_bin, use_tag=True)
