"""llama.cpp's RPC backend from specq: remote ggml devices for the target, the draft kept local.

llama-cpp-python's wheel is built without GGML_RPC, and pip's wheel cache cannot hold a plain and an RPC
build of one version side by side. So specq builds only what is missing — `libggml-rpc.so`, from the same
sdist's vendored llama.cpp — and loads it next to the libggml-base llama-cpp-python already loaded (same
sources, same version: the backend structs match; the registry's API version is checked at load). A
llama-cpp-python built with GGML_RPC=ON needs none of this: its own "RPC" backend is used.

This module is the C boundary for that library (as abort_guard.py is for ggml's abort hook); llama.cpp's
own calls stay in _ffi.py. ggml-rpc aborts the process when a connection fails and its sockets have no
timeout, so every endpoint is probed from Python first, a lost server ends the process through ggml's abort
callback with one line (exit 1), and a watchdog ends a llama.cpp call that makes no progress (exit 1).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import RpcError, UsageError  # noqa: F401 (RpcError is part of this module's API)
from ..llama import ffi as _ffi, abort_guard

log = logging.getLogger("specq.rpc")

LIB_ENV = "SPECQ_RPC_LIB"  # an RPC backend library built elsewhere (a llama.cpp build with GGML_RPC=ON)
TIMEOUT_ENV = "SPECQ_RPC_TIMEOUT"  # seconds one llama.cpp call may go without progress while RPC is in use
DEFAULT_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 5.0
LIB_NAME = "libggml-rpc.so"
BUILD_INFO = "build.json"
DEFAULT_PORT = 50052  # llama.cpp's rpc-server default

# The wire protocol's first exchange (ggml-rpc.cpp): | cmd u8 | size u64 | payload |, answer | size u64 | payload |
_CMD_HELLO, _CMD_DEVICE_COUNT = 14, 15
_CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: zeros ask for plain TCP
_HELLO_RSP = 4 + _CONN_CAPS


# ---- endpoints ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str, flag: str = "--rpc") -> tuple[Endpoint, ...]:
    """'HOST:PORT[,HOST:PORT…]' → endpoints; ggml-rpc splits at the first colon, so IPv6 literals cannot work."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        host, sep, port = item.partition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or ":" in port:
            raise UsageError(f"{flag} takes HOST:PORT[,HOST:PORT...] ({item}); e.g. {flag} 192.168.1.20:{DEFAULT_PORT}"
                             " (IPv6 literals are not supported by llama.cpp's RPC client: use a host name)")
        out.append(Endpoint(host, int(port)))
    if not out:
        raise UsageError(f"{flag} is empty ({text!r}); e.g. {flag} 192.168.1.20:{DEFAULT_PORT}")
    if len(set(out)) != len(out):
        raise UsageError(f"{flag} names a server twice ({text})")
    return tuple(out)


@dataclass(frozen=True)
class ServerInfo:
    endpoint: str
    protocol: str  # "7.0.0"
    n_devices: int


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the server")
        buf += chunk
    return buf


def _call(sock: socket.socket, cmd: int, payload: bytes, answer: int) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    size = struct.unpack("<Q", _recv_exact(sock, 8))[0]
    if size != answer:
        raise ValueError(f"answer of {size} bytes, expected {answer}")
    return _recv_exact(sock, answer)


