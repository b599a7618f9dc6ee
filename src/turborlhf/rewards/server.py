"""`turborlhf serve-rm`: serve any reward-model directory over HTTP, batching concurrent requests.

    turborlhf serve-rm --model runs/demo/rm --port 8000 --max-batch-size 16 --max-wait-ms 10
    TURBORLHF_RM_TOKEN=secret turborlhf serve-rm --model runs/demo/rm --host 0.0.0.0   # other hosts: token required

Endpoints (protocol in `turborlhf.rewards.remote`)::

    POST /score   {"prompts": [str], "responses": [str]}  ->  {"scores": [float]}
    GET  /health  -> {"status": "ok", "requests": n, "batches": m, "items": k, "limits": {...}, ...}

Batching and fairness: each connection is served by its own thread (at most `max_connections`
of them), which puts a job on a queue and waits. One worker thread owns the model. When it is
idle it takes the first waiting job and keeps gathering jobs until they hold ``max_batch_size``
(prompt, response) items or ``max_wait_ms`` has passed; then every model call takes at most
``max_batch_size`` items, shared fairly among all unfinished jobs (water-filling: each job gets an
equal share, a job needing less leaves the rest to the others). A large request is therefore
scored over several calls, and a one-item request that arrives meanwhile rides along in the next
call instead of waiting for the large one to finish. A call that fails is made again job by job,
so only the request whose items the model cannot score gets the error (500).

Limits (`ServerLimits`; errors are JSON ``{"error": ...}`` with a 4xx/5xx code):

- body size ``max_body_bytes`` (8 MiB): a larger ``Content-Length`` gets 413 before any of the
  body is read; no ``Content-Length`` gets 411; the connection is then closed.
- ``max_texts`` (1024) prompt/response pairs per request, ``max_text_tokens`` (8192) tokens per
  prompt or response: 413 naming the limit (the client splits larger batches itself).
- ``max_response_tokens`` (``serve-rm``: ``--max-len`` − 2): a response that would not fit the
  scored sequence with its BOS and EOS gets 413 (its end, where the reward is read, would be cut;
  a prompt is cut from the left instead, as in training).
- ``read_timeout_s`` (30 s): the whole request (headers and body) must arrive within this time
  of the connection being ready; a slow or half-open client is disconnected (408 when the headers
  had arrived), an idle keep-alive connection closed. Sends are bounded by the same timeout.
- ``max_connections`` (64) connections served at once; further ones get 503 at once and are
  closed, so threads stay bounded.
- ``score_timeout_s`` (300 s): a request not scored by then gets 503 and its remaining items are
  dropped from the queue. So are those of a client that closed its connection while it waited (a
  client timing out and retrying would otherwise have every abandoned copy scored before its
  retry, on a server already too busy to answer in time); a client that only shuts down its
  sending side after the request (``nc -N``) reads the same way and gets no answer.
- JSON nested too deeply for the parser gets 400.

Authentication: with a token (``--token`` or ``$TURBORLHF_RM_TOKEN``) every request must send
``Authorization: Bearer <token>`` (else 401). Binding an address other than loopback without a
token is refused. ``/health`` reports counters and limits, not the model's path.

Scores are `turborlhf.rewards.model.score_texts`: prompt + response + EOS, the head at the token
transformers' pooling reads. Only the standard library serves HTTP; nothing is added to the
dependencies.
"""
from __future__ import annotations

import argparse
import hmac
import io
import ipaddress
import json
import os
import queue
import select
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Callable, Optional, Sequence

__all__ = ["BatchingScorer", "ServerLimits", "RewardHTTPServer", "RMScorer", "make_server", "load_rm_scorer",
           "is_loopback", "check_bind", "TOKEN_ENV", "main"]

ScoreFn = Callable[[list[str], list[str]], Sequence[float]]
#: environment variable holding the bearer token (server and `turborlhf.rewards.remote` client)
TOKEN_ENV = "TURBORLHF_RM_TOKEN"


