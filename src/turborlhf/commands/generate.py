"""`turborlhf generate` (prompts file -> responses JSONL) and `turborlhf chat` (interactive).

Both sample with a rollout engine (``turborlhf.rollout.make_engine``: the embedded fast engine
when the architecture is supported, else HF ``generate``), with vLLM's sampling semantics
(``SamplingParams``: temperature 0 = greedy; top_p 1 and top_k 0 = off).

    turborlhf generate --model runs/demo/ppo --prompts prompts.jsonl --output out.jsonl --n 2
    turborlhf chat --model runs/demo/ppo --system "You are brief."

``generate`` reads prompts as the trainers do (``data.loaders.load_prompts``: any file, dataset
directory or hub id; ``--prompt-key`` names the data's key; message lists get the chat template,
strings are used verbatim; duplicates are generated once) and writes one line per sample:
``{"prompt", "response", "finished", "response_tokens", "sample"}``; ``finished`` is false for a
response cut at ``--max-new-tokens``. No reward model is involved.

``chat`` keeps the conversation, renders it with the model's chat template each turn (or
``--chat-template``), and prints each reply; with the HF engine (``--engine hf``) replies are
streamed token by token (transformers' ``TextStreamer``), the fast engine prints each reply
whole. ``/reset`` starts a new conversation, ``/exit`` or end of input quits.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Optional, TextIO

__all__ = ["generate_file", "chat_loop", "generate_main", "chat_main"]

logger = logging.getLogger(__name__)


def _sampling_args(p: argparse.ArgumentParser, temperature: float, max_new_tokens: int) -> None:
    p.add_argument("--model", required=True, help="HF model directory (a trained policy), zoo name or hub id")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens generated per response")
    p.add_argument("--temperature", type=float, default=temperature, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same output)")
    p.add_argument("--max-prompt-len", type=int, default=None, help="prompts are cut from the left to this many "
                   "tokens (default: the model's context less --max-new-tokens)")
    p.add_argument("--engine", choices=["auto", "fast", "hf", "vllm"], default="auto",
                   help="auto/fast = the embedded fast engine where supported (else HF generate)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32", "fp16"], default="auto",
                   help="engine weights precision (auto: bf16 where the device computes it natively, else fp32)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"], default="auto",
                   help="where the engine runs (auto: cuda, then mps, then cpu; the fast engine is CPU-only)")
    p.add_argument("--chat-template", default=None,
                   help="chat template for message lists: chatml, plain or a Jinja string (default: the model's)")


def _params(a, n: int = 1, stop: tuple[int, ...] = ()):
    from turborlhf.rollout.base import SamplingParams

    return SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          n=n, seed=a.seed, stop_token_ids=tuple(stop))


def _decode(tok, ids: list[int], finished: bool) -> str:
    """Response text without its stop token (kept by the engines when sampled)."""
    return tok.decode(ids[:-1] if finished and ids else ids, skip_special_tokens=True)


def generate_file(model: str, prompts_file: str, output: str, params, engine: str = "auto", dtype: str = "auto",
                  batch_size: int = 32, max_prompt_len: Optional[int] = None, limit: int = 0,
                  keys: Optional[dict] = None, chat_template: Optional[str] = None, device: str = "auto",
                  device_field: str = "device") -> dict:
    """Generate ``params.n`` responses per prompt of ``prompts_file`` and write them to ``output``
    (JSONL, atomically). Returns ``{"prompts", "samples", "tokens", "seconds", "tokens_per_s"}``.

    Prompts are cut from the left to ``max_prompt_len`` tokens (None: the model's context less
    ``params.max_new_tokens``, `turborlhf.evaluate.prompt_budget`). Raises ``DataError`` /
    ``FileNotFoundError`` for bad prompts (see ``load_prompts``), ``UserError`` when the longest
    prompt plus ``params.max_new_tokens`` exceeds the model's context, ``HardwareError`` for a
    ``device`` this host lacks (naming ``device_field``, the setting it came from).
    """
    from dataclasses import replace

    from transformers import AutoConfig

    from turborlhf.data.chat import stop_ids
    from turborlhf.data.jsonl import write_jsonl
    from turborlhf.data.loaders import load_prompts
    from turborlhf.data.tokenize import encode_prompts
    from turborlhf.evaluate import check_context, prompt_budget
    from turborlhf.models.load import load_tokenizer
    from turborlhf.models.zoo import resolve_model_path
    from turborlhf.rollout import make_engine

    path = resolve_model_path(model)
    tok = load_tokenizer(path)
    prompts = load_prompts(prompts_file, tok, keys=keys, chat_template=chat_template)
    prompts = prompts[:limit] if limit else list(prompts)
    config = AutoConfig.from_pretrained(path)
    ids = encode_prompts(tok, prompts, prompt_budget(config, max_prompt_len, params.max_new_tokens))
    check_context(config, ids, params.max_new_tokens)
    if not params.stop_token_ids:
        params = replace(params, stop_token_ids=stop_ids(tok))
    eng = make_engine(engine, path, dtype=dtype, device=device, device_field=device_field, max_batch_size=batch_size)
    t0 = time.perf_counter()
    out = eng.generate(ids, params)
    dt = time.perf_counter() - t0
    rows = []
    for i, (r, fin) in enumerate(zip(out.response_ids, out.finished)):
        rows.append({"prompt": prompts[i // params.n], "response": _decode(tok, r, fin), "finished": bool(fin),
                     "response_tokens": len(r), "sample": i % params.n})
    write_jsonl(output, rows)
    n_tok = sum(len(r) for r in out.response_ids)
    return {"prompts": len(prompts), "samples": len(rows), "tokens": n_tok, "seconds": round(dt, 3),
            "tokens_per_s": round(n_tok / max(dt, 1e-9), 1)}


def generate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="turborlhf generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _sampling_args(p, temperature=1.0, max_new_tokens=256)
    p.add_argument("--prompts", required=True, help="prompts: file (JSON lines, JSON, Parquet, Arrow, CSV), "
                                                    "save_to_disk directory or hub id, as the trainers read them")
    p.add_argument("--output", required=True, help="JSONL written: {prompt, response, finished, response_tokens, "
                                                   "sample}")
    p.add_argument("--n", type=int, default=1, help="responses per prompt")
    p.add_argument("--batch-size", type=int, default=32, help="sequences the engine decodes together")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    p.add_argument("--prompt-key", default="prompt", help="the data's key holding the prompt")
    a = p.parse_args(argv)
    for flag, value, least in (("--n", a.n, 1), ("--batch-size", a.batch_size, 1), ("--limit", a.limit, 0),
                               ("--top-k", a.top_k, 0)):
        if value < least:
            p.error(f"{flag} must be >= {least}, got {value}")
    if os.path.isdir(a.output):                   # found after every response was generated
        p.error(f"--output {a.output} is a directory; give a file path")
    from turborlhf.data.errors import DataError

    try:
        stats = generate_file(a.model, a.prompts, a.output, _params(a, n=a.n), a.engine, a.dtype, a.batch_size,
                              a.max_prompt_len, a.limit, keys={"prompt": a.prompt_key}, chat_template=a.chat_template,
                              device=a.device, device_field="--device")
    except (DataError, FileNotFoundError, ValueError, ImportError) as e:      # ImportError: --engine vllm
        print(f"error: {e}", file=sys.stderr)
        return 2
    logger.info(f"[generate] {stats['prompts']} prompts -> {stats['samples']} responses, {stats['tokens']} tokens in "
                f"{stats['seconds']:.1f}s ({stats['tokens_per_s']:.0f} tok/s) -> {a.output}")
    return 0


# ------------------------------------------------------------------------------------------ chat


def _stream_hf(engine, tok, ids: list[int], params, out: TextIO) -> tuple[list[int], bool]:
    """One reply from an HF engine's model, written to ``out`` as it is decoded. Sampled as
    `HFEngine.generate` samples (`_Sampler`, a generator of its own seeded from ``params.seed``),
    so a seeded reply is the same streamed or not, and torch's global generators are left alone."""
    import torch
    from transformers import GenerationConfig, TextStreamer

    from turborlhf.rollout.hf import _Sampler

    class _Out(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            out.write(text)
            out.flush()

    dev = next(engine.model.parameters()).device
    gcfg = GenerationConfig(max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
                            do_sample=False, eos_token_id=list(params.stop_token_ids) or None,
                            pad_token_id=tok.pad_token_id, bos_token_id=None)
    procs = None
    if params.temperature != 0:
        gen = torch.Generator(device=dev)
        if params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            gen.seed()
        procs = [_Sampler(params, gen, record=False)]
    x = torch.tensor([ids], device=dev)
    with torch.no_grad():
        y = engine.model.generate(x, attention_mask=torch.ones_like(x), generation_config=gcfg, logits_processor=procs,
                                  streamer=_Out(tok, skip_prompt=True, skip_special_tokens=True))
    resp = y[0, len(ids):].tolist()
    finished = bool(resp) and resp[-1] in params.stop_token_ids
    return resp, finished


def chat_loop(engine, tok, params, inp: TextIO, out: TextIO, system: Optional[str] = None,
              max_prompt_len: int = 1024, stream: bool = False, prompt_marker: str = "") -> list[dict]:
    """Read user turns from ``inp`` (one line each) until ``/exit`` or end of input; answer each with
    the whole conversation so far rendered by the chat template. Returns the last conversation.

    ``stream``: write each reply while it is generated (HF engine only). Raises ``ValueError`` if
    the tokenizer has no chat template.
    """
    from dataclasses import replace

    from turborlhf.data.chat import render_prompt, require_chat_template
    from turborlhf.data.tokenize import encode_prompt

    require_chat_template(tok)
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    turn = 0
    while True:
        if prompt_marker:
            out.write(prompt_marker)
            out.flush()
        line = inp.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            messages = list(start)
            out.write("[new conversation]\n")
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids = encode_prompt(tok, render_prompt(tok, messages), max_prompt_len)
        p = replace(params, seed=None if params.seed is None else params.seed + turn)
        if stream:
            resp, fin = _stream_hf(engine, tok, ids, p, out)
            reply = _decode(tok, resp, fin)
            out.write("\n")
        else:
            res = engine.generate([ids], p)
            reply = _decode(tok, res.response_ids[0], res.finished[0])
            out.write(reply + "\n")
        out.flush()
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return messages


def chat_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="turborlhf chat", description="interactive multi-turn chat with a model "
                                "(/reset = new conversation, /exit or end of input = quit)")
    _sampling_args(p, temperature=0.7, max_new_tokens=256)
    p.add_argument("--system", default=None, help="system message that starts every conversation")
    p.add_argument("--no-stream", action="store_true", help="print replies whole even with the HF engine")
    a = p.parse_args(argv)
    from transformers import AutoConfig

    from turborlhf.data.chat import render_prompt, set_chat_template, stop_ids
    from turborlhf.errors import UserError
    from turborlhf.evaluate import check_context, prompt_budget
    from turborlhf.models.load import load_tokenizer
    from turborlhf.models.zoo import resolve_model_path
    from turborlhf.rollout import make_engine
    from turborlhf.rollout.hf import HFEngine

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    try:
        set_chat_template(tok, a.chat_template)
        if not tok.chat_template:
            raise ValueError(f"{path}: the tokenizer has no chat template; give one with --chat-template "
                             "(chatml, plain or a Jinja string)")
        # refused before the model loads and a line is typed: a context the replies cannot fit in,
        # a system message the template will not render (Gemma's)
        config = AutoConfig.from_pretrained(path)
        budget = prompt_budget(config, a.max_prompt_len, a.max_new_tokens)
        check_context(config, [[0] * budget], a.max_new_tokens)
        if a.system is not None:
            try:
                render_prompt(tok, [{"role": "system", "content": a.system}, {"role": "user", "content": "x"}])
            except Exception as e:
                raise ValueError(f"--system: the chat template refuses a system message ({type(e).__name__}: "
                                 f"{(str(e).strip().splitlines() or [''])[0]})") from None
        engine = make_engine(a.engine, path, dtype=a.dtype, device=a.device, device_field="--device", max_batch_size=1)
        stream = isinstance(engine, HFEngine) and not a.no_stream
        tty = sys.stdin.isatty()
        if tty:
            print(f"[chat] {path} ({type(engine).__name__}{', streaming' if stream else ''}); "
                  "/reset = new conversation, /exit = quit", flush=True)
        chat_loop(engine, tok, _params(a, stop=stop_ids(tok)), sys.stdin, sys.stdout, a.system, budget,
                  stream, prompt_marker="> " if tty else "")
    except (ValueError, UserError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
