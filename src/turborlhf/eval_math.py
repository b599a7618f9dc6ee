"""`turborlhf eval-math`: GSM8K accuracy and answer-format rate of a policy.

    turborlhf eval-math --policy runs/gsm8k/policy --data data/gsm8k/test-1000.jsonl.gz --n 64 --json
    → {"accuracy": 0.06, "format_rate": 0.03, "n": 64, "response_length_mean": 180.2, ...}

Each problem is asked exactly as training asks it (`turborlhf.data.gsm8k.gsm8k_messages`: the
question plus the instruction to end with ``#### <number>``, rendered with the policy's chat
template) and answered by the fast rollout engine (`turborlhf.rollout.make_engine`), greedily by
default. Scores (`turborlhf.rewards.verifiers`):

- ``accuracy``: the final number (last ``#### <number>``, else the last number) equals the
  reference (lm-evaluation-harness's gsm8k "flexible-extract");
- ``strict_accuracy``: the last ``#### <number>`` equals the reference ("strict-match");
- ``format_rate``: the response's last non-empty line is ``#### <number>``;
- ``response_length_mean`` (tokens, EOS included), ``eos_fraction`` (responses that ended
  before ``--max-new-tokens``).

The calculator: on GSM8K every policy answers with GSM8K's calculator at hand (``--tool auto``,
`turborlhf.rollout.tools.Calculator`): where a response writes ``<<expression=``, the value and
``>>`` are appended, as GSM8K's reference solutions annotate every step. A policy that never
writes one answers exactly as without it (the starting model), and one trained on the annotated
solutions (``make demo-math``) gets exact arithmetic. ``--tool none`` evaluates without it;
``tool`` and ``tool_calls`` in the result say which ran and how often it answered.

Other verifiers: ``--reward NAME`` scores with any reward function instead
(`turborlhf.rewards.functions.load_reward_function`: a built-in name such as
``reasoning_gym_score`` or ``module:function``); ``accuracy`` is then the mean of its scores, every
column of the prompt file reaches it (``answer``, ``metadata``...), and the GSM8K-only keys
(``strict_accuracy``, ``format_rate``) are null::

    turborlhf eval-math --policy P --data runs/rg/chain_sum_prompts.jsonl --reward reasoning_gym_score

Input lines: GSM8K's ``{question, answer}`` (answer = solution ending ``#### <number>``, or the
number) or prompt files with an answer column (``prepare-data gsm8k`` or ``reasoning-gym``:
``{prompt, answer, ...}``). Bad lines are
skipped with one warning naming their line numbers (`turborlhf.data.loaders`). With ``--json``
stdout carries exactly one JSON object; logs go to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Optional

__all__ = ["main", "eval_math", "load_problems"]


def load_problems(path: str, tokenizer, n: int = 0) -> list[dict]:
    """The first `n` (0 = all) problems of `path` as ``{"prompt": rendered str, "answer": str}``
    (a prompt file's other columns kept).

    Raises:
        DataError: no usable line (`turborlhf.data.loaders`: an ``answer`` neither a string nor a
            number is a ``bad_value`` line); FileNotFoundError.
    """
    from turborlhf.data.chat import render_prompt, require_chat_template
    from turborlhf.data.errors import DataError, Problem
    from turborlhf.data.gsm8k import convert_gsm8k
    from turborlhf.data.loaders import _Bad, _load, _prompt

    require_chat_template(tokenizer)

    def parse(obj: dict) -> list[dict]:
        answer = obj.get("answer")
        if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
            raise _Bad("bad_value", f"'answer' must be a string or a number, got {type(answer).__name__}")
        if "prompt" in obj and "answer" in obj and (answer is None and "metadata" in obj or isinstance(
                answer, (str, int, float)) and not isinstance(answer, bool)):
            # a reasoning-gym task without one reference answer ("answer": null) is scored from its metadata
            return [{**obj, "prompt": _prompt(obj["prompt"], tokenizer),
                     "answer": None if answer is None else str(answer)}]
        if "question" in obj and isinstance(obj.get("answer"), (int, float, str)) and "####" not in str(obj["answer"]):
            obj = {**obj, "answer": f"#### {obj['answer']}"}         # the bare final number
        if "question" in obj:
            row = convert_gsm8k(obj)
            if isinstance(row, Problem):
                raise _Bad(row.kind, row.detail)
            return [{"prompt": render_prompt(tokenizer, row["prompt"]), "answer": row["answer"]}]
        raise _Bad("missing_key", f"need 'question'+'answer' (GSM8K) or 'prompt'+'answer', the record has "
                                  f"{sorted(obj)[:8]} (prepare-data gsm8k writes *_prompts.jsonl with both)")

    problems = _load(path, parse, False, tokenizer, key_hint=False)
    if n:
        problems = problems[:n]
    if not problems:
        raise DataError(f"{path}: no problems")
    return list(problems)


def eval_math(policy: str, data: str, n: int = 0, max_new_tokens: int = 256, temperature: float = 0.0,
              top_p: float = 1.0, seed: int = 1234, engine: str = "auto", batch_size: int = 32,
              max_prompt_len: int = 512, dtype: str = "auto", samples_out: Optional[str] = None,
              device: str = "auto", reward: Optional[str] = None, tool: str = "auto",
              device_field: str = "device") -> dict:
    """Answer the first `n` problems of `data` with `policy` and score them (module docstring).

    Args:
        policy: HF directory or zoo name of a causal LM with a chat template.
        data: GSM8K ``.jsonl[.gz]`` (or ``prepare-data gsm8k`` prompts). n: 0 = every problem.
        max_new_tokens: tokens per response; temperature: 0 = greedy.
        engine: rollout engine kind (`turborlhf.rollout.make_engine`); dtype: its weights; device:
            where it runs (``auto``: cuda, then mps, then cpu).
        reward: score with this reward function (module docstring) instead of GSM8K's verifiers.
        tool: rollout tool while answering (`turborlhf.rollout.tools`): ``auto`` = the calculator
            when scoring GSM8K (it acts only on a ``<<expression=`` the model writes, so a policy
            that never writes one answers exactly as without it), none with `reward`; ``none``;
            ``calculator``.
        device_field: the setting `device` came from (``--device``), which a `HardwareError` names.

    Returns:
        ``accuracy``, ``strict_accuracy``, ``format_rate`` (None with `reward`), ``n``,
        ``response_length_mean``, ``eos_fraction``, ``tool`` and ``tool_calls`` (results the tool
        wrote) and the settings, with timings in seconds.

    Raises:
        DataError: no usable problem; FileNotFoundError; RewardFunctionError: a bad `reward`;
        UserError: a tool with the vLLM engine.
    """
    from turborlhf.engine.train import set_threads
    from turborlhf.errors import UserError
    from turborlhf.evaluate import generate_responses
    from turborlhf.models.load import load_tokenizer
    from turborlhf.models.zoo import resolve_model_path
    from turborlhf.rewards.functions import call_reward_function, load_reward_function
    from turborlhf.rewards.verifiers import gsm8k_accuracy, gsm8k_format, gsm8k_strict_accuracy
    from turborlhf.rollout.tools import make_tool

    score_fn = load_reward_function(reward) if reward else None     # a bad name fails before any work
    set_threads()
    t0 = time.perf_counter()
    path = str(resolve_model_path(policy))
    tok = load_tokenizer(path)
    problems = load_problems(data, tok, n)
    prompts, answers = [p["prompt"] for p in problems], [p["answer"] for p in problems]
    t_gen = time.perf_counter()
    tool = ("calculator" if reward is None else "none") if tool == "auto" else tool
    if tool != "none" and engine == "vllm":
        raise UserError(f"--tool {tool} needs --engine fast, hf or auto (vLLM's sampling loop has no hook for it)")
    tool_fn = make_tool(tool, tok)
    used: dict = {}
    _, response_ids, finished, _ = generate_responses(path, tok, prompts, max_new_tokens, temperature, top_p, seed,
                                                      engine, max_prompt_len, batch_size, dtype, device, tool=tool_fn,
                                                      used=used, device_field=device_field)
    t_gen = time.perf_counter() - t_gen
    texts = [tok.decode(r, skip_special_tokens=True) for r in response_ids]
    if score_fn is None:
        acc = gsm8k_accuracy(prompts, texts, answer=answers)
        strict, fmt = gsm8k_strict_accuracy(prompts, texts, answer=answers), gsm8k_format(prompts, texts)
    else:
        columns = {c: [p.get(c) for p in problems] for c in problems[0] if c != "prompt"}
        acc, strict, fmt = call_reward_function(score_fn, prompts, texts, reward, columns), None, None
    k, lens = len(problems), [len(r) for r in response_ids]
    rate = lambda xs: None if xs is None else sum(xs) / k           # noqa: E731
    res = {"accuracy": rate(acc), "strict_accuracy": rate(strict), "format_rate": rate(fmt), "n": k,
           "response_length_mean": sum(lens) / k, "eos_fraction": sum(finished) / k,
           "tool": tool, "tool_calls": getattr(tool_fn, "calls", 0),
           "policy": policy, "data": data, "reward": reward or "gsm8k", "engine": engine, "temperature": temperature,
           "max_new_tokens": max_new_tokens, "seed": seed, "generate_seconds": round(t_gen, 2),
           "tokens_per_s": round(sum(lens) / max(t_gen, 1e-9), 1), "seconds": round(time.perf_counter() - t0, 2),
           "hardware": {"rollout": used}}      # what auto resolved to
    shown = "" if fmt is None else f", format {res['format_rate']:.3f}"
    print(f"[eval-math] accuracy {res['accuracy']:.3f}{shown} on {k} problems "
          f"({sum(lens)} tokens in {t_gen:.0f}s)", flush=True)
    if samples_out:
        with open(samples_out, "w") as f:
            for i, (p, t, a, c) in enumerate(zip(prompts, texts, answers, acc)):
                row = {"prompt": p, "response": t, "answer": a, "correct": c, "format": fmt[i] if fmt else None}
                f.write(json.dumps(row) + "\n")
    return res


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="turborlhf eval-math", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="policy directory (causal LM) or zoo name")
    p.add_argument("--data", required=True, help="GSM8K {question, answer} lines (.jsonl[.gz]) or prepared prompts")
    p.add_argument("--n", type=int, default=0, help="evaluate the first N problems (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--engine", default="auto", choices=["auto", "hf", "fast", "vllm"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="where the engine runs (auto: cuda, then mps, then cpu)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences decoded together")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="engine precision (auto: bf16 only where the CPU computes it natively, else fp32)")
    p.add_argument("--reward", help="score with this reward function (built-in name or module:function) "
                                    "instead of GSM8K's verifiers, e.g. reasoning_gym_score")
    p.add_argument("--tool", default="auto", choices=["auto", "none", "calculator"],
                   help="tool the policy may call while answering: auto = the calculator on GSM8K (GSM8K's "
                        "<<expression=value>> annotations; inert for a policy that never writes one), none with "
                        "--reward")
    p.add_argument("--samples-out", help="write prompt, response, answer, correct, format per problem (JSONL)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    a = p.parse_args(argv)
    for flag, ok in (("--n", a.n >= 0), ("--max-new-tokens", a.max_new_tokens >= 1), ("--batch-size", a.batch_size >= 1),
                     ("--temperature", a.temperature >= 0), ("--top-p", 0 < a.top_p <= 1)):
        if not ok:
            p.error(f"{flag}: {getattr(a, flag[2:].replace('-', '_'))} is out of range")
    if a.samples_out and os.path.isdir(a.samples_out):    # found after every sample was generated
        p.error(f"--samples-out {a.samples_out} is a directory; give a file path")
    from turborlhf.errors import UserError

    with contextlib.redirect_stdout(sys.stderr):
        try:
            res = eval_math(a.policy, a.data, a.n, a.max_new_tokens, a.temperature, a.top_p, a.seed, a.engine,
                            a.batch_size, dtype=a.dtype, samples_out=a.samples_out, device=a.device,
                            reward=a.reward, tool=a.tool, device_field="--device")
        except (UserError, FileNotFoundError) as e:        # bad input: one line; anything else is a bug
            print(f"error: {e}", file=sys.stderr)
            return 2
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>22}: {v}")
    return 0