@dataclass(frozen=True)
class ServerLimits:
    """What one client may ask of the server (see the module docstring for the answers)."""

    max_body_bytes: int = 8 << 20
    max_texts: int = 1024
    max_text_tokens: int = 8192
    read_timeout_s: float = 30.0
    max_connections: int = 64
    score_timeout_s: float = 300.0
    max_response_tokens: Optional[int] = None   # a longer response would lose its end (where the reward is read)

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if v is not None and not v > 0:
                raise ValueError(f"serve-rm limit {k} must be > 0, got {v}")


@dataclass(eq=False)
class _Job:
    prompts: list[str]
    responses: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    scores: list = field(default_factory=list)
    handed: int = 0                     # items given to the model so far
    error: Optional[str] = None
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.scores = [None] * len(self.prompts)


class BatchingScorer:
    """A queue and one worker thread that merges concurrent scoring jobs into bounded model calls.

    Args:
        score_fn: ``fn(prompts, responses) -> scores`` (one model call over at most
            `max_batch_size` items).
        max_batch_size: items per model call; a larger job is split over several calls, shared
            fairly with the other waiting jobs.
        max_wait_ms: when idle, how long after the first job to wait for more.

    Counters (read by ``/health`` and tests): ``requests`` jobs served, ``batches`` calls of
    ``score_fn``, ``items`` (prompt, response) pairs scored, ``dropped`` jobs given up before they
    were scored (timed out, or their client left).
    """
    poll_s = 0.2                      # how often a waiting request looks at its deadline and its client

    def __init__(self, score_fn: ScoreFn, max_batch_size: int = 16, max_wait_ms: float = 10.0) -> None:
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError(f"need max_batch_size >= 1 and max_wait_ms >= 0, got {max_batch_size}, {max_wait_ms}")
        self.score_fn, self.max_batch_size, self.max_wait_s = score_fn, max_batch_size, max_wait_ms / 1000.0
        self.requests = self.batches = self.items = self.dropped = 0
        self._q: queue.Queue = queue.Queue()
        self._active: list[_Job] = []
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="rm-batcher", daemon=True)
        self._worker.start()

    def score(self, prompts: list[str], responses: list[str], timeout_s: Optional[float] = None,
              abandoned: Callable[[], bool] = lambda: False) -> list[float]:
        """Score one request's items (blocks until all its items are scored). `abandoned()` is
        asked every `poll_s` while they wait (the server's: has the client closed its connection?).

        Raises:
            RuntimeError: the model call failed (the message is the model's error), or the
                scorer is closed.
            TimeoutError: not scored within `timeout_s` (its remaining items are dropped).
            ConnectionAbortedError: `abandoned()` said so (its remaining items are dropped).
        """
        job = _Job(list(prompts), list(responses))
        if not job.prompts:
            return []
        if self._closed:
            raise RuntimeError("the reward server is shutting down")
        self._q.put(job)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not job.done.wait(self.poll_s if deadline is None else
                                max(0.0, min(self.poll_s, deadline - time.monotonic()))):
            gone = abandoned()
            if gone or (deadline is not None and time.monotonic() >= deadline):
                job.cancelled = True
                self.dropped += 1
                if gone:
                    raise ConnectionAbortedError("the client closed its connection before it was answered")
                raise TimeoutError(f"not scored within {timeout_s:g} s (server busy)")
        if job.error is not None:
            raise RuntimeError(job.error)
        return job.scores

    def close(self) -> None:
        """Stop the worker; waiting and queued jobs fail with "shutting down"."""
        self._closed = True
        self._q.put(None)
        self._worker.join(timeout=5)

    def _pending(self) -> int:
        return sum(len(j.prompts) - j.handed for j in self._active)

    def _admit(self) -> bool:
        """Move queued jobs into the active set: when nothing is active, wait for a job and then up
        to max_wait for more (until they hold a batch); then take every job already queued, so a
        job arriving during a long one joins the next call. Returns False when asked to stop."""
        if not self._active:
            job = self._q.get()
            if job is None:
                return False
            self._active.append(job)
            deadline = time.monotonic() + self.max_wait_s
            while self._pending() < self.max_batch_size:
                left = deadline - time.monotonic()
                try:
                    job = self._q.get(timeout=left) if left > 0 else self._q.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    return False
                self._active.append(job)
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False
            self._active.append(job)

    def _take(self) -> list[tuple[_Job, int, int]]:
        """(job, first item, count) of the next model call: ``max_batch_size`` items shared
        equally among the active jobs (FIFO order breaks ties)."""
        jobs = self._active
        want = [len(j.prompts) - j.handed for j in jobs]
        give = [0] * len(jobs)
        cap = self.max_batch_size
        while cap > 0:
            open_ = [i for i in range(len(jobs)) if give[i] < want[i]]
            if not open_:
                break
            share = max(1, cap // len(open_))
            for i in open_:
                g = min(share, want[i] - give[i], cap)
                give[i] += g
                cap -= g
                if cap == 0:
                    break
        return [(j, j.handed, g) for j, g in zip(jobs, give) if g]

    def _finish(self, job: _Job, error: Optional[str] = None) -> None:
        job.error = error
        job.done.set()
        if job in self._active:
            self._active.remove(job)

    def _call(self, parts: list[tuple[_Job, int, int]]) -> None:
        """One model call over `parts` (`_take`); its scores go to their jobs, a finished job is
        answered. Raises what the model raised (or a RuntimeError for a wrong count of scores)."""
        prompts = [p for j, s, n in parts for p in j.prompts[s:s + n]]
        responses = [r for j, s, n in parts for r in j.responses[s:s + n]]
        scores = [float(x) for x in self.score_fn(prompts, responses)]
        if len(scores) != len(prompts):
            raise RuntimeError(f"scorer returned {len(scores)} scores for {len(prompts)} items")
        self.batches += 1
        self.items += len(prompts)
        at = 0
        for j, s, n in parts:
            j.scores[s:s + n] = scores[at:at + n]
            j.handed += n
            at += n
            if j.handed == len(j.prompts):
                self.requests += 1
                self._finish(j)

    def _run(self) -> None:
        while self._admit():
            for j in [j for j in self._active if j.cancelled]:
                self._finish(j, "cancelled")
            parts = self._take()
            if not parts:
                continue
            try:
                self._call(parts)
            except Exception as e:
                if len(parts) == 1:
                    self._finish(parts[0][0], f"{type(e).__name__}: {e}")
                    continue
                for part in parts:     # one job's items broke the shared call: each job alone, only its own fails
                    try:
                        self._call([part])
                    except Exception as e1:
                        self._finish(part[0], f"{type(e1).__name__}: {e1}")
        for j in list(self._active):
            self._finish(j, "the reward server is shutting down")
        while True:
            try:
                j = self._q.get_nowait()
            except queue.Empty:
                return
            if j is not None:
                self._finish(j, "the reward server is shutting down")


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address (127.0.0.0/8, ::1, localhost)."""
    if not host:
        return False                   # "" binds every interface
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def _family(host: str) -> int:
    """The socket family that binds `host` (an IPv6 address such as ``::1`` needs AF_INET6)."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET           # a name (localhost) or "" (every interface)


def check_port(host: str, port: int) -> None:
    """ValueError when (`host`, `port`) cannot be bound now (in use, or no such address here), so
    ``serve-rm`` says so in one line before it loads the model rather than after."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as HTTPServer binds
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def check_bind(host: str, token: Optional[str]) -> None:
    """Raise ValueError when `host` is not loopback and there is no token: the server would let
    anyone on the network use the model (and its CPU/GPU) unauthenticated."""
    if not token and not is_loopback(host):
        raise ValueError(f"refusing to listen on {host or 'all interfaces'!r} without a token: set ${TOKEN_ENV} "
                         f"(or --token); clients send it as 'Authorization: Bearer <token>'")


class RewardHTTPServer(HTTPServer):
    """An `HTTPServer` serving each connection in its own thread, at most
    ``limits.max_connections`` at once (one more gets 503 and is closed), with a `BatchingScorer`.

    Args:
        address: (host, port) to bind; port 0 picks a free port (see `url`).
        scorer: the batching scorer (closed by the caller: ``server.scorer.close()``).
        model_name: used in log lines only (never sent to clients).
        limits: request limits (`ServerLimits`).
        token: bearer token every request must send; required for a non-loopback `address`.
        count_tokens: ``fn(text) -> int`` for the ``max_text_tokens`` check (None: no check).

    Raises:
        ValueError: a non-loopback address without a token.
    """

    request_queue_size = 128            # listen backlog: connections over the limit get their 503 quickly

    def __init__(self, address: tuple[str, int], scorer: BatchingScorer, model_name: str = "", quiet: bool = True,
                 limits: Optional[ServerLimits] = None, token: Optional[str] = None,
                 count_tokens: Optional[Callable[[str], int]] = None):
        check_bind(address[0], token)
        self.scorer, self.model_name, self.quiet = scorer, model_name, quiet
        self.limits = limits or ServerLimits()
        self.token = token or None
        self._count_tokens, self._count_lock = count_tokens, threading.Lock()
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        self.rejected_busy = 0
        self.address_family = _family(address[0])
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def count_tokens(self, text: str, limit: Optional[int] = None) -> int:
        """Tokens of `text`, or 0 when it cannot exceed `limit` (default ``max_text_tokens``): a
        token is at least one byte, but a SentencePiece tokenizer adds a word-start piece before the
        first word (Llama 2, Mistral: "1" is "▁", "1"), so only texts shorter than the limit in
        bytes are not tokenised."""
        if self._count_tokens is None or len(text.encode()) < (limit or self.limits.max_text_tokens):
            return 0
        with self._count_lock:               # one tokenizer shared by all connection threads
            return self._count_tokens(text)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.rejected_busy += 1
            _reply_busy(request, self.limits.max_connections)
            self.shutdown_request(request)
            return
        threading.Thread(target=self._serve_connection, args=(request, client_address), daemon=True).start()

    def _serve_connection(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception as e:  # a broken connection ends that connection only
            if not self.quiet:
                print(f"[serve-rm] {client_address[0]}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            self.shutdown_request(request)
            self._slots.release()


def _reply_busy(sock: socket.socket, n: int) -> None:
    body = json.dumps({"error": f"server busy: {n} connections already open; retry later"}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.settimeout(1.0)
        sock.sendall(head + body)
    except OSError:
        pass


def _readable(sock: socket.socket) -> bool:
    """Whether `sock` has bytes, an end of file or an error to read now. poll() where the platform
    has it: select() refuses descriptors from FD_SETSIZE (1024) on, which a server holding many
    connections and files reaches (ValueError, and the request was never answered)."""
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(sock, select.POLLIN)
        return bool(p.poll(0))
    return bool(select.select([sock], [], [], 0)[0])


class _DeadlineReader(io.RawIOBase):
    """The connection's bytes, each receive bounded by the handler's request deadline, so a client
    that sends slowly (or not at all) cannot hold a thread longer than ``read_timeout_s``."""

    def __init__(self, handler: "_Handler") -> None:
        super().__init__()
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        h = self.handler
        left = h.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request not received within {h.server.limits.read_timeout_s:g} s")
        h.connection.settimeout(left)
        return h.connection.recv_into(b)


class _Handler(BaseHTTPRequestHandler):
    server: RewardHTTPServer
    protocol_version = "HTTP/1.1"
    deadline = 0.0

    def setup(self) -> None:
        self.timeout = self.server.limits.read_timeout_s      # bounds sends too
        super().setup()
        plain, self.rfile = self.rfile, io.BufferedReader(_DeadlineReader(self), 65536)
        plain.close()                                         # else the socket's fd outlives the connection

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + self.server.limits.read_timeout_s
        super().handle_one_request()

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue``: refuse an oversized body before inviting the client to send it."""
        n = self._too_large()
        if n is not None:
            self._send_too_large(n)
            return False
        return super().handle_expect_100()

    def _too_large(self) -> Optional[int]:
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        return n if n > self.server.limits.max_body_bytes else None

    def _send_too_large(self, n: int) -> None:
        self._send(413, {"error": f"request body of {n} bytes exceeds the limit of {self.server.limits.max_body_bytes} "
                                  f"bytes (--max-body-mb); send fewer texts per request"}, close=True)

    def log_message(self, fmt: str, *args) -> None:
        if not self.server.quiet:
            super().log_message(fmt, *args)

    def _send(self, code: int, obj: dict, close: bool = False, headers: Sequence[tuple[str, str]] = ()) -> None:
        body = json.dumps(obj).encode()
        self.connection.settimeout(self.server.limits.read_timeout_s)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self, has_body: bool) -> bool:
        token = self.server.token
        if token is None:
            return True
        got = self.headers.get("Authorization", "")
        if got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode(), token.encode()):
            return True
        self._send(401, {"error": f"missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                  f"(the client reads ${TOKEN_ENV})"},
                   close=has_body, headers=[("WWW-Authenticate", 'Bearer realm="turborlhf serve-rm"')])
        return False

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        if self.headers.get("Content-Length", "0").strip() != "0" or self.headers.get("Transfer-Encoding"):
            self.close_connection = True                      # a GET body is never read: end the connection after it
        if not self._authorized(has_body=False):
            return
        if self.path.rstrip("/") != "/health":
            self._send(404, {"error": f"unknown path {self.path}; use POST /score or GET /health"})
            return
        s = self.server.scorer
        self._send(200, {"status": "ok", "requests": s.requests, "batches": s.batches, "items": s.items,
                         "dropped": s.dropped,
                         "max_batch_size": s.max_batch_size, "max_wait_ms": s.max_wait_s * 1000,
                         "auth": self.server.token is not None, "limits": asdict(self.server.limits)})

    def _read_body(self) -> Optional[bytes]:
        """The request body, or None after answering an error (size checked before reading)."""
        lim = self.server.limits
        if self.headers.get("Transfer-Encoding"):
            self._send(411, {"error": "chunked bodies are not accepted: send Content-Length"}, close=True)
            return None
        raw = self.headers.get("Content-Length")
        if raw is None:
            self._send(411, {"error": "Content-Length required"}, close=True)
            return None
        try:
            n = int(raw)
            if n < 0:
                raise ValueError
        except ValueError:
            self._send(400, {"error": f"bad Content-Length {raw[:40]!r}"}, close=True)
            return None
        if n > lim.max_body_bytes:
            self._send_too_large(n)
            return None
        try:
            body = self.rfile.read(n)
        except TimeoutError:
            self._send(408, {"error": f"request body not received within {lim.read_timeout_s:g} s"}, close=True)
            return None
        if len(body) < n:                       # the client closed early: nobody to answer
            self.close_connection = True
            return None
        return body

    def _parse(self, body: bytes) -> Optional[tuple[list[str], list[str]]]:
        lim = self.server.limits
        try:
            req = json.loads(body or b"null")
            if not isinstance(req, dict) or "prompts" not in req or "responses" not in req:
                raise ValueError("need an object with 'prompts' and 'responses'")
            prompts, responses = req["prompts"], req["responses"]
            if not (isinstance(prompts, list) and isinstance(responses, list)
                    and all(isinstance(x, str) for x in prompts + responses)):
                raise ValueError("'prompts' and 'responses' must be lists of strings")
            if len(prompts) != len(responses):
                raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
            for name, texts in (("prompts", prompts), ("responses", responses)):
                for i, t in enumerate(texts):
                    try:
                        t.encode("utf-8")
                    except UnicodeEncodeError:        # JSON's "\ud800": no text a tokenizer can read
                        raise ValueError(f"{name}[{i}] is not valid Unicode (a lone surrogate escape)") from None
        except RecursionError:
            self._send(400, {"error": "bad request: JSON nested too deeply"})
            return None
        except ValueError as e:
            self._send(400, {"error": f"bad request: expected JSON {{'prompts': [str], 'responses': [str]}}: {e}"})
            return None
        if len(prompts) > lim.max_texts:
            self._send(413, {"error": f"{len(prompts)} prompt/response pairs exceed the limit of {lim.max_texts} "
                                      f"per request (--max-texts); split the request"})
            return None
        for name, texts in (("prompts", prompts), ("responses", responses)):
            limit = min(lim.max_text_tokens, (name == "responses" and lim.max_response_tokens) or lim.max_text_tokens)
            for i, t in enumerate(texts):
                n = self.server.count_tokens(t, limit)
                if n > lim.max_text_tokens:
                    self._send(413, {"error": f"{name}[{i}] has {n} tokens, over the limit of {lim.max_text_tokens} "
                                              f"per text (--max-text-tokens)"})
                    return None
                if name == "responses" and lim.max_response_tokens and n > lim.max_response_tokens:
                    self._send(413, {"error": f"responses[{i}] has {n} tokens: with its EOS it does not fit the "
                                              f"model's --max-len, so its end (where the reward is read) would be "
                                              f"cut; at most {lim.max_response_tokens} tokens"})
                    return None
        return prompts, responses

    def _client_gone(self) -> bool:
        """Whether the client closed (or reset) the connection while its request waits: the socket
        reads as end of file. Bytes a client sent meanwhile (its next request) are left unread."""
        sock = self.connection
        try:
            if not _readable(sock):
                return False
            return sock.recv(1, socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)) == b""
        except BlockingIOError:
            return False
        except OSError:                           # reset by the peer
            return True

    def do_POST(self) -> None:  # noqa: N802
        if not self._authorized(has_body=True):
            return
        if self.path.rstrip("/") != "/score":
            self._send(404, {"error": f"unknown path {self.path}; use POST /score or GET /health"}, close=True)
            return
        body = self._read_body()
        if body is None:
            return
        parsed = self._parse(body)
        if parsed is None:
            return
        try:
            scores = self.server.scorer.score(*parsed, timeout_s=self.server.limits.score_timeout_s,
                                              abandoned=self._client_gone)
        except ConnectionAbortedError:             # nobody to answer
            self.close_connection = True
            return
        except TimeoutError as e:
            self._send(503, {"error": str(e)}, headers=[("Retry-After", "1")])
            return
        except RuntimeError as e:
            self._send(500, {"error": str(e)})
            return
        self._send(200, {"scores": scores})


