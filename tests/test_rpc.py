"""--rpc: a tiny target split across two real RPC server processes on 127.0.0.1, the draft kept local.

The session builds llama.cpp's RPC backend once (`specq rpc-build`, cached in ~/.cache/specq/rpc/<version>),
so these tests run on a fresh machine too. Every client runs in a child process: adding RPC devices changes
llama.cpp's device list for the life of a process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from cli_bin import SPECQ
from rpc_servers import RpcServer, free_port
from tinymodels import TinySpec, write_tiny_gguf

from specq.native.commands import rpc

PROMPT = "The quick brown fox"
ONE_LINE_S = 30  # a lost server must end the client within this (the watchdog is set far above it)


@pytest.fixture(scope="session")
def rpc_lib():
    return rpc.build().library  # built once per llama-cpp-python version, then cached


@pytest.fixture(scope="module")
def two_servers(rpc_lib):
    servers = [RpcServer(rpc_lib), RpcServer(rpc_lib)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def slow_target(models_dir):
    """Wider and deeper than tiny_target, so a long generation over RPC takes seconds, not milliseconds."""
    return write_tiny_gguf(models_dir / "rpc_slow.gguf", seed=11, spec=TinySpec(n_layer=6, n_embd=256, n_ff=512))


def _env(lib, **extra) -> dict:
    return dict(os.environ, SPECQ_RPC_LIB=str(lib), OMP_WAIT_POLICY="PASSIVE", **extra)


def _bench(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SPECQ, "bench", "--prompt", PROMPT, "--temp", "0", "--draft-max", "4", "--ctx", "512",
                           "--threads", "1", "--json", "-", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _model_logs(log: str) -> dict[str, str]:
    """llama.cpp's log split per model load: file name → the lines of its load."""
    out = {}
    for part in log.split("llama_model_loader: loaded meta data")[1:]:
        name = part.split(" from ", 1)[1].split(" (version", 1)[0].rsplit("/", 1)[-1]
        out[name] = part.split("llama_context:", 1)[0]  # up to its context (the other model's may follow)
    return out


def test_a_target_split_across_two_rpc_servers_speaks_exactly_like_the_target_alone(
        rpc_lib, two_servers, tiny_target, tiny_close):
    eps = ",".join(s.endpoint for s in two_servers)
    before = [s.accepted() for s in two_servers]
    local = _bench(["--target", str(tiny_target), "--n-predict", "48"], _env(rpc_lib))  # the target alone
    assert local.returncode == 0, local.stderr
    remote = _bench(["--target", str(tiny_target), "--draft", str(tiny_close), "--n-predict", "48", "--rpc", eps,
                     "--tensor-split", "1,1", "-v"], _env(rpc_lib))
    assert remote.returncode == 0, remote.stderr[-3000:]
    doc = json.loads(remote.stdout)
    spec = [r for r in doc["runs"] if r["mode"] == "speculative"][0]
    base_remote = [r for r in doc["runs"] if r["mode"] == "baseline"][0]
    (alone,) = json.loads(local.stdout)["runs"]
    assert alone["mode"] == "baseline" and alone["n_drafted"] is None
    local_tokens = alone["tokens"]
    # The reference is the target alone on this machine, in another process that never saw an RPC device.
    assert spec["tokens"] == local_tokens
    assert base_remote["tokens"] == local_tokens
    assert len(set(local_tokens)) > 5  # not a degenerate repetition
    assert spec["n_drafted"] > 0 and spec["n_accepted"] > 0
    assert doc["settings"]["rpc"] == eps
    # Where the weights went: the target over both servers, the draft on this machine only.
    logs = _model_logs(remote.stderr)
    tgt, dft = logs[tiny_target.name], logs[tiny_close.name]
    for s in two_servers:
        assert f"RPC0[{s.endpoint}] model buffer size" in tgt or f"[{s.endpoint}] model buffer size" in tgt
    assert "CPU_Mapped model buffer size" in dft and "RPC" not in dft
    assert "using device RPC0" in tgt and "using device RPC1" in tgt
    assert [s.accepted() for s in two_servers] > before  # both servers served this client


