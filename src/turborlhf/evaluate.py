"""`turborlhf eval-rm` and `turborlhf eval-policy`: machine-readable evaluation.

    turborlhf eval-rm --model runs/demo/rm --data pairs.jsonl.gz --json
    → {"accuracy": 0.63, "n": 180, "loss": ..., "margin": ..., "length": {"shorter_wins": ...}, ...}

    turborlhf eval-policy --policy runs/demo/ppo --reward-model runs/demo/rm --prompts prompts.jsonl --json
    → {"reward_mean": ..., "reward_std": ..., "n": 64, "response_length_mean": ..., ...}

With ``--json`` stdout carries exactly one JSON object (its last line); logs go to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

__all__ = ["main", "eval_rm", "eval_policy", "eval_policy_pair", "sample_policy", "PolicySamples"]

logger = logging.getLogger(__name__)


def eval_rm(model_dir: str, data: str, max_len: int = 1024, batch_size: int = 8, limit: int = 0,
            dtype: str = "auto", device: str = "auto", device_field: str = "device") -> dict:
    """Accuracy (strict >) of a reward model on preference pairs (raw HH or pair format), with the
    length baseline of the same pairs (``length``, see `length_strata`). `dtype`/`device`: as a
    trainer's ``model.dtype``/``model.device`` (``auto``: this host's choice, README: Hardware);
    `device_field`: the setting `device` came from, which a `HardwareError` names."""
    from turborlhf.data.loaders import load_pairs
    from turborlhf.engine.hardware import compute_dtype
    from turborlhf.engine.train import set_threads
    from turborlhf.models.load import load_tokenizer
    from turborlhf.rewards.model import encode_pairs, load_reward_model
    from turborlhf.trainers.reward_model import score_pairs, summarize_scores

    set_threads()
    t0 = time.perf_counter()
    tok = load_tokenizer(model_dir)
    model = load_reward_model(model_dir, tok, device=device, device_field=device_field)
    dev = next(model.parameters()).device
    dtype = compute_dtype(dtype, dev)
    pairs = load_pairs(data, tok)
    if limit:
        pairs = pairs[:limit]
    ch, rj = score_pairs(model, tok, encode_pairs(tok, pairs, max_len), dtype, batch_size)
    res = summarize_scores(ch, rj)
    res["length"] = length_strata(pairs, (ch > rj).tolist())
    res.update({"model": model_dir, "data": data, "seconds": round(time.perf_counter() - t0, 2),
                "hardware": {"dtype": dtype, "device": str(dev)}})    # what auto resolved to
    return res


def length_strata(pairs: list[dict], correct: list[bool]) -> dict:
    """How a set's accuracy depends on response length, so sets that differ in it compare.

    On HH-RLHF "the shorter response wins" is a real signal (issue 2 quotes 0.57 on its held-out
    pairs), and a reward model learns it; a set where it is weaker is harder for every model.
    Lengths are response characters. Returns ``shorter_wins`` (that baseline's accuracy: strict
    <, ties wrong), ``n_chosen_shorter``, and the model's accuracy on the pairs whose chosen
    response is shorter (``accuracy_chosen_shorter``) and on the others (``accuracy_chosen_not_shorter``;
    None for an empty stratum).
    """
    shorter = [len(p["chosen"]) < len(p["rejected"]) for p in pairs]

    def acc(want: bool):
        hits = [c for c, s in zip(correct, shorter) if s == want]
        return sum(hits) / len(hits) if hits else None

    return {"shorter_wins": sum(shorter) / len(shorter) if shorter else None, "n_chosen_shorter": sum(shorter),
            "accuracy_chosen_shorter": acc(True), "accuracy_chosen_not_shorter": acc(False)}


def check_context(config, ids: list[list[int]], max_new_tokens: int) -> None:
    """Raises UserError when the longest of the prompts `ids` plus `max_new_tokens` exceeds the
    model's context (``config.max_position_embeddings``; no check where the config has none)."""
    from turborlhf.errors import UserError

    ctx = getattr(config, "max_position_embeddings", None)
    longest = max(map(len, ids), default=0)
    if ctx and longest + max_new_tokens > ctx:
        raise UserError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                        f"policy's context ({ctx} positions): cut the prompts shorter (max_prompt_len) or lower "
                        "the new-token limit")