def probe(ep: Endpoint, timeout: float = PROBE_TIMEOUT_S, protocol_major: int | None = None) -> ServerInfo:
    """Connect, say HELLO and ask the device count, all within `timeout`; RpcError names the endpoint.

    ggml-rpc itself would abort the process on any of these failures, or wait forever on a busy server
    (it serves one client at a time)."""
    try:
        with socket.create_connection((ep.host, ep.port), timeout=timeout) as s:
            s.settimeout(timeout)
            rsp = _call(s, _CMD_HELLO, bytes(_CONN_CAPS), _HELLO_RSP)
            version = f"{rsp[0]}.{rsp[1]}.{rsp[2]}"
            if protocol_major is not None and rsp[0] != protocol_major:
                raise RpcError(f"RPC server {ep} speaks protocol {version}, this build {protocol_major}.x; "
                               "build both from the same llama.cpp version (`specq rpc-build` on each host)")
            n = struct.unpack("<I", _call(s, _CMD_DEVICE_COUNT, b"", 4))[0]
    except socket.timeout:
        raise RpcError(f"RPC server {ep} did not answer within {timeout:g} s; it serves one client at a time, so "
                       "another client may hold it, or this is not an RPC server") from None
    except socket.gaierror as e:
        raise RpcError(f"RPC server host not found ({ep}: {e.strerror}); check the name") from None
    except ConnectionRefusedError:
        raise RpcError(f"RPC server {ep} refused the connection; start `specq rpc-server` there "
                       f"(--host and --port {ep.port}) or fix the address") from None
    except (OSError, ValueError) as e:
        raise RpcError(f"RPC server {ep} could not be reached or is not an RPC server ({e}); check the address "
                       "and that the server runs") from None
    if n == 0:
        raise RpcError(f"RPC server {ep} offers no devices; check its log")
    return ServerInfo(str(ep), version, n)


def reachable(ep: Endpoint, timeout: float = 1.0) -> bool:
    """A TCP connection only: tells a dead server from a live one without taking its single client slot."""
    try:
        with socket.create_connection((ep.host, ep.port), timeout=timeout):
            return True
    except OSError:
        return False


# ---- building the backend library --------------------------------------------------------------------
def build_dir(version: str | None = None) -> Path:
    from ...machine import cache_dir

    return cache_dir() / "rpc" / (version or _ffi.llama_cpp_python_version())


def built_library(version: str | None = None) -> Path | None:
    """$SPECQ_RPC_LIB, else what `specq rpc-build` left in the cache for this llama-cpp-python version."""
    if os.environ.get(LIB_ENV):
        return Path(os.environ[LIB_ENV])
    p = build_dir(version) / LIB_NAME
    return p if p.is_file() and (p.parent / BUILD_INFO).is_file() else None


@dataclass(frozen=True)
class BuildResult:
    library: str
    llama_cpp_python_version: str
    protocol: str
    seconds: dict  # download, extract, configure, build
    cached: bool


def _protocol_in(header: Path) -> str:
    text = header.read_text()
    parts = [re.search(rf"#define RPC_PROTO_{w}_VERSION\s+(\d+)", text) for w in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in parts)