def test_a_server_lost_mid_generation_is_one_line_and_exit_1(rpc_lib, slow_target):
    server = RpcServer(rpc_lib)
    try:
        client = subprocess.Popen([SPECQ, "bench", "--target", str(slow_target), "--prompt", PROMPT, "--temp", "0",
                                   "--n-predict", "256", "--repeat", "200", "--ctx", "512", "--threads", "1",
                                   "--rpc", server.endpoint],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=_env(rpc_lib, SPECQ_RPC_TIMEOUT="600"))
        server.wait_for("Accepted client connection", 60)
        time.sleep(3)  # the model is loaded and generating (200 runs of 256 tokens take far longer)
        assert client.poll() is None, client.communicate()
        os.kill(server.proc.pid, signal.SIGSTOP)  # now the client waits inside an RPC call...
        time.sleep(0.5)
        t0 = time.monotonic()
        server.proc.kill()  # ...and the server dies under it
        out, err = client.communicate(timeout=ONE_LINE_S)
        took = time.monotonic() - t0
    finally:
        server.stop()
    lines = err.strip().splitlines()
    assert client.returncode == 1
    assert len(lines) == 1, err
    assert lines[0].startswith(f"specq: error: RPC server {server.endpoint} is gone: it no longer accepts connections")
    assert "Remote RPC server crashed" in lines[0]  # ggml's abort, not the watchdog (600 s away)
    assert took < ONE_LINE_S and out == ""


def test_a_server_that_stops_answering_is_ended_by_the_watchdog(rpc_lib, slow_target):
    server = RpcServer(rpc_lib)
    try:
        client = subprocess.Popen([SPECQ, "bench", "--target", str(slow_target), "--prompt", PROMPT, "--temp", "0",
                                   "--n-predict", "256", "--repeat", "200", "--ctx", "512", "--threads", "1",
                                   "--rpc", server.endpoint],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=_env(rpc_lib, SPECQ_RPC_TIMEOUT="3"))
        server.wait_for("Accepted client connection", 60)
        time.sleep(3)
        assert client.poll() is None, client.communicate()
        os.kill(server.proc.pid, signal.SIGSTOP)  # alive to TCP, silent to the client: ggml-rpc would wait forever
        t0 = time.monotonic()
        out, err = client.communicate(timeout=ONE_LINE_S)
        took = time.monotonic() - t0
    finally:
        server.stop()
    lines = err.strip().splitlines()
    assert client.returncode == 1
    assert len(lines) == 1, err
    assert lines[0].startswith(f"specq: error: RPC server {server.endpoint} stopped answering")
    assert "made no progress for 3 s" in lines[0]
    assert 3 <= took < ONE_LINE_S


def test_an_unreachable_or_silent_server_is_one_line_before_any_model_loads(rpc_lib, tiny_target):
    closed = f"127.0.0.1:{free_port()}"
    r = _bench(["--target", str(tiny_target), "--rpc", closed], _env(rpc_lib), timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"specq: error: RPC server {closed} refused the connection; start `specq rpc-server` there "
        f"(--host and --port {closed.split(':')[1]}) or fix the address"]
    with socket.socket() as silent:  # accepts TCP, never answers: as a server busy with another client
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        ep = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        r = _bench(["--target", str(tiny_target), "--rpc", ep], _env(rpc_lib), timeout=60)
        took = time.monotonic() - t0
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(f"specq: error: RPC server {ep} did not answer within 5 s")
    assert took < 30