def prompt_budget(config, max_prompt_len: Optional[int], max_new_tokens: int) -> int:
    """`max_prompt_len`, or where None the model's context (``config.max_position_embeddings``)
    less `max_new_tokens` (1024 without one): prompts cut from the left to it always fit. Raises
    UserError when `max_new_tokens` leaves no room for a prompt."""
    from turborlhf.errors import UserError

    if max_prompt_len is not None:
        return max_prompt_len
    ctx = getattr(config, "max_position_embeddings", None)
    if not ctx:
        return 1024
    if max_new_tokens >= ctx:
        raise UserError(f"max_new_tokens ({max_new_tokens}) leaves no room for a prompt in the model's context "
                        f"({ctx} positions)")
    return ctx - max_new_tokens


def generate_responses(policy, tok, prompts: list[str], max_new_tokens: int, temperature: float, top_p: float,
                       seed: int, engine: str = "auto", max_prompt_len: int = 256, batch_size: int = 32,
                       dtype: str = "auto", device="cpu", tool=None, raw_logprobs: bool = False,
                       used: Optional[dict] = None, device_field: str = "device") -> tuple:
    """Seeded generation for text prompts → (prompt_ids, response_ids, finished, logprobs); `dtype`
    and `device` are the engine's (``auto``: bf16 where native, else fp32; `make_engine`, whose
    `HardwareError` names `device_field`, the setting `device` came from); `tool`: a
    rollout tool (`turborlhf.rollout.tools`) or None; `raw_logprobs`: logprobs holds the engine's
    temperature-1 log-prob of each response token (``raw_logprobs``), else it is None. `used`, if
    given, receives the engine's class, precision and device (`engine_record`), for the result.
    Raises UserError when the longest prompt plus `max_new_tokens` exceeds the policy's context."""
    from transformers import AutoConfig

    from turborlhf.data.chat import stop_ids
    from turborlhf.data.tokenize import encode_prompts
    from turborlhf.errors import UserError
    from turborlhf.rollout import make_engine
    from turborlhf.rollout.base import SamplingParams

    ids = encode_prompts(tok, prompts, max_prompt_len)
    check_context(policy.config if hasattr(policy, "config") else AutoConfig.from_pretrained(str(policy)), ids,
                  max_new_tokens)
    eng = make_engine(engine, policy, dtype=dtype, device=device, device_field=device_field, max_batch_size=batch_size)
    if used is not None:
        used.update(engine_record(eng))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            stop_token_ids=stop_ids(tok), seed=seed, return_logprobs=raw_logprobs,
                            logprobs_mode="raw_logprobs")
    t0 = time.perf_counter()
    logger.info(f"[generate] {len(ids)} prompts, batches of {batch_size}...")
    # one call: the engine batches the prompts by length (less padding than fixed chunks)
    out = eng.generate(ids, params, tool=tool) if tool is not None else eng.generate(ids, params)
    dt = time.perf_counter() - t0
    if hasattr(eng, "close"):     # vLLM keeps its share of the GPU until closed: the scoring models need it
        eng.close()
    n_tok = sum(len(r) for r in out.response_ids)
    logger.info(f"[generate] {len(ids)} prompts, {n_tok} tokens in {dt:.0f}s ({n_tok / max(dt, 1e-9):.0f} tok/s)")
    return ids, out.response_ids, out.finished, out.logprobs


_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16"}


