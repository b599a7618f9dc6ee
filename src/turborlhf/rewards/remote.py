"""HTTP client for a reward model served by ``turborlhf serve-rm`` (see `turborlhf.rewards.server`).

Protocol (JSON over HTTP/1.1)::

    POST <url>/score   {"prompts": [str, ...], "responses": [str, ...]}  ->  {"scores": [float, ...]}
    GET  <url>/health  -> {"status": "ok", "model": ..., "requests": n, "batches": m, ...}

``prompts`` are chat-template-rendered prompt texts and ``responses`` plain response texts; the
server appends EOS and scores the last token, exactly as `turborlhf.rewards.model.score_texts`.

Failures: a connection error, a timeout or an HTTP 5xx answer is retried ``retries`` times with
exponential backoff (``backoff_s · 2^k``); an HTTP 4xx answer (a bad request) and a malformed
answer are not retried. When no try succeeds, `RemoteRewardError` names the role and the URL:
``reward model at http://127.0.0.1:8000 did not answer after 3 tries: <last error>``.

Only the standard library is used (``urllib``), so the client adds no dependency.
"""
from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.request
from typing import Sequence

__all__ = ["RemoteRewardError", "RemoteRewardModel"]


class RemoteRewardError(RuntimeError):
    """The remote reward model is down, too slow, or answered with an error."""


class RemoteRewardModel:
    """Scores (prompt, response) texts with a remote reward model.

    Args:
        url: base URL of the server (``http://host:port``); a trailing ``/score`` is accepted.
        timeout_s: seconds to wait for one HTTP answer (connect + read).
        retries: further tries after a failed one (total tries = ``retries + 1``).
        backoff_s: wait before the first retry; doubles after each further failure.
        role: how errors name the server (``reward model``, ``critic``, ...).

    Raises:
        ValueError: a URL that is not ``http://`` or ``https://``, or negative retries/timeouts.
    """

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 2, backoff_s: float = 0.5,
                 role: str = "reward model") -> None:
        base = url.rstrip("/")
        if base.endswith("/score"):
            base = base[: -len("/score")]
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"{role} URL must start with http:// or https://, got {url!r}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"{role} at {base}: need timeout_s > 0, retries >= 0, backoff_s >= 0")
        self.url, self.timeout_s, self.retries, self.backoff_s, self.role = base, timeout_s, retries, backoff_s, role

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One score per (prompt, response) pair, in order.

        Raises:
            RemoteRewardError: down / timed out after all tries, an HTTP error answer, or a
                malformed answer (not JSON, wrong number of scores, non-finite scores).
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if not prompts:
            return []
        answer = self._request("/score", {"prompts": list(prompts), "responses": list(responses)})
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != len(prompts):
            raise RemoteRewardError(f"{self.role} at {self.url} sent a malformed answer: expected "
                                    f"{{'scores': [{len(prompts)} numbers]}}, got {str(answer)[:200]}")
        if not all(isinstance(s, (int, float)) and math.isfinite(s) for s in scores):
            raise RemoteRewardError(f"{self.role} at {self.url} sent non-finite scores: {scores[:8]}")
        return [float(s) for s in scores]

    def health(self) -> dict:
        """The server's ``GET /health`` answer (status, model, request and batch counters).

        Raises:
            RemoteRewardError: as :meth:`score`.
        """
        return self._request("/health", None)

    def _request(self, path: str, payload: dict | None):
        url = self.url + path
        data = None if payload is None else json.dumps(payload).encode()
        tries = self.retries + 1
        last = ""
        for k in range(tries):
            if k:
                time.sleep(self.backoff_s * 2 ** (k - 1))
            req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    body = resp.read()
            except urllib.error.HTTPError as e:
                detail = _error_text(e)
                if e.code < 500:  # our request is wrong: retrying cannot help
                    raise RemoteRewardError(f"{self.role} at {self.url} rejected the request "
                                            f"(HTTP {e.code}): {detail}") from None
                last = f"HTTP {e.code}: {detail}"
                continue
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                if isinstance(reason, (socket.timeout, TimeoutError)):
                    last = f"timed out after {self.timeout_s:g} s"
                continue
            try:
                return json.loads(body)
            except json.JSONDecodeError:
                raise RemoteRewardError(f"{self.role} at {self.url} sent an answer that is not JSON: "
                                        f"{body[:200]!r}") from None
        raise RemoteRewardError(f"{self.role} at {self.url} did not answer after {tries} "
                                f"{'try' if tries == 1 else 'tries'}: {last}")


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        body = e.read().decode(errors="replace")
        return json.loads(body).get("error", body)
    except Exception:
        return str(e.reason)