def test_bad_rpc_values_are_usage_errors(rpc_lib, tiny_target):
    for bad in ("nohost", "host:", "host:99999", "[::1]:50052", "a:1,a:1"):
        r = _bench(["--target", str(tiny_target), "--rpc", bad], _env(rpc_lib), timeout=60)
        assert r.returncode == 2, (bad, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("specq: error: --rpc")


def test_doctor_lists_remote_devices_with_their_memory(rpc_lib, two_servers):
    eps = ",".join(s.endpoint for s in two_servers)
    r = subprocess.run([SPECQ, "doctor", "--json", "--rpc", eps], capture_output=True, text=True, env=_env(rpc_lib),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["rpc"]["available"] is True and doc["rpc"]["library"] == str(rpc_lib)
    assert [s["endpoint"] for s in doc["rpc"]["servers"]] == [s.endpoint for s in two_servers]
    remote = [d for d in doc["devices"] if d["name"].startswith("RPC")]
    assert [d["description"] for d in remote] == [s.endpoint for s in two_servers]
    assert all(d["memory_total"] > 0 and d["type"] == "GPU" for d in remote)
    plain = subprocess.run([SPECQ, "doctor", "--json"], capture_output=True, text=True, env=_env(rpc_lib), timeout=120)
    assert json.loads(plain.stdout)["rpc"]["available"] is True
    assert not [d for d in json.loads(plain.stdout)["devices"] if d["name"].startswith("RPC")]


def test_plan_puts_the_target_on_remote_devices_and_the_draft_on_a_local_one(rpc_lib, two_servers, tiny_target,
                                                                            tiny_close):
    eps = ",".join(s.endpoint for s in two_servers)
    args = [SPECQ, "plan", "--target", str(tiny_target), "--draft", str(tiny_close), "--json", "--rpc", eps]
    r = subprocess.run(args + ["--vram", "4GiB"], capture_output=True, text=True, env=_env(rpc_lib), timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(d["name"], d["endpoint"]) for d in doc["devices"]] == [
        ("RPC0", two_servers[0].endpoint), ("RPC1", two_servers[1].endpoint), ("GPU0", None)]
    remote_memory = [d["memory_free"] for d in json.loads(subprocess.run(
        [SPECQ, "doctor", "--json", "--rpc", eps], capture_output=True, text=True, env=_env(rpc_lib),
        timeout=120).stdout)["devices"] if d["name"].startswith("RPC")]
    assert [d["budget_bytes"] for d in doc["devices"][:2]] == remote_memory  # as the servers report it
    assert [d["draft_layers"] for d in doc["devices"]] == [0, 0, doc["draft"]["ngl"]] and doc["draft"]["ngl"] > 0
    assert doc["devices"][0]["target_layers"] == doc["target"]["ngl_max"]
    # No local GPU at all (a fraction of free memory, and this machine has none): the draft runs on the CPU.
    r = subprocess.run(args + ["--vram", "0.5"], capture_output=True, text=True, env=_env(rpc_lib), timeout=120)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and [d["name"] for d in doc["devices"]] == ["RPC0", "RPC1"]
    assert doc["draft"]["ngl"] == 0 and doc["target"]["ngl"] == doc["target"]["ngl_max"]


def test_the_target_split_over_remote_devices_and_the_local_cpu_stays_exact(rpc_lib, two_servers, tiny_target,
                                                                            tiny_close):
    eps = ",".join(s.endpoint for s in two_servers)
    local = _bench(["--target", str(tiny_target), "--n-predict", "40"], _env(rpc_lib))
    r = _bench(["--target", str(tiny_target), "--draft", str(tiny_close), "--n-predict", "40", "--no-baseline",
                "--rpc", eps, "--device", "RPC1,CPU", "--tensor-split", "1,1", "-v"], _env(rpc_lib))
    assert r.returncode == 0, r.stderr[-3000:]
    (spec,) = json.loads(r.stdout)["runs"]
    assert spec["tokens"] == json.loads(local.stdout)["runs"][0]["tokens"] and spec["n_drafted"] > 0
    tgt = _model_logs(r.stderr)[tiny_target.name]
    assert "assigned to device RPC1" in tgt and "assigned to device CPU" in tgt
    assert "assigned to device RPC0" not in tgt  # --device chose the second server only


def test_chat_answers_over_rpc_and_a_server_killed_during_the_chat_is_one_line(rpc_lib, tiny_target, tiny_close):
    server = RpcServer(rpc_lib)
    try:
        chat = subprocess.Popen([SPECQ, "chat", "--target", str(tiny_target), "--draft", str(tiny_close), "--ctx", "512",
                                 "--threads", "1", "--n-predict", "16", "--draft-max", "4", "--rpc", server.endpoint],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env(rpc_lib, SPECQ_RPC_TIMEOUT="600"))
        chat.stdin.write("The quick brown fox\n")
        chat.stdin.flush()
        first = chat.stdout.readline()  # the first answer, generated over RPC
        assert first.strip(), chat.stderr.read()
        server.proc.kill()
        server.proc.wait(10)
        t0 = time.monotonic()
        out, err = chat.communicate("def fibonacci(n):\n", timeout=ONE_LINE_S)
        took = time.monotonic() - t0
    finally:
        server.stop()
    assert chat.returncode == 1 and took < ONE_LINE_S
    assert err.strip().splitlines() == [err.strip()] and err.startswith(
        f"specq: error: RPC server {server.endpoint} is gone: it no longer accepts connections")


def _fake_server(answer_major: int):
    """A TCP server that answers one HELLO with protocol answer_major.0.0 and 1 device, as ggml-rpc would."""
    import struct
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(1 + 8 + 24, socket.MSG_WAITALL)
            conn.sendall(struct.pack("<Q", 28) + bytes([answer_major, 0, 0, 0]) + bytes(24))
            conn.recv(1 + 8, socket.MSG_WAITALL)
            conn.sendall(struct.pack("<QI", 4, 1))

    threading.Thread(target=serve, daemon=True).start()
    return srv, rpc.Endpoint("127.0.0.1", srv.getsockname()[1])


def test_probe_reads_the_protocol_and_refuses_another_major_version():
    srv, ep = _fake_server(7)
    with srv:
        assert rpc.probe(ep, timeout=5, protocol_major=7) == rpc.ServerInfo(str(ep), "7.0.0", 1)
    srv, ep = _fake_server(6)
    with srv, pytest.raises(rpc.RpcError, match=rf"RPC server {ep} speaks protocol 6.0.0, this build 7.x"):
        rpc.probe(ep, timeout=5, protocol_major=7)


def test_without_the_backend_doctor_says_how_to_get_it_and_rpc_is_one_line(tmp_path, tiny_target):
    env = dict(os.environ, SPECQ_CACHE_DIR=str(tmp_path / "empty-cache"))
    env.pop("SPECQ_RPC_LIB", None)
    doc = json.loads(subprocess.run([SPECQ, "doctor", "--json"], capture_output=True, text=True, env=env,
                                    timeout=120).stdout)
    assert doc["rpc"]["available"] is False and "specq rpc-build" in doc["rpc"]["reason"]
    r = _bench(["--target", str(tiny_target), "--rpc", "127.0.0.1:50052"], env, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "specq: error: " + doc["rpc"]["reason"]]


def test_rpc_build_reuses_its_cache_and_rpc_server_warns_and_refuses_a_taken_port(rpc_lib, two_servers):
    env = _env(rpc_lib)
    env.pop("SPECQ_RPC_LIB")
    r = subprocess.run([SPECQ, "rpc-build"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"already built: {rpc_lib} (llama-cpp-python ")
    warning = two_servers[0].lines[0]
    assert warning.startswith("specq: warning: llama.cpp's RPC protocol has NO authentication")
    taken = two_servers[0].port
    r = subprocess.run([SPECQ, "rpc-server", "--port", str(taken)], capture_output=True, text=True, env=_env(rpc_lib),
                       timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(f"specq: error: cannot listen on 127.0.0.1:{taken}")