def engine_record(eng) -> dict:
    """What a rollout engine resolved ``auto`` to: ``{"engine", "dtype", "device"}`` (a result's
    ``hardware.rollout``; README: Hardware)."""
    dt = str(getattr(eng, "dtype", ""))
    return {"engine": type(eng).__name__, "dtype": _DTYPE_NAMES.get(dt, dt),
            "device": str(getattr(eng, "device", "cpu"))}


@dataclasses.dataclass
class PolicySamples:
    """One policy's seeded samples on the evaluation prompts (`sample_policy`): the untagged
    prompts, the prompts it generated from (tagged for a conditional-SFT policy), token ids, EOS
    flags, the engine's temperature-1 log-probs (or None), decoded texts, and the policy model
    (kept only where a KL forward still needs it). ``plain_prompt_ids``: the untagged prompts cut
    as the policy's were (what PPO's reward model and reference read), ``prompt_ids`` with no tag."""
    policy_dir: str
    prompts: list
    gen_prompts: list
    prompt_ids: list
    plain_prompt_ids: list
    tokenizer: object
    response_ids: list
    finished: list
    engine_logprobs: Optional[list]
    texts: list
    tag: Optional[dict]
    generate_seconds: float
    model: object = None
    rollout_hardware: dict = dataclasses.field(default_factory=dict)     # `engine_record` of the engine


def sample_policy(policy_dir: str, prompts_file: str, n: int, max_new_tokens: int, temperature: float, top_p: float,
                  seed: int, engine: str, dtype: str, device, kl_wanted: bool = False, tag_bin: Optional[int] = None,
                  use_tag: bool = True, max_prompt_len: int = 256) -> PolicySamples:
    """Generate for the first `n` prompts of `prompts_file` (`eval_policy`'s sampling half).
    `dtype`: already resolved (``bf16``/``fp32``); `device`: a ``torch.device``. With `kl_wanted`
    an fp32 engine returns its temperature-1 log-probs (the policy's side of the KL); where it
    cannot, the policy model is kept in `PolicySamples.model` for a forward. Prompts are cut from
    the left to `max_prompt_len` tokens (``rollout.max_prompt_len``'s default), as PPO's rollout
    cuts them."""
    from turborlhf.data.conditioning import TAG_FILE, condition_prompt, load_tag_info
    from turborlhf.data.loaders import load_prompts
    from turborlhf.data.tokenize import encode_prompts
    from turborlhf.engine.hardware import compute_dtype
    from turborlhf.errors import UserError
    from turborlhf.models.load import load_causal_lm, load_tokenizer

    t0 = time.perf_counter()
    info = load_tag_info(policy_dir) if use_tag and (Path(policy_dir) / TAG_FILE).exists() else None
    if tag_bin is not None and (info is None or not 0 <= tag_bin < info["n_bins"]):      # before any model loads
        why = ("--no-tag generates untagged" if not use_tag else
               f"{policy_dir} has no {TAG_FILE} (not a conditional-SFT policy)" if info is None else
               f"the policy's bins are 0 … {info['n_bins'] - 1}")
        raise UserError(f"--tag-bin {tag_bin}: {why}")
    tok = load_tokenizer(policy_dir)
    # vLLM sizes its share of the GPU from the memory free at its start: the policy's fp32 copy waits
    # on the CPU (its weights are pushed from there) and moves to `device` only for a KL forward
    policy = load_causal_lm(policy_dir, tok, device="cpu" if engine == "vllm" else device)
    prompts = load_prompts(prompts_file, tok)[:n]
    tag = None
    gen_prompts = prompts
    if info is not None:
        k = info["best_bin"] if tag_bin is None else tag_bin
        tag = {"tag": info["format"].replace("{k}", str(k)), "tag_bin": k}
        gen_prompts = [condition_prompt(p, info, k) for p in prompts]
        logger.info(f"[eval-policy] conditional-SFT policy: generating with tag {tag['tag']}")
    if engine == "vllm":
        from turborlhf.rollout.backends import vllm_device_type
        gen_dtype = compute_dtype(dtype, vllm_device_type())
    else:
        gen_dtype = compute_dtype(dtype, device.type)
    # the policy's side of the KL: an fp32 engine's temperature-1 log-probs of its samples are the
    # policy forward's (the weight-sync check measures them equal to ~1e-6) and save that forward; a
    # bf16 engine rounds differently from the scoring models, so they score both sides there
    engine_logps = kl_wanted and gen_dtype == "fp32" and engine != "vllm"
    used: dict = {}
    p_ids, r_ids, fin, r_logps = generate_responses(policy, tok, gen_prompts, max_new_tokens, temperature, top_p, seed,
                                                    engine, max_prompt_len, dtype=gen_dtype, device=device,
                                                    raw_logprobs=engine_logps, used=used)
    plain = p_ids if tag is None else encode_prompts(tok, prompts, max_prompt_len)
    texts = [tok.decode(r, skip_special_tokens=True) for r in r_ids]
    keep = kl_wanted and r_logps is None
    if keep:        # loaded on the CPU for vLLM: the attention for where it computes now
        from turborlhf.models.attention import attention_for_compute_device

        policy = attention_for_compute_device(policy.to(device), device)
    return PolicySamples(policy_dir, prompts, gen_prompts, p_ids, plain, tok, r_ids, fin, r_logps, texts, tag,
                         time.perf_counter() - t0, policy if keep else None, used)


