"""task.reward=remote against a real local HTTP server: one POST per batch, failures score 0 and count."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles.config.schema import TaskCfg
from miles.data.rewards import build_scorer, get_reward_fn


class Handler(BaseHTTPRequestHandler):
    requests: list = []  # bodies received, in order

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.requests.append(body)
        mode = self.path.strip("/")
        if mode == "error":
            return self.send_error(500, "scorer crashed")
        if mode not in ("ok", "short", "mixed", "slow", "garbage"):
            return self.send_error(404)
        if mode == "slow":
            time.sleep(1.0)
        samples = body["samples"]
        rewards = {"ok": [float(s["response"] == s["label"]) for s in samples],
                   "short": [1.0], "mixed": [1.0, "high"], "slow": [1.0] * len(samples), "garbage": None}[mode]
        reply = b"not json" if mode == "garbage" else json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):  # quiet test output
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def scorer(url: str, timeout_s: float = 5.0):
    return build_scorer(TaskCfg(name="t", reward="remote", reward_url=url, reward_timeout_s=timeout_s))


ITEMS = [("42", "42", {"prompt": "6*7="}), ("41", "42", {"prompt": "6*7="})]


def test_one_request_per_batch_with_every_sample(server):
    Handler.requests.clear()
    assert scorer(f"{server}/ok").score(ITEMS) == ([1.0, 0.0], 0)
    assert Handler.requests == [{"samples": [
        {"response": "42", "label": "42", "info": {"prompt": "6*7="}},
        {"response": "41", "label": "42", "info": {"prompt": "6*7="}}]}]


@pytest.mark.parametrize("mode", ["error", "nope", "garbage", "short"])  # 500, 404, not JSON, 1 reward for 2
def test_a_failed_request_scores_every_sample_0_and_counts_them(server, mode):
    assert scorer(f"{server}/{mode}").score(ITEMS) == ([0.0, 0.0], 2)


def test_non_numeric_entries_count_one_by_one(server):
    assert scorer(f"{server}/mixed").score(ITEMS) == ([1.0, 0.0], 1)


def test_a_slow_reply_times_out(server):
    start = time.perf_counter()
    assert scorer(f"{server}/slow", timeout_s=0.2).score(ITEMS) == ([0.0, 0.0], 2)
    assert time.perf_counter() - start < 0.8


def test_an_unreachable_server_scores_0():
    assert scorer("http://127.0.0.1:9/").score(ITEMS) == ([0.0, 0.0], 2)  # port 9 (discard): refused


def test_remote_needs_a_url():
    with pytest.raises(ValueError, match="task.reward=remote needs task.reward_url"):
        get_reward_fn("remote", TaskCfg(name="t", reward="remote"))
