"""`turborlhf serve-rm`: serve any reward-model directory over HTTP, batching concurrent requests.

    turborlhf serve-rm --model runs/demo/rm --port 8000 --max-batch-size 16 --max-wait-ms 10

Endpoints (protocol in `turborlhf.rewards.remote`)::

    POST /score   {"prompts": [str], "responses": [str]}  ->  {"scores": [float]}
    GET  /health  -> {"status": "ok", "model": DIR, "requests": n, "batches": m, "items": k, ...}

Batching: each HTTP request is served by its own thread (``ThreadingHTTPServer``), which puts a
job on a queue and waits. One worker thread owns the model: it takes the first waiting job, then
keeps gathering jobs until they hold ``max_batch_size`` (prompt, response) items or
``max_wait_ms`` has passed since the first one, scores all their items in one call, and hands
each job its slice of the scores. So concurrent small requests (e.g. several PPO runs or data
workers) share forward passes, while a lone request waits at most ``max_wait_ms``. A request
larger than ``max_batch_size`` is scored in chunks of that size.

Scores are `turborlhf.rewards.model.score_texts`: prompt + response + EOS, head at the EOS.
Only the standard library serves HTTP; nothing is added to the dependencies.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional, Sequence

__all__ = ["BatchingScorer", "RewardHTTPServer", "make_server", "load_rm_scorer", "main"]

ScoreFn = Callable[[list[str], list[str]], Sequence[float]]


@dataclass
class _Job:
    prompts: list[str]
    responses: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    scores: Optional[list[float]] = None
    error: Optional[str] = None


class BatchingScorer:
    """A queue and one worker thread that merges concurrent scoring jobs into model calls.

    Args:
        score_fn: ``fn(prompts, responses) -> scores`` (one model call over all items).
        max_batch_size: stop gathering once the merged jobs hold this many items.
        max_wait_ms: stop gathering this long after the first job of a batch arrived.

    Counters (read by ``/health`` and tests): ``requests`` jobs served, ``batches`` calls of
    ``score_fn``, ``items`` (prompt, response) pairs scored.
    """

    def __init__(self, score_fn: ScoreFn, max_batch_size: int = 16, max_wait_ms: float = 10.0) -> None:
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError(f"need max_batch_size >= 1 and max_wait_ms >= 0, got {max_batch_size}, {max_wait_ms}")
        self.score_fn, self.max_batch_size, self.max_wait_s = score_fn, max_batch_size, max_wait_ms / 1000.0
        self.requests = self.batches = self.items = 0
        self._q: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="rm-batcher", daemon=True)
        self._worker.start()

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Score one request's items (blocks until its batch is done).

        Raises:
            RuntimeError: the model call failed (the message is the model's error).
        """
        job = _Job(prompts, responses)
        self._q.put(job)
        job.done.wait()
        if job.error is not None:
            raise RuntimeError(job.error)
        return job.scores  # type: ignore[return-value]

    def close(self) -> None:
        self._q.put(None)
        self._worker.join(timeout=5)

    def _gather(self, first: _Job) -> tuple[list[_Job], bool]:
        jobs, n = [first], len(first.prompts)
        deadline = time.monotonic() + self.max_wait_s
        while n < self.max_batch_size:
            left = deadline - time.monotonic()
            try:
                job = self._q.get(timeout=left) if left > 0 else self._q.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
            n += len(job.prompts)
        return jobs, False

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._q.get()
            if first is None:
                return
            jobs, stop = self._gather(first)
            prompts = [p for j in jobs for p in j.prompts]
            responses = [r for j in jobs for r in j.responses]
            try:
                scores = [float(s) for s in self.score_fn(prompts, responses)]
                if len(scores) != len(prompts):
                    raise RuntimeError(f"scorer returned {len(scores)} scores for {len(prompts)} items")
            except Exception as e:  # report to every waiting request, keep serving
                for j in jobs:
                    j.error = f"{type(e).__name__}: {e}"
                    j.done.set()
                continue
            self.requests += len(jobs)
            self.batches += 1
            self.items += len(prompts)
            at = 0
            for j in jobs:
                j.scores = scores[at:at + len(j.prompts)]
                at += len(j.prompts)
                j.done.set()


class RewardHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` holding a `BatchingScorer` and a description of the model."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], scorer: BatchingScorer, model_name: str, quiet: bool = True):
        super().__init__(address, _Handler)
        self.scorer, self.model_name, self.quiet = scorer, model_name, quiet

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: RewardHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:
        if not self.server.quiet:
            super().log_message(fmt, *args)

    def _send(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        if self.path.rstrip("/") != "/health":
            self._send(404, {"error": f"unknown path {self.path}; use POST /score or GET /health"})
            return
        s = self.server.scorer
        self._send(200, {"status": "ok", "model": self.server.model_name, "requests": s.requests,
                         "batches": s.batches, "items": s.items, "max_batch_size": s.max_batch_size,
                         "max_wait_ms": s.max_wait_s * 1000})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/score":
            self._send(404, {"error": f"unknown path {self.path}; use POST /score or GET /health"})
            return
        try:
            n = int(self.headers.get("Content-Length", "0"))
            req = json.loads(self.rfile.read(n) or b"null")
            prompts, responses = req["prompts"], req["responses"]
            if not (isinstance(prompts, list) and isinstance(responses, list)
                    and all(isinstance(x, str) for x in prompts + responses)):
                raise ValueError("'prompts' and 'responses' must be lists of strings")
            if len(prompts) != len(responses):
                raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        except (ValueError, KeyError, TypeError) as e:
            self._send(400, {"error": f"bad request: expected JSON {{'prompts': [str], 'responses': [str]}}: {e}"})
            return
        try:
            scores = self.server.scorer.score(prompts, responses) if prompts else []
        except RuntimeError as e:
            self._send(500, {"error": str(e)})
            return
        self._send(200, {"scores": scores})


def make_server(score_fn: ScoreFn, host: str = "127.0.0.1", port: int = 8000, max_batch_size: int = 16,
                max_wait_ms: float = 10.0, model_name: str = "", quiet: bool = True) -> RewardHTTPServer:
    """Bind a server (``port=0`` picks a free port; see ``server.url``). Run it with
    ``server.serve_forever()``; stop it with ``server.shutdown(); server.scorer.close()``."""
    return RewardHTTPServer((host, port), BatchingScorer(score_fn, max_batch_size, max_wait_ms), model_name, quiet)


def load_rm_scorer(model_dir: str, dtype: str = "bf16", max_len: int = 1024, batch_size: int = 16) -> ScoreFn:
    """``fn(prompts, responses) -> list[float]`` over a reward-model directory (`score_texts`)."""
    import torch

    from turborlhf.models.load import load_scalar_model, load_tokenizer
    from turborlhf.rewards.model import score_texts

    tok = load_tokenizer(model_dir)
    model = load_scalar_model(model_dir, tok, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
    model.requires_grad_(False)

    def score(prompts: list[str], responses: list[str]) -> list[float]:
        return score_texts(model, tok, prompts, responses, max_len, dtype, batch_size).tolist()

    return score


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="turborlhf serve-rm", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="reward-model directory (AutoModelForSequenceClassification)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 = all)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free port; the URL is printed)")
    p.add_argument("--max-batch-size", type=int, default=16, help="items per model call (gathered across requests)")
    p.add_argument("--max-wait-ms", type=float, default=10.0, help="how long a batch waits for more requests")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per scored sequence (prompt cut from the left)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="reward-model compute precision")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores or $TURBORLHF_THREADS)")
    p.add_argument("--verbose", action="store_true", help="log every HTTP request")
    a = p.parse_args(argv)
    from turborlhf.engine.train import set_threads

    set_threads(a.threads)
    score = load_rm_scorer(a.model, a.dtype, a.max_len, a.max_batch_size)
    server = make_server(score, a.host, a.port, a.max_batch_size, a.max_wait_ms, a.model, quiet=not a.verbose)
    print(f"[serve-rm] {a.model} on {server.url} (POST /score, GET /health; max_batch_size={a.max_batch_size}, "
          f"max_wait_ms={a.max_wait_ms:g})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.scorer.close()
    print("[serve-rm] stopped", file=sys.stderr, flush=True)
    return 0