def _reward_sequences(rm_tok, s: PolicySamples) -> list[list[int]]:
    """The reward model's token ids of each (untagged prompt, response), exactly as PPO's reward
    model reads them (`turborlhf.rewards.combine`): the prompt cut as the policy's was, the
    response as sampled, its stop token only where the policy emitted one (closing a response cut
    at max_new_tokens inflated its score). A reward model of another vocabulary reads the decoded
    texts, its EOS where the policy stopped."""
    from turborlhf.data.tokenize import encode_prompt_response

    if rm_tok.get_vocab() == s.tokenizer.get_vocab():
        return [list(p) + list(r) for p, r in zip(s.plain_prompt_ids, s.response_ids)]
    from turborlhf.rewards.model import warn_if_other_format
    warn_if_other_format(rm_tok, s.tokenizer, str(getattr(rm_tok, "name_or_path", "the reward model")))
    return [encode_prompt_response(rm_tok, s.tokenizer.decode(p), t, 4096, add_eos=f)["input_ids"]
            for p, t, f in zip(s.plain_prompt_ids, s.texts, s.finished)]


def _kl_to_reference(s: PolicySamples, reference_dir: str, dtype: str, device) -> dict:
    """k1 KL Σ_t (log π − log π_ref) per sampled response, averaged (π: the engine's log-probs or a
    policy forward, ``kl_policy_logprobs`` says which). The reference has fp32 weights, as the
    policy: bf16 weights would add their rounding to the KL (~0.2 nats per sequence between equal
    models)."""
    import torch

    from turborlhf.data.tokenize import assemble_prompt_response
    from turborlhf.engine.train import autocast
    from turborlhf.models.forward import response_logprobs
    from turborlhf.models.load import load_causal_lm

    tok = s.tokenizer
    ref = load_causal_lm(reference_dir, tok, device=device)
    ref_p_ids = s.plain_prompt_ids
    kls = []
    with torch.no_grad(), autocast(dtype, device):
        for i in range(0, len(s.prompt_ids), 8):
            sums = []
            for model, pids in ((s.model, s.prompt_ids), (ref, ref_p_ids)):
                if model is None:           # the policy's side from the engine
                    sums.append(torch.tensor([sum(lp) for lp in s.engine_logprobs[i:i + 8]]))
                    continue
                ids, attn, P, mask = assemble_prompt_response(pids[i:i + 8], s.response_ids[i:i + 8], tok.pad_token_id)
                target = torch.cat([torch.zeros(ids.shape[0], P), mask], 1)
                sums.append((response_logprobs(model, ids, attn, target)[0][:, P:] * mask).sum(-1).float().cpu())
            kls.append(sums[0] - sums[1])
    return {"kl_to_reference": float(torch.cat(kls).mean()),
            "kl_policy_logprobs": "engine" if s.model is None else "forward"}


