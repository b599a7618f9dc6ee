"""HTTP client for a reward model served by ``turborlhf serve-rm`` (see `turborlhf.rewards.server`).

Protocol (JSON over HTTP/1.1)::

    POST <url>/score   {"prompts": [str, ...], "responses": [str, ...]}  ->  {"scores": [float, ...]}
    GET  <url>/health  -> {"status": "ok", "requests": n, "batches": m, "limits": {...}, ...}

``prompts`` are chat-template-rendered prompt texts and ``responses`` plain response texts; the
server appends EOS and scores the last token, exactly as `turborlhf.rewards.model.score_texts`.

Authentication: with a token (argument, or ``$TURBORLHF_RM_TOKEN``) every request sends
``Authorization: Bearer <token>``, as ``turborlhf serve-rm --token`` requires.

Requests of more than ``max_texts`` pairs are sent as several requests (the server's
``--max-texts`` limit defaults to 1024).

Deadline: a try times out unless its whole answer (status line, headers, body) has arrived within
``timeout_s`` seconds of the try's start, so a server that trickles its answer is cut off there
instead of being waited for as long as it keeps sending.

Failures: a connection error, a timeout, a reply that is not HTTP or is cut short, or an HTTP
5xx answer is retried ``retries`` times with exponential backoff (``backoff_s · 2^k``); an HTTP
4xx answer (a bad request) and a malformed answer (not JSON, wrong count, a score that is not a
finite number, booleans included) are not retried. Every failure is one `RemoteRewardError` line
naming the role and the URL, e.g.
``reward model at http://127.0.0.1:8000 did not answer after 3 tries: <last error>``.

Only the standard library is used (``urllib``), so the client adds no dependency.
"""
from __future__ import annotations

import functools
import http.client
import io
import json
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

from turborlhf.rewards.functions import finite_number

__all__ = ["RemoteRewardError", "RemoteRewardModel", "TOKEN_ENV"]

#: environment variable holding the bearer token (same as `turborlhf.rewards.server.TOKEN_ENV`)
TOKEN_ENV = "TURBORLHF_RM_TOKEN"


class RemoteRewardError(RuntimeError):
    """The remote reward model is down, too slow, or answered with an error."""


