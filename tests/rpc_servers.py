"""Real RPC server processes for the --rpc tests: `specq rpc-server` on 127.0.0.1 at free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from cli_bin import SPECQ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcServer:
    """One `specq rpc-server` child; `lines` collects its output (llama.cpp prints each client it accepts)."""

    def __init__(self, lib: Path, threads: int = 1):
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        env = dict(os.environ, SPECQ_RPC_LIB=str(lib), OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen([SPECQ, "rpc-server", "--port", str(self.port), "--threads", str(threads)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wait_for("offers", 60)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float, count: int = 1) -> None:
        end = time.monotonic() + timeout
        while sum(text in line for line in self.lines) < count:
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise RuntimeError(f"rpc-server exited {self.proc.returncode}: {self.lines}")
            if time.monotonic() > end:
                raise TimeoutError(f"no {text!r} from rpc-server within {timeout} s: {self.lines}")
            time.sleep(0.05)

    def accepted(self) -> int:
        return sum("Accepted client connection" in line for line in self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