def _policy_result(s: PolicySamples, scores, reward_model_dir: str, settings: dict, samples_out: Optional[str],
                   scoring: Optional[dict] = None) -> dict:
    """`eval_policy`'s result for one policy's samples and their reward-model scores; writes
    `samples_out` (JSONL: prompt, response, score, and the conditioned prompt of a tagged policy).
    ``hardware``: the engine's precision and device (``rollout``) and the scoring models' (`scoring`)."""
    import torch

    lens = torch.tensor([len(r) for r in s.response_ids], dtype=torch.float32)
    res = {"reward_mean": float(scores.mean()), "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
           "n": len(s.prompts), "response_length_mean": float(lens.mean()),
           "eos_fraction": float(torch.tensor(s.finished, dtype=torch.float32).mean()),
           "policy": s.policy_dir, "reward_model": reward_model_dir, **settings,
           "generate_seconds": round(s.generate_seconds, 2), **(s.tag or {}),
           "hardware": {"rollout": s.rollout_hardware, "scoring": scoring or {}}}
    if samples_out:
        with open(samples_out, "w") as f:
            for p, g, t, sc in zip(s.prompts, s.gen_prompts, s.texts, scores.tolist()):
                row = {"prompt": p, "response": t, "score": sc}
                if s.tag is not None:
                    row["conditioned_prompt"] = g
                f.write(json.dumps(row) + "\n")
    return res