class RemoteRewardModel:
    """Scores (prompt, response) texts with a remote reward model.

    Args:
        url: base URL of the server (``http://host:port``); a trailing ``/score`` is accepted.
        timeout_s: seconds from a try's start (connecting) to its answer's last byte; not merely
            each read's wait, so a server that keeps sending, however slowly, is cut off. A try
            past it is a timeout, retried as the others.
        retries: further tries after a failed one (total tries = ``retries + 1``).
        backoff_s: wait before the first retry; doubles after each further failure.
        role: how errors name the server (``reward model``, ``critic``, ...).
        token: bearer token sent with every request (default ``$TURBORLHF_RM_TOKEN``; None or
            empty: no ``Authorization`` header).
        max_texts: pairs per request; longer lists are split into several requests.

    Redirects are not followed (an error naming the new location): the token would go along to
    another host, and a redirected POST arrives as a GET without its body.

    Raises:
        ValueError: a URL that is not ``http://`` or ``https://``, has no host, a port that is not
            a number, or a user name or password in it; negative retries/timeouts.
    """

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 2, backoff_s: float = 0.5,
                 role: str = "reward model", token: Optional[str] = None, max_texts: int = 256) -> None:
        base = url.rstrip("/")
        if base.endswith("/score"):
            base = base[: -len("/score")]
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"{role} URL must start with http:// or https://, got {url!r}")
        _check_url(base, role)
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_texts < 1:
            raise ValueError(f"{role} at {base}: need timeout_s > 0, retries >= 0, backoff_s >= 0, max_texts >= 1")
        self.url, self.timeout_s, self.retries, self.backoff_s, self.role = base, timeout_s, retries, backoff_s, role
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.max_texts = max_texts

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One score per (prompt, response) pair, in order.

        Raises:
            RemoteRewardError: down / timed out after all tries, an HTTP error answer, or a
                malformed answer (not JSON, wrong number of scores, non-finite scores).
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        out: list[float] = []
        for s in range(0, len(prompts), self.max_texts):
            out += self._score_chunk(list(prompts[s:s + self.max_texts]), list(responses[s:s + self.max_texts]))
        return out

    def _score_chunk(self, prompts: list[str], responses: list[str]) -> list[float]:
        answer = self._request("/score", {"prompts": prompts, "responses": responses})
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != len(prompts):
            raise RemoteRewardError(f"{self.role} at {self.url} sent a malformed answer: expected "
                                    f"{{'scores': [{len(prompts)} numbers]}}, got {str(answer)[:200]}")
        bad = [i for i, s in enumerate(scores)
               if isinstance(s, bool) or not isinstance(s, (int, float)) or not finite_number(s)]
        if bad:
            raise RemoteRewardError(f"{self.role} at {self.url} sent scores that are not finite numbers: "
                                    f"scores[{bad[0]}] = {json.dumps(scores[bad[0]])[:60]} ({len(bad)} bad)")
        return [float(s) for s in scores]

    def health(self) -> dict:
        """The server's ``GET /health`` answer (status, request and batch counters, limits).

        Raises:
            RemoteRewardError: as :meth:`score`.
        """
        answer = self._request("/health", None)
        if not isinstance(answer, dict):
            raise RemoteRewardError(f"{self.role} at {self.url} sent a malformed /health answer: {str(answer)[:200]}")
        return answer

    def _request(self, path: str, payload: dict | None):
        url = self.url + path
        data = None if payload is None else json.dumps(payload).encode()
        tries = self.retries + 1
        last = ""
        for k in range(tries):
            if k:
                time.sleep(self.backoff_s * 2 ** (k - 1))
            headers = {"Content-Type": "application/json"}
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
            req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST", headers=headers)
            req.deadline = time.monotonic() + self.timeout_s   # read by _DeadlineHandler.do_open
            try:
                with _OPENER.open(req, timeout=self.timeout_s) as resp:
                    body = resp.read()
            except urllib.error.HTTPError as e:
                if 300 <= e.code < 400:
                    raise RemoteRewardError(f"{self.role} at {self.url} redirected the request (HTTP {e.code}) to "
                                            f"{e.headers.get('Location')}; give the final URL (redirects are not "
                                            "followed)") from None
                detail = _error_text(e)
                if e.code < 500:  # our request is wrong: retrying cannot help
                    hint = (f" (set ${TOKEN_ENV} to the server's token)" if e.code == 401 else "")
                    raise RemoteRewardError(f"{self.role} at {self.url} rejected the request "
                                            f"(HTTP {e.code}): {detail}{hint}") from None
                last = f"HTTP {e.code}: {detail}"
                continue
            except http.client.HTTPException as e:  # not HTTP, or cut short: a broken server/proxy
                last = f"broken HTTP reply ({type(e).__name__}: {' '.join(str(e).split())[:120] or 'no detail'})"
                continue
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                if isinstance(reason, (socket.timeout, TimeoutError)):
                    last = f"timed out after {self.timeout_s:g} s"
                continue
            try:
                return json.loads(body)
            except (ValueError, RecursionError):       # not JSON, not UTF-8, or absurdly nested
                raise RemoteRewardError(f"{self.role} at {self.url} sent an answer that is not JSON: "
                                        f"{body[:200]!r}") from None
        raise RemoteRewardError(f"{self.role} at {self.url} did not answer after {tries} "
                                f"{'try' if tries == 1 else 'tries'}: {last}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Answer a redirect with its own HTTPError instead of following it."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _DeadlineReader(io.RawIOBase):
    """A response's bytes, each receive bounded by the request's deadline, so a server that sends
    slowly cannot hold the request past it (the socket timeout alone bounds only each wait)."""

    def __init__(self, sock: socket.socket, plain: io.BufferedIOBase, deadline: float) -> None:
        super().__init__()
        self.sock, self.plain, self.deadline = sock, plain, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("answer not received by the deadline")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)

    def close(self) -> None:
        if not self.closed:
            self.plain.close()                      # releases the socket once the response is done
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    """An `http.client.HTTPResponse` whose status line, headers and body are read through a
    `_DeadlineReader`."""

    def __init__(self, sock: socket.socket, *args, deadline: float, **kwargs) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp = io.BufferedReader(_DeadlineReader(sock, self.fp, deadline), 65536)


class _DeadlineHandler:
    """Reads the answer to a request that carries a ``deadline`` (`time.monotonic` seconds) through
    a `_DeadlineResponse`; mixed into urllib's HTTP and HTTPS handlers."""

    def do_open(self, http_class, req, **http_conn_args):
        deadline = getattr(req, "deadline", None)
        if deadline is None:
            return super().do_open(http_class, req, **http_conn_args)

        def connect(host, **kwargs):
            conn = http_class(host, **kwargs)
            conn.response_class = functools.partial(_DeadlineResponse, deadline=deadline)
            return conn

        return super().do_open(connect, req, **http_conn_args)


class _DeadlineHTTPHandler(_DeadlineHandler, urllib.request.HTTPHandler):
    pass


_HANDLERS: list = [_NoRedirect, _DeadlineHTTPHandler]
if hasattr(urllib.request, "HTTPSHandler"):        # Python built with ssl
    class _DeadlineHTTPSHandler(_DeadlineHandler, urllib.request.HTTPSHandler):
        pass

    _HANDLERS.append(_DeadlineHTTPSHandler)

_OPENER = urllib.request.build_opener(*_HANDLERS)


def _check_url(base: str, role: str) -> None:
    """ValueError for a base URL without a host, with a port that is not a number, or with a user
    name or password (the error names the URL without them)."""
    from urllib.parse import urlsplit

    parts = urlsplit(base)
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{role} URL {parts.scheme}://...@{parts.hostname}: give no user name or password in it "
                         f"(the server takes a bearer token: --token or ${TOKEN_ENV})")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname or port == -1:
        raise ValueError(f"{role} URL {base!r}: expected http(s)://host[:port] with a numeric port")


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        body = e.read().decode(errors="replace")
        detail = json.loads(body).get("error", body)
        return " ".join(str(detail).split())[:300]
    except Exception:
        return " ".join(str(e.reason).split())[:300]
