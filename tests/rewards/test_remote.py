"""The serve-rm HTTP server (batching) and its client (timeouts, retries, clear errors), with a fake
scorer in-process; the real reward model over a `turborlhf serve-rm` subprocess is in
tests/e2e/test_ppo_variants_e2e.py."""
import socket
import threading
import time

import pytest

from turborlhf.rewards.remote import RemoteRewardError, RemoteRewardModel
from turborlhf.rewards.server import make_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def fake_server():
    calls = []

    def score(prompts, responses):
        calls.append(len(prompts))
        time.sleep(0.02)
        if "boom" in responses:
            raise RuntimeError("model exploded")
        return [float(len(p) + 10 * len(r)) for p, r in zip(prompts, responses)]

    server = make_server(score, port=0, max_batch_size=64, max_wait_ms=300)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server, calls
    server.shutdown()
    server.server_close()
    server.scorer.close()


def test_scores_health_and_batching(fake_server):
    server, calls = fake_server
    client = RemoteRewardModel(server.url + "/score", timeout_s=10, retries=0)
    assert client.score(["ab", "c"], ["x", "yyy"]) == [12.0, 31.0]
    assert client.score([], []) == []
    # 8 concurrent single-item requests are answered by fewer model calls
    calls.clear()
    results = [None] * 8
    barrier = threading.Barrier(8)

    def one(i):
        barrier.wait()
        results[i] = client.score(["p" * i], ["r"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[float(i + 10)] for i in range(8)]
    assert sum(calls) == 8 and len(calls) < 8, calls
    health = client.health()
    assert health["status"] == "ok" and health["items"] == 10 and health["batches"] == 1 + len(calls)


def test_server_errors_reach_the_client(fake_server):
    server, _ = fake_server
    client = RemoteRewardModel(server.url, timeout_s=10, retries=1, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=r"did not answer after 2 tries: HTTP 500: RuntimeError: model exploded"):
        client.score(["p"], ["boom"])
    with pytest.raises(RemoteRewardError, match=r"rejected the request \(HTTP 400\).*1 prompts but 2 responses"):
        client._request("/score", {"prompts": ["a"], "responses": ["b", "c"]})
    with pytest.raises(RemoteRewardError, match="HTTP 404"):
        client._request("/nope", None)


def test_down_server_fails_fast_naming_the_url():
    url = f"http://127.0.0.1:{_free_port()}"
    client = RemoteRewardModel(url, timeout_s=0.5, retries=2, backoff_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError, match=rf"reward model at {url} did not answer after 3 tries: .*refused"):
        client.score(["p"], ["r"])
    assert time.perf_counter() - t0 < 5


def test_slow_server_times_out():
    with socket.socket() as s:  # accepts connections, never answers
        s.bind(("127.0.0.1", 0))
        s.listen()
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        client = RemoteRewardModel(url, timeout_s=0.2, retries=1, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match=rf"{url} did not answer after 2 tries: timed out after 0.2 s"):
            client.score(["p"], ["r"])


@pytest.mark.parametrize("trickled", ["headers", "body"])
def test_a_trickling_answer_times_out_at_the_deadline(trickled):
    """A server sending its answer a byte at a time, each byte well within the socket timeout, was
    waited for until the last byte (forever for an endless trickle): the training step hung."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n"
    body = b'{"scores": [1.0]}'
    fast, slow = (b"", head + body) if trickled == "headers" else (head, body)

    def serve(sock):
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:             # closed by the test
                return
            with conn:
                try:
                    conn.recv(65536)
                    conn.sendall(fast)
                    for i in range(len(slow)):
                        time.sleep(0.05)
                        conn.sendall(slow[i:i + 1])
                except OSError:         # the client gave up
                    pass

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        s.settimeout(5)
        threading.Thread(target=serve, args=(s,), daemon=True).start()
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        client = RemoteRewardModel(url, timeout_s=0.4, retries=1, backoff_s=0.01)
        t0 = time.perf_counter()
        with pytest.raises(RemoteRewardError, match=rf"{url} did not answer after 2 tries: timed out after 0.4 s"):
            client.score(["p"], ["r"])
        assert time.perf_counter() - t0 < 2.0


def test_bad_url():
    with pytest.raises(ValueError, match="http://"):
        RemoteRewardModel("localhost:8000")
    with pytest.raises(ValueError, match="numeric port"):
        RemoteRewardModel("http://127.0.0.1:80oo")
    with pytest.raises(ValueError, match="no user name or password") as e:
        RemoteRewardModel("http://user:secret@127.0.0.1:8000")
    assert "secret" not in str(e.value)


def test_a_redirect_is_an_error_and_the_token_stays_home():
    """A 302 to another host was followed with the bearer token, and the POST arrived there as a GET
    without its body; whatever it answered was taken as the scores."""
    elsewhere = []

    def serve(sock, reply):
        try:
            conn, _ = sock.accept()
        except OSError:                 # closed by the test: nobody came
            return
        with conn:
            elsewhere.append(conn.recv(65536)) if reply is None else conn.recv(65536)
            conn.sendall(reply or b'HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n{"scores": [0.0]}')

    with socket.socket() as other, socket.socket() as first:
        for s in (other, first):
            s.bind(("127.0.0.1", 0))
            s.listen()
            s.settimeout(5)
        moved = (f"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{other.getsockname()[1]}/score\r\n"
                 "Content-Length: 0\r\nConnection: close\r\n\r\n").encode()
        threading.Thread(target=serve, args=(first, moved), daemon=True).start()
        threading.Thread(target=serve, args=(other, None), daemon=True).start()
        client = RemoteRewardModel(f"http://127.0.0.1:{first.getsockname()[1]}", timeout_s=2, retries=0, token="TOKEN")
        with pytest.raises(RemoteRewardError, match=r"redirected the request \(HTTP 302\) to http://127.0.0.1:\d+/score"):
            client.score(["p"], ["r"])
        time.sleep(0.2)
        assert elsewhere == []
