"""serve-rm's limits against a live server on 127.0.0.1 (a fake scorer in-process): body size,
texts per request and tokens per text, read timeouts for slow and half-open clients, a bounded
number of connections, deep JSON, fair batching of large and small requests, bearer-token
authentication, what /health shows; and the client against broken servers on loopback."""
import http.client
import json
import socket
import threading
import time

import pytest

from turborlhf.rewards.remote import RemoteRewardError, RemoteRewardModel
from turborlhf.rewards.server import RewardHTTPServer, ServerLimits, is_loopback, main as serve_main, make_server

HOST = "127.0.0.1"


class _Live:
    """A server on 127.0.0.1:0 run in a thread; stopped on exit."""

    def __init__(self, score=None, **kw):
        self.calls = []

        def default(prompts, responses):
            self.calls.append(len(prompts))
            return [float(len(r)) for r in responses]

        self.server = make_server(score or default, host=HOST, port=0, **kw)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.server.scorer.close()
        self.thread.join(timeout=5)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def raw(self, timeout=5.0) -> socket.socket:
        s = socket.create_connection((HOST, self.port), timeout=timeout)
        return s

    def request(self, method, path, body=None, headers=None, timeout=10.0):
        c = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            c.close()


def _read_reply(s: socket.socket, limit: int = 1 << 16) -> bytes:
    """Everything the server sends until it closes (bounded)."""
    out = b""
    while len(out) < limit:
        chunk = s.recv(4096)
        if not chunk:
            break
        out += chunk
    return out


def _score_body(n=1, text="x"):
    return json.dumps({"prompts": ["p"] * n, "responses": [text] * n}).encode()