def make_server(score_fn: ScoreFn, host: str = "127.0.0.1", port: int = 8000, max_batch_size: int = 16,
                max_wait_ms: float = 10.0, model_name: str = "", quiet: bool = True,
                limits: Optional[ServerLimits] = None, token: Optional[str] = None,
                count_tokens: Optional[Callable[[str], int]] = None) -> RewardHTTPServer:
    """Bind a server (``port=0`` picks a free port; see ``server.url``). Run it with
    ``server.serve_forever()``; stop it with ``server.shutdown(); server.server_close();
    server.scorer.close()``. Raises ValueError for a non-loopback `host` without a `token`."""
    check_bind(host, token)                     # before the scorer's thread starts
    scorer = BatchingScorer(score_fn, max_batch_size, max_wait_ms)
    try:
        return RewardHTTPServer((host, port), scorer, model_name, quiet, limits, token, count_tokens)
    except BaseException:
        scorer.close()
        raise


class RMScorer:
    """``fn(prompts, responses) -> list[float]`` over a reward-model directory (`score_texts`),
    with ``count_tokens(text)`` by the model's tokenizer. A `HardwareError` for a `device` this
    host lacks names `device_field`, the setting it came from."""

    def __init__(self, model_dir: str, dtype: str = "auto", max_len: int = 1024, batch_size: int = 16,
                 device: str = "auto", device_field: str = "device") -> None:
        import torch

        from turborlhf.engine.hardware import compute_dtype, resolve_device
        from turborlhf.models.load import load_tokenizer
        from turborlhf.rewards.model import load_reward_model

        dev = resolve_device(device, device_field)
        dtype = compute_dtype(dtype, dev)       # auto: bf16 only where the device computes it natively
        self.tok = load_tokenizer(model_dir)
        self.model = load_reward_model(model_dir, self.tok, device=dev,     # the checkpoint's pooling pad id
                                       dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
        self.model.requires_grad_(False)
        self.dtype, self.max_len, self.batch_size = dtype, max_len, batch_size

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        from turborlhf.rewards.model import score_texts

        # a response that fits (`ServerLimits.max_response_tokens`) is scored whole with its EOS: the prompt is cut
        return score_texts(self.model, self.tok, prompts, responses, self.max_len, self.dtype, self.batch_size,
                           min_response_tokens=self.max_len - 1).tolist()

    def count_tokens(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])