def _run(cmd: list[str], what: str, log_path: Path) -> None:
    with open(log_path, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise RpcError(f"{what} failed (exit {r.returncode}: {tail[0][:200]}); the full log is {log_path}")


def _extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Only vendor/llama.cpp, without its 75 MB of tokenizer test files (vendor/llama.cpp/models)."""
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/")
            if len(parts) > 2 and parts[1:3] == ["vendor", "llama.cpp"] and parts[3:4] != ["models"]:
                members.append(m)
        if not members:
            raise RpcError(f"no vendor/llama.cpp in {sdist}; pass a llama-cpp-python sdist")
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kw)
    return dest / members[0].name.split("/")[0] / "vendor" / "llama.cpp"


def build(sdist: Path | None = None, jobs: int | None = None, force: bool = False,
          on_step=lambda step: None) -> BuildResult:
    """Build libggml-rpc.so from llama-cpp-python's own sdist (downloaded by pip unless given) into the cache.

    CMake target `ggml-rpc` of the vendored tree: ggml-base and the RPC backend, nothing else (the copy of
    ggml-base is thrown away: the process uses llama-cpp-python's). One build per version; a lock keeps two
    processes from building at once."""
    version = _ffi.llama_cpp_python_version()
    out = build_dir(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        info = out / BUILD_INFO
        if not force and (out / LIB_NAME).is_file() and info.is_file():
            d = json.loads(info.read_text())
            return BuildResult(str(out / LIB_NAME), version, d.get("protocol", "?"), d.get("seconds", {}), True)
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RpcError("cmake not found (PATH); install it (apt install cmake, or pip install cmake) and rerun "
                           "`specq rpc-build`")
        secs = {}
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp_s:
            tmp = Path(tmp_s)
            log_path = out.parent / f"build-{version}.log"
            log_path.write_text("")
            t = time.monotonic()
            if sdist is None:
                on_step(f"downloading the llama-cpp-python {version} sdist (pip download)")
                _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-python",
                      f"llama-cpp-python=={version}", "-d", str(tmp / "dl")], "pip download", log_path)
                found = list((tmp / "dl").glob("llama_cpp_python-*.tar.gz"))
                if not found:
                    raise RpcError(f"pip download left no llama-cpp-python sdist; the log is {log_path}")
                sdist = found[0]
            secs["download"] = round(time.monotonic() - t, 1)
            t = time.monotonic()
            on_step(f"extracting vendor/llama.cpp from {sdist.name}")
            src = _extract_llama_cpp(Path(sdist), tmp / "src")
            secs["extract"] = round(time.monotonic() - t, 1)
            t = time.monotonic()
            on_step("configuring (CMake, GGML_RPC=ON)")
            bld = tmp / "build"
            _run([cmake, "-S", str(src), "-B", str(bld), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
                  "-DGGML_RPC=ON", "-DGGML_RPC_RDMA=OFF", "-DGGML_NATIVE=OFF", "-DCMAKE_SKIP_BUILD_RPATH=ON",
                  "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                  "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"],
                 "cmake configure", log_path)
            secs["configure"] = round(time.monotonic() - t, 1)
            t = time.monotonic()
            on_step(f"building ggml-rpc ({jobs or os.cpu_count()} jobs)")
            _run([cmake, "--build", str(bld), "--target", "ggml-rpc", "-j", str(jobs or os.cpu_count() or 1)],
                 "cmake build", log_path)
            secs["build"] = round(time.monotonic() - t, 1)
            libs = [p for p in (bld / "bin").glob("libggml-rpc.so*") if p.is_file() and not p.is_symlink()]
            if not libs:
                raise RpcError(f"the build made no libggml-rpc.so; the log is {log_path}")
            protocol = _protocol_in(src / "ggml" / "include" / "ggml-rpc.h")
            staged = tmp / "out"
            staged.mkdir()
            shutil.copy2(libs[0], staged / LIB_NAME)
            (staged / BUILD_INFO).write_text(json.dumps({"llama_cpp_python_version": version, "protocol": protocol,
                                                         "seconds": secs, "sdist": Path(sdist).name}, indent=2))
            if out.exists():
                shutil.rmtree(out)
            os.replace(staged, out)
        return BuildResult(str(out / LIB_NAME), version, protocol, secs, False)


# ---- loading the backend into this process -----------------------------------------------------------
class _Backend:
    """The RPC backend registered in llama.cpp's ggml registry, and the servers added to it."""

    def __init__(self):
        self.reg = None
        self.source = None  # "llama.cpp build" | the library's path
        self.protocol_major = None
        self.add_server = None
        self.start_server = None
        self.lib = None
        self.servers: dict[str, ServerInfo] = {}
        self.endpoints: list[Endpoint] = []
        self.devices: dict[str, str] = {}  # device name → endpoint


_backend = _Backend()
_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_void_p))


def _api_version(reg) -> int:
    return ctypes.cast(reg, ctypes.POINTER(ctypes.c_int)).contents.value  # ggml_backend_reg.api_version


def status() -> dict:
    """Whether RPC can be used here, and from where (for `specq doctor`); loads nothing."""
    _ffi.ensure_backend()
    lib = _ffi._libggml()
    if _backend.lib is None and lib.ggml_backend_reg_by_name(b"RPC"):
        return {"available": True, "source": "llama.cpp build", "library": None,
                "reason": "llama-cpp-python was built with GGML_RPC=ON"}
    path = built_library()
    if path is None:
        return {"available": False, "source": None, "library": None,
                "reason": "this llama-cpp-python has no RPC backend; run `specq rpc-build` (about 1.5 minutes "
                          "on 2 idle cores) to build it from the same sources"}
    if not path.is_file():
        return {"available": False, "source": None, "library": str(path),
                "reason": f"${LIB_ENV} names a missing file ({path})"}
    return {"available": True, "source": "specq rpc-build" if not os.environ.get(LIB_ENV) else LIB_ENV,
            "library": str(path), "reason": "the RPC backend built by `specq rpc-build` for this version"}