def eval_policy(policy_dir: str, reward_model_dir: str, prompts_file: str, n: int = 64, max_new_tokens: int = 64,
                temperature: float = 0.7, top_p: float = 0.9, seed: int = 1234, engine: str = "auto",
                reference_dir: Optional[str] = None, samples_out: Optional[str] = None,
                tag_bin: Optional[int] = None, use_tag: bool = True, dtype: str = "auto",
                device: str = "auto", max_prompt_len: int = 256, device_field: str = "device") -> dict:
    """Generate for the first `n` prompts and score with the reward model.

    Returns reward mean/std over responses, mean response length (tokens, EOS included), EOS
    fraction, and with `reference_dir` the k1 KL estimate Σ_t (log π − log π_ref) averaged over
    the sampled responses (log π: the fp32 engine's temperature-1 log-probs of its samples, else a
    policy forward; ``kl_policy_logprobs`` says which). A response cut at `max_new_tokens` is
    scored as cut (no EOS added), exactly as PPO's reward sees it.

    Prompts are cut from the left to `max_prompt_len` tokens, for the policy, the reward model and
    the reference alike (as PPO's rollout cuts them). A conditional-SFT policy (its directory holds
    ``conditional_sft.json``) generates from prompts conditioned with the tag of bin `tag_bin`
    (default: its best bin; `use_tag=False` turns this off); the reward model and the reference see
    the untagged prompt. The result then also has ``tag`` and ``tag_bin``.

    `dtype`/`device`: as a trainer's ``model.dtype``/``model.device`` for the scoring models and the
    rollout engine (``auto``: this host's choice, README: Hardware). `device_field`: the setting
    `device` came from, which a `HardwareError` for a device this host lacks names.
    """
    from turborlhf.rewards.model import score_token_ids

    t0 = time.perf_counter()
    load_rm, rm_tok, dtype, dev = _scoring_setup(reward_model_dir, dtype, device, device_field)
    s = sample_policy(policy_dir, prompts_file, n, max_new_tokens, temperature, top_p, seed, engine, dtype, dev,
                      kl_wanted=bool(reference_dir), tag_bin=tag_bin, use_tag=use_tag, max_prompt_len=max_prompt_len)
    rm = load_rm()
    scores = score_token_ids(rm, rm_tok.pad_token_id, _reward_sequences(rm_tok, s), dtype)
    settings = {"seed": seed, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                "max_prompt_len": max_prompt_len}
    res = _policy_result(s, scores, reward_model_dir, settings, samples_out, {"dtype": dtype, "device": str(dev)})
    if reference_dir:
        res.update(_kl_to_reference(s, reference_dir, dtype, dev))
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def eval_policy_pair(base_dir: str, policy_dir: str, reward_model_dir: str, prompts_file: str, n: int = 64,
                     max_new_tokens: int = 64, temperature: float = 0.7, top_p: float = 0.9, seed: int = 1234,
                     engine: str = "auto", samples_out: tuple[Optional[str], Optional[str]] = (None, None),
                     dtype: str = "auto", device: str = "auto", max_prompt_len: int = 256,
                     device_field: str = "device") -> tuple[dict, dict]:
    """`eval_policy` of a base policy (e.g. the SFT model) and of a policy trained from it (e.g. PPO's)
    on the same prompts with the same seed, the trained one with its KL to the base: the results of
    ``eval_policy(base_dir, ...)`` and ``eval_policy(policy_dir, ..., reference_dir=base_dir)``.

    The reward model scores each prompt's two responses in one packed row ``[prompt | base's |
    policy's]`` (`turborlhf.models.forward.pack_shared_prefix`), so the prompt goes through it once
    instead of twice; the scores equal the separate passes' to float rounding. `samples_out`: the
    two policies' JSONL sample files (or None). Returns ``(base_result, policy_result)``; their
    ``seconds`` is the whole call's. Raises ValueError if the two policies' tokenizers read
    different prompts from `prompts_file`; `HardwareError` naming `device_field` (the setting
    `device` came from) for a device this host lacks.
    """
    from turborlhf.trainers.reward_model import score_pairs

    t0 = time.perf_counter()
    load_rm, rm_tok, dtype, dev = _scoring_setup(reward_model_dir, dtype, device, device_field)
    kw = dict(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, engine=engine,
              dtype=dtype, device=dev, max_prompt_len=max_prompt_len)
    base = sample_policy(base_dir, prompts_file, **kw)
    pol = sample_policy(policy_dir, prompts_file, kl_wanted=True, **kw)
    if base.prompts != pol.prompts:
        raise ValueError(f"{base_dir} and {policy_dir} read different prompts from {prompts_file} (their tokenizers "
                         "differ); evaluate them with eval_policy one by one")
    rm = load_rm()
    pairs = [{"chosen": a, "rejected": b}
             for a, b in zip(_reward_sequences(rm_tok, base), _reward_sequences(rm_tok, pol))]
    base_scores, pol_scores = score_pairs(rm, rm_tok, pairs, dtype, batch_size=8)
    settings = {"seed": seed, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                "max_prompt_len": max_prompt_len}
    scoring = {"dtype": dtype, "device": str(dev)}
    res_base = _policy_result(base, base_scores, reward_model_dir, settings, samples_out[0], scoring)
    res_pol = _policy_result(pol, pol_scores, reward_model_dir, settings, samples_out[1], scoring)
    res_pol.update(_kl_to_reference(pol, base_dir, dtype, dev))
    seconds = round(time.perf_counter() - t0, 2)
    res_base["seconds"] = res_pol["seconds"] = seconds
    return res_base, res_pol