def load_rm_scorer(model_dir: str, dtype: str = "auto", max_len: int = 1024, batch_size: int = 16,
                   device: str = "auto", device_field: str = "device") -> RMScorer:
    """`RMScorer` over a reward-model directory."""
    return RMScorer(model_dir, dtype, max_len, batch_size, device, device_field)


def main(argv: Optional[list[str]] = None) -> int:
    d = ServerLimits()
    p = argparse.ArgumentParser(prog="turborlhf serve-rm", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="reward-model directory (AutoModelForSequenceClassification)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (a non-loopback one needs a token)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free port; the URL is printed)")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"bearer token clients must send (default ${TOKEN_ENV}; prefer the variable: "
                        "arguments are visible to other users of the machine)")
    p.add_argument("--max-batch-size", type=int, default=16, help="items per model call (gathered across requests)")
    p.add_argument("--max-wait-ms", type=float, default=10.0, help="how long a batch waits for more requests")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per scored sequence (prompt cut from the left; "
                   "a response that does not fit gets 413)")
    p.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20, help="largest request body (MiB)")
    p.add_argument("--max-texts", type=int, default=d.max_texts, help="prompt/response pairs per request")
    p.add_argument("--max-text-tokens", type=int, default=d.max_text_tokens, help="tokens per prompt or response")
    p.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s,
                   help="seconds for a whole request to arrive (slow/idle connections are closed)")
    p.add_argument("--max-connections", type=int, default=d.max_connections, help="connections served at once")
    p.add_argument("--score-timeout-s", type=float, default=d.score_timeout_s, help="seconds a request may wait for scores")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="reward-model compute precision (auto: bf16 only where the device computes it natively)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="where the reward model runs (auto: cuda, then mps, then cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores or $TURBORLHF_THREADS)")
    p.add_argument("--verbose", action="store_true", help="log every HTTP request")
    a = p.parse_args(argv)
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be 0 … 65535, got {a.port}")
    if a.max_batch_size < 1 or a.max_wait_ms < 0 or a.max_len < 3:
        p.error(f"need --max-batch-size >= 1, --max-wait-ms >= 0 and --max-len >= 3; got {a.max_batch_size}, "
                f"{a.max_wait_ms:g}, {a.max_len}")
    try:
        limits = ServerLimits(int(a.max_body_mb * 2**20), a.max_texts, a.max_text_tokens, a.read_timeout_s,
                              a.max_connections, a.score_timeout_s, max_response_tokens=max(1, a.max_len - 2))
        check_bind(a.host, a.token)
        check_port(a.host, a.port)
    except ValueError as e:
        print(f"serve-rm: error: {e}", file=sys.stderr)
        return 2
    from turborlhf.engine.train import set_threads

    set_threads(a.threads)
    score = load_rm_scorer(a.model, a.dtype, a.max_len, a.max_batch_size, a.device, device_field="--device")
    server = make_server(score, a.host, a.port, a.max_batch_size, a.max_wait_ms, a.model, quiet=not a.verbose,
                         limits=limits, token=a.token, count_tokens=score.count_tokens)
    print(f"[serve-rm] {a.model} on {server.url} (POST /score, GET /health; max_batch_size={a.max_batch_size}, "
          f"max_wait_ms={a.max_wait_ms:g}, auth={'bearer token' if a.token else 'none (loopback only)'})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.scorer.close()
    print("[serve-rm] stopped", file=sys.stderr, flush=True)
    return 0