# ----------------------------------------------------------------------------------------------
# body size, texts, tokens
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [50 << 20, 8 << 30])
def test_large_body_is_refused_before_it_is_read(length):
    with _Live(limits=ServerLimits(max_body_bytes=1 << 20, read_timeout_s=30)) as live, live.raw() as s:
        s.sendall(f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n\r\n".encode() + b"[" * 65536)   # the start of the body only
        t0 = time.monotonic()
        reply = _read_reply(s)
        assert time.monotonic() - t0 < 5          # answered at once, not after reading 50 MB / 8 GiB
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head
    assert f"{length} bytes exceeds the limit of {1 << 20}" in json.loads(body)["error"]


def test_missing_or_bad_content_length():
    with _Live() as live:
        for head, code in ((b"POST /score HTTP/1.1\r\nHost: x\r\n\r\n", b"411"),
                           (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", b"400"),
                           (b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"411")):
            with live.raw() as s:
                s.sendall(head)
                assert _read_reply(s).startswith(b"HTTP/1.1 " + code)


def test_too_many_texts_and_too_long_texts_get_413():
    limits = ServerLimits(max_texts=100, max_text_tokens=50)
    with _Live(limits=limits, count_tokens=lambda t: len(t.split())) as live:
        client = RemoteRewardModel(f"http://{HOST}:{live.port}", timeout_s=10, retries=2, backoff_s=0.01,
                                   max_texts=5000)
        with pytest.raises(RemoteRewardError, match=r"HTTP 413\): 101 prompt/response pairs exceed the limit of "
                                                    r"100 per request \(--max-texts\)"):
            client.score(["p"] * 101, ["r"] * 101)
        with pytest.raises(RemoteRewardError, match=r"HTTP 413\): responses\[1\] has 60 tokens, over the limit of 50"):
            client.score(["p", "p"], ["short", "w " * 60])
        assert client.score(["p"] * 100, ["r"] * 100) == [1.0] * 100     # at the limit: fine
        # the client splits long lists by itself
        splitting = RemoteRewardModel(f"http://{HOST}:{live.port}", timeout_s=10, retries=0, max_texts=40)
        before = splitting.health()["requests"]
        assert splitting.score(["p"] * 101, ["ab"] * 101) == [2.0] * 101
        assert splitting.health()["requests"] - before == 3


def test_a_response_past_the_models_max_len_gets_413():
    """serve-rm cut a response longer than --max-len without a word: its end, where the reward model
    reads its score, was gone. 413 now; a long prompt is still cut from the left, as in training."""
    limits = ServerLimits(max_text_tokens=500, max_response_tokens=30)
    with _Live(limits=limits, count_tokens=lambda t: len(t.split())) as live:
        client = RemoteRewardModel(f"http://{HOST}:{live.port}", timeout_s=10, retries=0)
        with pytest.raises(RemoteRewardError, match=r"HTTP 413\): responses\[1\] has 31 tokens: with its EOS it "
                                                    r"does not fit the model's --max-len"):
            client.score(["p", "p"], ["short", "w " * 31])
        assert client.score(["w " * 400], ["w " * 30]) == [60.0]        # a long prompt and a response that fits
    with pytest.raises(ValueError, match="max_response_tokens must be > 0"):
        ServerLimits(max_response_tokens=0)


def test_a_text_of_as_many_bytes_as_the_limit_is_counted():
    """Texts no longer than the limit in bytes were not tokenised (a token being at least one byte),
    but a SentencePiece tokenizer's word-start piece before the first word is one token more
    (Llama 2, Mistral: "1" is "▁", "1"): a response of 10 digits is 11 tokens, and with a limit of
    10 it was scored with its EOS cut, where the reward is read, instead of getting 413."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    sp = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(["<unk>", "▁", *"0123456789"])}, merges=[],
                              unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    assert len(sp.encode("1234567890").ids) == 11
    limits = ServerLimits(max_text_tokens=20, max_response_tokens=10)
    with _Live(limits=limits, count_tokens=lambda t: len(sp.encode(t).ids)) as live:
        client = RemoteRewardModel(f"http://{HOST}:{live.port}", timeout_s=10, retries=0)
        with pytest.raises(RemoteRewardError, match=r"HTTP 413\): responses\[0\] has 11 tokens"):
            client.score(["p"], ["1234567890"])
        with pytest.raises(RemoteRewardError, match=r"HTTP 413\): prompts\[0\] has 21 tokens"):
            client.score(["1" * 20], ["1"])
        assert client.score(["1" * 19], ["123456789"]) == [9.0]           # 20 and 10 tokens: fine


def test_deep_json_gets_400():
    with _Live() as live:
        for body in (b"[" * 100_000, b'{"prompts": ' + b"[" * 100_000 + b"]" * 100_000 + b', "responses": []}'):
            status, answer = live.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
            assert status == 400, answer
            assert "nested too deeply" in answer["error"] or "bad request" in answer["error"]
        status, answer = live.request("POST", "/score", body=b"[" * 100_000)
        assert (status, answer["error"]) == (400, "bad request: JSON nested too deeply")
        assert live.request("POST", "/score", body=_score_body())[0] == 200    # still serving


# ----------------------------------------------------------------------------------------------
# slow, half-open and too many clients
# ----------------------------------------------------------------------------------------------

def test_half_open_and_slow_clients_are_timed_out():
    with _Live(limits=ServerLimits(read_timeout_s=0.5)) as live:
        # connects and sends nothing
        with live.raw() as idle:
            t0 = time.monotonic()
            assert _read_reply(idle) == b""
            assert 0.3 < time.monotonic() - t0 < 4
        # sends a byte of the headers every 0.1 s (each read is quick, the request never ends)
        with live.raw() as slow:
            t0 = time.monotonic()
            closed = False
            for ch in b"POST /score HTTP/1.1\r\nHost: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx":
                try:
                    slow.sendall(bytes([ch]))
                except OSError:
                    closed = True
                    break
                slow.settimeout(0.1)
                try:
                    if slow.recv(1) == b"":
                        closed = True
                        break
                except socket.timeout:
                    pass
            assert closed and time.monotonic() - t0 < 4
        # full headers, then only part of the body: 408
        with live.raw() as partial:
            partial.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prom")
            assert _read_reply(partial).startswith(b"HTTP/1.1 408")
        assert live.request("POST", "/score", body=_score_body())[0] == 200


def test_connections_are_bounded():
    with _Live(limits=ServerLimits(read_timeout_s=3.0, max_connections=4)) as live:
        threads_before = threading.active_count()
        socks = [live.raw() for _ in range(300)]         # half-open: never send anything
        try:
            time.sleep(0.3)
            assert threading.active_count() <= threads_before + 4
            busy = 0
            for s in socks[4:]:
                s.settimeout(2.5)
                reply = _read_reply(s)
                busy += reply.startswith(b"HTTP/1.1 503")
            assert busy == 296
        finally:
            for s in socks:
                s.close()
        assert live.server.rejected_busy == 296
        deadline = time.monotonic() + 8                  # the 4 held threads end by the read timeout
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= threads_before
        assert live.request("POST", "/score", body=_score_body())[0] == 200


def test_client_retries_a_busy_server():
    with _Live(limits=ServerLimits(read_timeout_s=1.5, max_connections=1)) as live:
        hog = live.raw()
        time.sleep(0.1)
        client = RemoteRewardModel(f"http://{HOST}:{live.port}", timeout_s=5, retries=4, backoff_s=0.3)
        threading.Timer(0.2, hog.close).start()          # the slot frees up during the backoff
        assert client.score(["p"], ["abc"]) == [3.0]


# ----------------------------------------------------------------------------------------------
# batching: bounded model calls, small requests not starved, a stuck model times out
# ----------------------------------------------------------------------------------------------

def test_large_request_is_split_and_small_requests_ride_along():
    order, gate = [], threading.Event()

    def score(prompts, responses):
        order.append(list(responses))
        if len(order) == 1:
            gate.wait(10)                  # hold the first call until the small request is queued
        time.sleep(0.02)
        return [float(len(r)) for r in responses]

    with _Live(score, max_batch_size=8, max_wait_ms=0, limits=ServerLimits(max_texts=1000)) as live:
        url = f"http://{HOST}:{live.port}"
        big_done, small = threading.Event(), []

        def big():
            RemoteRewardModel(url, timeout_s=30, retries=0, max_texts=1000).score(["p"] * 400, ["bb"] * 400)
            big_done.set()

        def one():
            small.append(RemoteRewardModel(url, timeout_s=30, retries=0).score(["p"], ["s"]))
            small.append(big_done.is_set())

        tb = threading.Thread(target=big)
        tb.start()
        for _ in range(500):
            if order:
                break
            time.sleep(0.01)
        ts = threading.Thread(target=one)
        ts.start()
        for _ in range(500):
            if live.server.scorer._q.qsize():
                break
            time.sleep(0.01)
        gate.set()
        ts.join(timeout=30)
        tb.join(timeout=30)
    assert small == [[1.0], False]                        # answered while the large request still ran
    assert big_done.is_set()
    assert all(len(call) <= 8 for call in order) and sum(map(len, order)) == 401
    assert "s" in order[1], order[:3]                     # in the very next model call


def test_stuck_model_times_the_request_out():
    release = threading.Event()

    def score(prompts, responses):
        release.wait(10)
        return [0.0] * len(prompts)

    with _Live(score, max_wait_ms=0, limits=ServerLimits(score_timeout_s=0.3)) as live:
        status, answer = live.request("POST", "/score", body=_score_body())
        release.set()
    assert status == 503 and "not scored within 0.3 s" in answer["error"]


def test_a_bad_request_fails_alone():
    """A lone surrogate (valid JSON, "\\ud800") got no answer at all (an exception outside the
    request parsing); a model call failing on one request's items failed every request batched
    with it. A 400 for the first; the second is scored again job by job."""
    def score(prompts, responses):
        if "boom" in responses:
            raise ValueError("cannot score boom")
        return [float(len(r)) for r in responses]

    with _Live(score, max_wait_ms=300) as live:
        status, answer = live.request("POST", "/score", body=b'{"prompts": ["p"], "responses": ["\\ud800"]}')
        assert status == 400 and "responses[0] is not valid Unicode" in answer["error"]
        got = {}
        threads = [threading.Thread(target=lambda t=t: got.__setitem__(t, live.request(
            "POST", "/score", body=_score_body(2, t)))) for t in ("boom", "fine")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert got["fine"] == (200, {"scores": [4.0, 4.0]})
    assert got["boom"][0] == 500 and "cannot score boom" in got["boom"][1]["error"]


def test_a_request_whose_client_left_is_not_scored():
    """A client that timed out and closed its connection (to retry) had its request scored anyway,
    after every request queued before it: on a server already too busy, each abandoned copy
    delayed the retries further."""
    release, seen = threading.Event(), []

    def score(prompts, responses):
        seen.append(list(responses))
        release.wait(10)
        return [0.0] * len(prompts)

    with _Live(score, max_wait_ms=0) as live:
        first = threading.Thread(target=live.request, args=("POST", "/score", _score_body(1, "first")))
        first.start()
        while not seen:                                   # the model is busy with the first request
            time.sleep(0.01)
        body = _score_body(1, "left")
        gone = live.raw()
        gone.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.3)
        gone.close()                                      # the client gives up while its request waits
        status, answer = live.request("GET", "/health")   # ... and its copy is dropped, not queued
        deadline = time.monotonic() + 5
        while not answer.get("dropped") and time.monotonic() < deadline:
            time.sleep(0.05)
            status, answer = live.request("GET", "/health")
        release.set()
        first.join(5)
        assert live.request("POST", "/score", body=_score_body(1, "next")) == (200, {"scores": [0.0]})
    assert seen == [["first"], ["next"]]
    assert answer["dropped"] == 1


def test_a_waiting_request_on_a_socket_numbered_past_1024_is_answered():
    """Whether a waiting client had left was asked with select(), which refuses descriptors from
    FD_SETSIZE (1024) on: a server holding that many files and connections answered nothing to
    every request that waited longer than a poll (ValueError), and scored it all the same."""
    import fcntl
    import resource
    from types import SimpleNamespace

    from turborlhf.rewards.server import _Handler

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= 1100:
        if hard != resource.RLIM_INFINITY and hard <= 1100:
            pytest.skip(f"RLIMIT_NOFILE {soft}/{hard}: no descriptor past 1024 here")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    mine, peer = socket.socketpair()
    high = socket.socket(fileno=fcntl.fcntl(mine.fileno(), fcntl.F_DUPFD, 1100))     # the lowest free >= 1100
    mine.close()
    try:
        handler = SimpleNamespace(connection=high)
        assert _Handler._client_gone(handler) is False                # waiting: still there
        peer.sendall(b"GET /health HTTP/1.1\r\n")                    # its next request: still there
        assert _Handler._client_gone(handler) is False
        peer.close()
        high.recv(64)                                                 # (the request read) ... then it left
        assert _Handler._client_gone(handler) is True
    finally:
        high.close()
        peer.close()
        if soft <= 1100:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ----------------------------------------------------------------------------------------------
# authentication and /health
# ----------------------------------------------------------------------------------------------

def test_bearer_token_required_and_accepted(monkeypatch):
    monkeypatch.delenv("TURBORLHF_RM_TOKEN", raising=False)
    with _Live(token="s3cret", model_name="/private/models/rm") as live:
        url = f"http://{HOST}:{live.port}"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, answer = live.request("POST", "/score", body=_score_body(), headers=headers)
            assert status == 401 and "bearer token" in answer["error"]
            assert live.request("GET", "/health", headers=headers)[0] == 401
        with pytest.raises(RemoteRewardError, match=rf"reward model at {url} rejected the request \(HTTP 401\).*"
                                                    r"TURBORLHF_RM_TOKEN"):
            RemoteRewardModel(url, timeout_s=5, retries=2).score(["p"], ["r"])
        assert RemoteRewardModel(url, timeout_s=5, token="s3cret").score(["p"], ["rr"]) == [2.0]
        monkeypatch.setenv("TURBORLHF_RM_TOKEN", "s3cret")
        health = RemoteRewardModel(url, timeout_s=5).health()
    assert health["status"] == "ok" and health["auth"] is True and health["limits"]["max_texts"] == 1024
    assert "/private" not in json.dumps(health) and "model" not in health


def test_health_does_not_show_the_model_path():
    with _Live(model_name="/home/someone/secret-rm") as live:
        status, health = live.request("GET", "/health")
    assert status == 200 and "secret-rm" not in json.dumps(health)
    assert {"requests", "batches", "items", "limits"} <= set(health)


def test_non_loopback_address_needs_a_token(capsys, monkeypatch):
    monkeypatch.delenv("TURBORLHF_RM_TOKEN", raising=False)

    def never_bind(self):  # this test must not listen on any address but loopback, even if the check breaks
        raise AssertionError(f"would bind {self.server_address}")

    monkeypatch.setattr(RewardHTTPServer, "server_bind", never_bind)
    for host in ("0.0.0.0", "", "::", "10.1.2.3"):
        assert not is_loopback(host)
        with pytest.raises(ValueError, match="without a token"):
            make_server(lambda p, r: [0.0] * len(p), host=host, port=0)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert serve_main(["--model", "does-not-exist", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "refusing to listen on '0.0.0.0' without a token" in err
    assert "TURBORLHF_RM_TOKEN" in err


def test_ipv6_loopback_serves_and_a_busy_port_is_one_line_before_the_model_loads(capsys):
    """``--host ::1`` passed the loopback check, then the IPv4-only server died with a traceback; a
    port in use was a traceback after the model had loaded."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        ipv6 = True
    except OSError:
        ipv6 = False
    if ipv6:
        server = make_server(lambda p, r: [float(len(x)) for x in r], host="::1", port=0)
        t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        try:
            assert server.url.startswith("http://[::1]:")
            assert RemoteRewardModel(server.url, timeout_s=5).score(["p", "q"], ["ab", "abc"]) == [2.0, 3.0]
        finally:
            server.shutdown()
            server.server_close()
            server.scorer.close()
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve_main(["--model", "does-not-exist", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"serve-rm: error: cannot listen on {HOST}:{port}: Address already in use" in err


# ----------------------------------------------------------------------------------------------
# the client against broken servers (a raw socket on loopback)
# ----------------------------------------------------------------------------------------------

class _FakeServer:
    """Accepts up to len(replies) connections on 127.0.0.1, answers each with the next raw reply
    (after reading the request's headers and body) and closes it."""

    def __init__(self, replies):
        self.replies, self.served = list(replies), 0
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen()
        self.sock.settimeout(10)
        self.url = f"http://{HOST}:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        for reply in self.replies:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                head, _, body = data.partition(b"\r\n\r\n")
                n = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")), 0)
                while len(body) < n:
                    body += conn.recv(4096)
                conn.sendall(reply)
                self.served += 1

    def close(self):
        self.sock.close()
        self.thread.join(timeout=5)


def _http(body: bytes, status="200 OK") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body


@pytest.mark.parametrize("reply, what", [
    (b"hello, I am not a web server\r\n\r\n", "BadStatusLine"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"scores\": [1", "IncompleteRead"),
])
def test_client_broken_replies_are_retried_then_one_line(reply, what):
    fake = _FakeServer([reply] * 3)
    try:
        client = RemoteRewardModel(fake.url, timeout_s=5, retries=2, backoff_s=0.01)
        with pytest.raises(RemoteRewardError) as e:
            client.score(["p"], ["r"])
    finally:
        fake.close()
    msg = str(e.value)
    assert msg.startswith(f"reward model at {fake.url} did not answer after 3 tries: broken HTTP reply ({what}")
    assert "\n" not in msg and fake.served == 3


def test_client_recovers_after_a_broken_reply_and_a_5xx():
    fake = _FakeServer([b"garbage\r\n\r\n", _http(b'{"error": "overloaded"}', "502 Bad Gateway"),
                        _http(b'{"scores": [0.5, -1]}')])
    try:
        scores = RemoteRewardModel(fake.url, timeout_s=5, retries=2, backoff_s=0.01).score(["a", "b"], ["c", "d"])
    finally:
        fake.close()
    assert scores == [0.5, -1.0] and fake.served == 3


@pytest.mark.parametrize("scores, bad", [("[true]", "true"), ('["1.0"]', '"1.0"'), ("[null]", "null"),
                                         ("[1e999]", "Infinity"), ('[{"v": 1}]', '{"v": 1}')])
def test_client_rejects_scores_that_are_not_numbers(scores, bad):
    fake = _FakeServer([_http(b'{"scores": ' + scores.encode() + b"}")])
    try:
        with pytest.raises(RemoteRewardError, match=r"sent scores that are not finite numbers: scores\[0\] = ") as e:
            RemoteRewardModel(fake.url, timeout_s=5, retries=0).score(["p"], ["r"])
    finally:
        fake.close()
    assert fake.url in str(e.value) and bad in str(e.value)


def test_expect_100_continue_with_a_large_body_is_refused_first():
    with _Live(limits=ServerLimits(max_body_bytes=1000)) as live, live.raw() as s:
        s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
        reply = _read_reply(s)
    assert reply.startswith(b"HTTP/1.1 413") and b"100 Continue" not in reply



def test_token_limit_uses_the_reward_models_tokenizer(tiny_model, tmp_path):
    from turborlhf.bench.data import write_fresh_reward_model
    from turborlhf.rewards.server import load_rm_scorer

    rm = write_fresh_reward_model(tiny_model, tmp_path / "rm")   # serve-rm refuses a causal LM's random head
    scorer = load_rm_scorer(str(rm), "fp32", 64, 4)
    n = scorer.count_tokens("hello there " * 30)
    assert n > 20
    with _Live(scorer, limits=ServerLimits(max_text_tokens=20), count_tokens=scorer.count_tokens) as live:
        client = RemoteRewardModel(f"http://{HOST}:{live.port}", timeout_s=30, retries=0)
        with pytest.raises(RemoteRewardError, match=rf"prompts\[0\] has {n} tokens, over the limit of 20"):
            client.score(["hello there " * 30], ["ok"])
        assert len(client.score(["hello"], ["ok"])) == 1


def test_the_rm_scorer_cuts_the_prompt_not_a_response_that_fits(tmp_path):
    """serve-rm accepts a response of up to --max-len − 2 tokens (413 past it) and promised to cut
    the prompt instead; under a long prompt the shared truncation kept half of max_len for the
    response, so one of 29 tokens (max_len 32) was scored at its 16th token, without its EOS."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.data.tokenize import _ids, response_end_id
    from turborlhf.models.tiny import tiny_llama_config
    from turborlhf.rewards.model import score_token_ids
    from turborlhf.rewards.server import RMScorer

    tok = make_tiny_tokenizer()
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(tiny_llama_config(
        len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        num_labels=1)).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    scorer = RMScorer(str(tmp_path / "rm"), "fp32", max_len=32, batch_size=4, device="cpu")
    prompt, response = "tell me a long story about the pen and the ink " * 4, "once upon a time a cat sat on a mat"
    p_ids, r_ids = _ids(scorer.tok, prompt), _ids(scorer.tok, response)
    assert len(p_ids) > 32 and 16 < len(r_ids) <= 30
    whole = r_ids + [response_end_id(scorer.tok, prompt)]
    want = score_token_ids(scorer.model, scorer.tok.pad_token_id, [p_ids[-(32 - len(whole)):] + whole], "fp32")
    assert scorer([prompt], [response]) == pytest.approx([float(want[0])], abs=1e-6)


@pytest.mark.parametrize("flags", [["--port", "70000"], ["--max-batch-size", "0"], ["--max-wait-ms", "-1"]])
def test_serve_rm_flags_out_of_range_are_usage_errors(flags, capsys):
    """They were tracebacks, after the reward model had loaded."""
    with pytest.raises(SystemExit, match="2"):
        serve_main(["--model", "/nonexistent", *flags])
    assert flags[0] in capsys.readouterr().err
