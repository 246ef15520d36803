"""A real `specq serve` in a subprocess on a free loopback port (the server picks it: --port 0), for tests."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from cli_bin import SPECQ

START_TIMEOUT_S = 120  # loading even the tiny models can take a while on a busy 2-core machine
_PORT = re.compile(r"on http://127\.0\.0\.1:(\d+)/v1")


MARGIN_BUG = 0.5  # INTERFACES.md, Exactness: a divergence at a logit margin above this is a bug, not rounding


def divergence_margin(got: list, want: list) -> float | None:
    """Where two greedy answers first differ by a token, given their OpenAI `logprobs.content` entries: the gap
    between the two tokens' raw log-probabilities there (the same prefix: a difference of logits); None where they
    agree token for token. llama.cpp's batched and single-row kernels round differently, so at a near tie (a gap
    well under MARGIN_BUG) either token may come out."""
    i = next((i for i, (x, y) in enumerate(zip(got, want)) if x.bytes != y.bytes), None)
    if i is None:
        return None if len(got) == len(want) else float("inf")
    return abs(want[i].logprob - got[i].logprob)


class ServerProc:
    """`specq serve ARGS` listening on 127.0.0.1; always stop() it (the fixtures do, in their teardown)."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen([SPECQ, "serve", "--host", "127.0.0.1", "--port", "0", *args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log_file,
                                     env=env)
        try:
            self.port = self._wait_for_port()
        except BaseException:
            self.stop(signal.SIGKILL)
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            m = _PORT.search(self.log.read_text())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"specq serve exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"specq serve did not start in {START_TIMEOUT_S}s: {self.log.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the server and wait for it (killing it if it does not stop in time); its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()
        return self.proc.returncode

    def stderr(self) -> str:
        return self.log.read_text()

    def metrics(self, api_key: str | None = None) -> dict[str, float]:
        """/metrics as {'name{labels}': value}."""
        _, text = http(f"{self.url}/metrics", api_key=api_key)
        out = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


def http(url: str, body: bytes | dict | None = None, api_key: str | None = None, headers: dict | None = None,
         method: str | None = None, timeout: float = 60) -> tuple[int, bytes]:
    """A raw request (for what the openai client cannot send: bad JSON, oversize bodies); (status, body)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    h = {"Content-Type": "application/json", **(headers or {})}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def serve_in_process(engine, bodies: list[dict], defaults, concurrent: bool = False,
                     before: list[dict] = ()) -> list[tuple[int, bytes]]:
    """`specq serve`'s library in this process on a free loopback port: the models load and compute on this
    thread (as in the real server's main thread) while a client thread posts each body to /v1/completions, then
    SIGTERM drains and stops it. `engine`: an EngineConfig. Returns each answer's (status, body), those of
    `before` first (posted one after another ahead of `bodies`); `concurrent`: `bodies` posted at once, from a
    thread each."""
    import os
    import threading

    from specq.native.serving.app import ServeConfig, bind_socket, open_server

    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    ready, answers = threading.Event(), []

    def client() -> None:
        try:
            assert ready.wait(120)
            for body in before:
                answers.append(http(f"{url}/v1/completions", body, timeout=120))
            if concurrent:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(len(bodies)) as pool:
                    answers.extend(pool.map(lambda b: http(f"{url}/v1/completions", b, timeout=120), bodies))
            for body in bodies if not concurrent else ():
                answers.append(http(f"{url}/v1/completions", body, timeout=120))
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # drains and stops serve(), as a user's `kill` would

    server = open_server(engine, template=None, defaults=defaults, cfg=ServeConfig())
    try:
        asker = threading.Thread(target=client, daemon=True)
        asker.start()
        server.serve(sock, on_ready=ready.set)
        asker.join(60)
    finally:
        server.close()
        sock.close()
    return answers