def _scoring_setup(reward_model_dir: str, dtype: str, device: str, device_field: str = "device"):
    """Check the reward model (before minutes of generation) and resolve the device (errors naming
    `device_field`) and precision.
    Returns ``(load_rm, rm_tokenizer, dtype, device)``; `load_rm()` loads the
    reward model (after generation, so the policy and its engine are gone by then)."""
    import torch

    from turborlhf.engine.hardware import compute_dtype, resolve_device
    from turborlhf.engine.train import set_threads
    from turborlhf.models.load import load_tokenizer
    from turborlhf.rewards.model import check_reward_model, load_reward_model

    set_threads()
    check_reward_model(reward_model_dir)
    dev = resolve_device(device, device_field)
    dtype = compute_dtype(dtype, dev)
    frozen = torch.bfloat16 if dtype == "bf16" else torch.float32
    rm_tok = load_tokenizer(reward_model_dir)
    return (lambda: load_reward_model(reward_model_dir, rm_tok, dtype=frozen, device=dev)), rm_tok, dtype, dev


def main(name: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"turborlhf {name}")
    if name == "eval-rm":
        p.add_argument("--model", required=True, help="reward model directory")
        p.add_argument("--data", required=True, help="pairs: raw HH lines or {prompt,chosen,rejected} (.jsonl[.gz])")
        p.add_argument("--max-len", type=int, default=1024, help="tokens per sequence (prompt cut from the left)")
        p.add_argument("--batch-size", type=int, default=8, help="pairs per forward pass")
        p.add_argument("--limit", type=int, default=0, help="evaluate only the first N pairs")
    else:
        p.add_argument("--policy", required=True, help="policy directory (causal LM)")
        p.add_argument("--reward-model", required=True, help="reward model directory")
        p.add_argument("--prompts", required=True, help="{prompt} lines, pair-format or raw HH lines")
        p.add_argument("--reference", help="reference policy: also report KL to it")
        p.add_argument("--n", type=int, default=64, help="number of prompts")
        p.add_argument("--max-new-tokens", type=int, default=64)
        p.add_argument("--max-prompt-len", type=int, default=256,
                       help="prompts cut from the left to this many tokens (PPO's rollout.max_prompt_len default)")
        p.add_argument("--temperature", type=float, default=0.7)
        p.add_argument("--top-p", type=float, default=0.9)
        p.add_argument("--seed", type=int, default=1234)
        p.add_argument("--engine", default="auto", choices=["auto", "hf", "fast", "vllm"])
        p.add_argument("--samples-out", help="write prompts, responses and scores here (JSONL)")
        p.add_argument("--tag-bin", type=int, help="conditional-SFT policy: generate with this score bin's tag "
                       "(default: its best bin)")
        p.add_argument("--no-tag", action="store_true", help="conditional-SFT policy: generate untagged")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="compute precision (auto: bf16 only where the device computes it natively)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="where the models run (auto: cuda, then mps, then cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    a = p.parse_args(argv)
    checks = ((("--max-len", a.max_len >= 2), ("--batch-size", a.batch_size >= 1), ("--limit", a.limit >= 0))
              if name == "eval-rm" else
              (("--n", a.n >= 1), ("--max-new-tokens", a.max_new_tokens >= 1), ("--temperature", a.temperature >= 0),
               ("--top-p", 0 < a.top_p <= 1), ("--max-prompt-len", a.max_prompt_len >= 1)))
    for flag, ok in checks:
        if not ok:
            p.error(f"{flag}: {getattr(a, flag[2:].replace('-', '_'))} is out of range")
    if getattr(a, "samples_out", None) and os.path.isdir(a.samples_out):     # found after all the work
        p.error(f"--samples-out {a.samples_out} is a directory; give a file path")
    # everything but the final JSON goes to stderr so stdout stays machine-readable
    with contextlib.redirect_stdout(sys.stderr):
        if name == "eval-rm":
            res = eval_rm(a.model, a.data, a.max_len, a.batch_size, a.limit, a.dtype, a.device, device_field="--device")
        else:
            res = eval_policy(a.policy, a.reward_model, a.prompts, a.n, a.max_new_tokens, a.temperature, a.top_p,
                              a.seed, a.engine, a.reference, a.samples_out, a.tag_bin, not a.no_tag, a.dtype, a.device,
                              a.max_prompt_len, device_field="--device")
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>22}: {v}")
    return 0