def load() -> _Backend:
    """Register the RPC backend with llama.cpp's registry once (a no-op where the build has it)."""
    if _backend.add_server is not None:
        return _backend
    _ffi.ensure_backend()
    lib = _ffi._libggml()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if reg:
        _backend.source = "llama.cpp build"
    else:
        path = built_library()
        if path is None or not path.is_file():
            raise RpcError(status()["reason"])
        try:
            _backend.lib = rpc_lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise RpcError(f"the RPC backend library could not be loaded ({path}: {e}); rebuild it with "
                           "`specq rpc-build --force`") from None
        rpc_lib.ggml_backend_rpc_reg.argtypes, rpc_lib.ggml_backend_rpc_reg.restype = [], ctypes.c_void_p
        reg = rpc_lib.ggml_backend_rpc_reg()
        cpu = lib.ggml_backend_dev_by_type(0)
        want = _api_version(lib.ggml_backend_dev_backend_reg(cpu)) if cpu else None
        if want is not None and _api_version(reg) != want:
            raise RpcError(f"the RPC backend library ({path}) has ggml backend API {_api_version(reg)}, this "
                           f"llama-cpp-python {want}; rebuild it with `specq rpc-build --force`")
        lib.ggml_backend_register(reg)
        _backend.source = str(path)
        info = path.parent / BUILD_INFO
        if info.is_file():
            _backend.protocol_major = int(json.loads(info.read_text()).get("protocol", "0").split(".")[0] or 0)
    _backend.reg = reg
    add = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    start = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_start_server")
    if not add or not start:
        raise RpcError("the RPC backend lacks ggml_backend_rpc_add_server; rebuild it with `specq rpc-build --force`")
    _backend.add_server, _backend.start_server = _ADD_SERVER(add), _START_SERVER(start)
    abort_guard.add_explainer(_explain_abort)
    return _backend


def connect(endpoints: tuple[Endpoint, ...] | str, timeout: float = PROBE_TIMEOUT_S) -> list[_ffi.DeviceInfo]:
    """Probe every endpoint, then add it to llama.cpp's device list; the remote devices (RPC0, RPC1, ...)."""
    if isinstance(endpoints, str):
        endpoints = parse_endpoints(endpoints)
    be = load()
    # All checked before any is added; never one already added (it serves one client at a time: this process).
    new = [ep for ep in endpoints if str(ep) not in be.servers]
    infos = [probe(ep, timeout, be.protocol_major) for ep in new]
    lib = _ffi._libggml()
    for ep, info in zip(new, infos):
        reg = be.add_server(str(ep).encode())
        if not reg:
            raise RpcError(f"RPC server {ep} offers no devices; check its log")
        lib.ggml_backend_register(reg)
        be.servers[str(ep)] = info
        be.endpoints.append(ep)
        for i in range(int(lib.ggml_backend_reg_dev_count(reg))):
            dev = lib.ggml_backend_reg_dev_get(reg, i)
            be.devices[(lib.ggml_backend_dev_name(dev) or b"").decode()] = str(ep)
        log.info("RPC server %s: protocol %s, %d device(s)", ep, info.protocol, info.n_devices)
    watchdog.start(timeout_from_env())
    return [d for d in _ffi.devices() if d.name in be.devices]


def remote_devices() -> dict[str, str]:
    """Device name → endpoint of the RPC devices added in this process."""
    return dict(_backend.devices)


def servers() -> list[dict]:
    return [asdict(s) for s in _backend.servers.values()]


def local_gpu_names() -> list[str]:
    """This machine's GPU devices (no RPC device): where the draft goes by default when --rpc is used."""
    return [d.name for d in _ffi.devices() if d.type in ("GPU", "IGPU") and d.name not in _backend.devices]


# ---- a lost server ---------------------------------------------------------------------------------
def _gone(ep: Endpoint, tries: int = 8) -> bool:
    """The port refuses connections: the server process is gone. A dying server's listening socket may outlive
    its connections for a moment, hence a few tries; a timeout proves nothing (a stopped server's backlog, or a
    busy machine still tearing the process down), so it is tried again too."""
    for i in range(tries):
        try:
            with socket.create_connection((ep.host, ep.port), timeout=0.5):
                pass
        except ConnectionRefusedError:
            return True
        except TimeoutError:
            pass
        except OSError:
            return False
        time.sleep(0.25)
    return False


def _lost_line(detail: str, silent: bool = False) -> str:
    eps = list(_backend.endpoints)
    dead = [str(e) for e in eps if _gone(e)]
    if dead:
        what = f"RPC server {', '.join(dead)} is gone: it no longer accepts connections"
    elif silent:
        what = f"RPC server {', '.join(map(str, eps))} stopped answering"
    else:
        what = f"lost the connection to RPC server {', '.join(map(str, eps))}"
    return (f"specq: error: {what} ({detail}); check that rpc-server still runs there and the network between "
            "the hosts, then rerun\n")


def _explain_abort(message: str) -> str | None:
    """ggml-rpc aborts on a failed send/receive: name the server instead of a generic abort line."""
    if "ggml-rpc" not in message and "RPC server" not in message:
        return None
    return _lost_line(message.split(": ", 1)[-1].strip() or "connection lost")


def timeout_from_env() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        raise UsageError(f"${TIMEOUT_ENV} must be a number of seconds ({raw})") from None
    if not v > 0:
        raise UsageError(f"${TIMEOUT_ENV} must be positive ({raw})")
    return v


class _Watchdog:
    """Ends the process when one llama.cpp call makes no progress for `timeout_s` while RPC servers are in use:
    ggml-rpc's sockets have no timeout, so a stopped server or a dropped link would hang it forever."""

    EXIT_CODE = 1

    def __init__(self):
        self.timeout_s = DEFAULT_TIMEOUT_S
        self.thread = None
        self.fired = 0  # for tests: how often it ended a call (in a child process it never returns)

    def start(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        _ffi.call_clock.enabled = True
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="specq-rpc-watchdog", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        clock = _ffi.call_clock
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            since = clock.since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self.fired += 1
                line = _lost_line(f"{clock.what} made no progress for {self.timeout_s:g} s", silent=True)
                with contextlib.suppress(OSError):
                    os.write(2, line.encode("utf-8", "replace"))
                os._exit(self.EXIT_CODE)


watchdog = _Watchdog()


# ---- serving a device ------------------------------------------------------------------------------
def serve_devices(names: list[str] | None) -> list[_ffi.DeviceInfo]:
    """The devices an RPC server offers: the named ones, else the GPUs, else the CPU (as llama.cpp's rpc-server)."""
    devs = [d for d in _ffi.devices() if d.name not in _backend.devices]
    if names:
        known = {d.name: d for d in devs}
        missing = [n for n in names if n not in known]
        if missing:
            raise UsageError(f"unknown device {', '.join(missing)} (this build has {', '.join(known)}); "
                             "see `specq doctor`")
        return [known[n] for n in names]
    gpus = [d for d in devs if d.type in ("GPU", "IGPU")]
    return gpus or [d for d in devs if d.type == "CPU"]


def check_port_free(host: str, port: int) -> None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except socket.gaierror as e:
        raise UsageError(f"--host is not an address of this machine ({host}: {e.strerror})") from None
    except OSError as e:
        raise RpcError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or stop what uses it") \
            from None


def start_server(host: str, port: int, devices: list[_ffi.DeviceInfo], threads: int,
                 cache_dir: str | None = None) -> threading.Thread:
    """ggml_backend_rpc_start_server in a daemon thread (it never returns; the caller waits for Ctrl-C)."""
    be = load()
    check_port_free(host, port)
    handles = _ffi.device_handles([d.name for d in devices])
    endpoint = f"{host}:{port}".encode()
    cache = cache_dir.encode() if cache_dir else None

    def run() -> None:
        be.start_server(endpoint, cache, threads, len(devices), handles)

    th = threading.Thread(target=run, name="specq-rpc-server", daemon=True)
    th.start()
    return th
