"""`specq serve` as a library: an OpenAI-compatible HTTP server (Starlette + uvicorn) over one model pair.

Handlers parse and validate (serve_api), tokenize, and queue a Job for the engine loop (serving/scheduler.py), which
drives the engine on the main thread that loaded it while uvicorn runs on a thread of its own; its events come
back through an asyncio queue as JSON or server-sent events.
Everything but /health needs the API key when one is set. Errors use OpenAI's shape; nothing a handler
raises reaches the client or the log as a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import importlib.util
import logging
import random
import signal
import socket
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Awaitable, Callable

from ...errors import SpecqError, UsageError
from ..runtime.config import EngineConfig
from ..core.constraint import Constraint, ConstraintError, compile_constraint
from ..runtime.engine import Engine
from ..core.settings import GenerationSettings
from .api import (FINISH, ApiError, ApiRequest, Limits, ResponseIds, chunk, constraint_param, full_response,
                  parse_json, parse_request, settings_for, sse, usage_chunk)
from .answer import AnswerPlan, AnswerStream, call_grammar, merge, render_chat
from .reasoning import think_format
from .outbox import Outbox, emitter
from ..core.template import TemplateFormatter, load_template, model_token_text
from .tools import template_family
from .scheduler import Scheduler
from .request import Job

log = logging.getLogger("specq.serve")


SERVE_MODULES = ("starlette", "uvicorn", "prometheus_client")


def require_serve_extra() -> None:
    """The server's dependencies come as the `serve` extra; say so instead of an ImportError."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecqError(f"specq serve needs the serve extra ({', '.join(missing)} not installed); "
                         "run `pip install 'specq[serve]'`")


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_queue: int = 16  # requests waiting behind the running one; beyond it 503
    max_body: int = 4 << 20  # bytes of one request body
    max_tokens: int = 4096  # the most tokens one request may ask for (and its default)
    seed: int | None = None  # the seed of requests that give none (None: a fresh random seed each)
    drain_s: float = 30.0  # on Ctrl-C/SIGTERM, how long running requests may take to finish

    def validate(self) -> "ServeConfig":
        if not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be between 0 and 65535 ({self.port})")
        for flag, v in (("--max-queue", self.max_queue), ("--max-body", self.max_body),
                        ("--max-tokens", self.max_tokens)):
            if v < (0 if flag == "--max-queue" else 1):
                raise UsageError(f"{flag} must be at least {0 if flag == '--max-queue' else 1} ({v})")
        return self


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen before the models load, so a port in use fails at once with one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host is not an address this machine has ({host}: {e.strerror}); "
                         "use 127.0.0.1 or an interface's address")
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may reuse a port in TIME_WAIT
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise SpecqError(f"the port is in use ({host}:{port}); stop the other server or pass another --port")
        raise SpecqError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --host or --port")
    return sock


def model_id(target: str | Path) -> str:
    """The id /v1/models lists and requests name: the target file's stem."""
    return Path(target).stem


class ServerState:
    """What the handlers share: the engine's tokenizer and template, the scheduler, metrics and limits."""

    def __init__(self, engine: Engine, template: str | None, defaults: GenerationSettings, cfg: ServeConfig,
                 model_name: str):
        self.engine, self.defaults, self.cfg = engine, defaults, cfg
        tgt = engine.target
        self.bos_text = model_token_text(tgt, tgt.bos)
        # A model without a chat template still serves /v1/completions.
        self.formatter = TemplateFormatter.for_model(template, tgt) if template else None
        self.family = template_family(template) if template else None  # the tool-call format it writes
        self.think = think_format(template) if template else None  # a thinking model's markers
        self.limits = Limits(max_tokens=cfg.max_tokens, model_id=model_name, draft=engine.draft is not None,
                             mtp=getattr(engine, "mtp_ctx", None) is not None)
        from .metrics import ServerMetrics

        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(engine, self.metrics, cfg.max_queue)
        self._outbox: Outbox | None = None

    def outbox(self) -> Outbox:
        """The running event loop's outbox (every job's events, one wake-up of the loop per batch of them)."""
        loop = asyncio.get_running_loop()
        if self._outbox is None or self._outbox.loop is not loop:
            self._outbox = Outbox(loop)
        return self._outbox

    def prompt_tokens(self, req: ApiRequest) -> tuple[list[int], AnswerPlan]:
        """The request as tokens, and how its answer is read: chat through the target's template (as
        `specq chat` and `bench --chat`), a completion prompt raw with special tokens parsed (as `specq bench`)."""
        tgt = self.engine.target
        plan = AnswerPlan()
        if req.kind == "completion":
            tokens = self.engine.tokenize(req.prompt)
        elif self.formatter is None:
            raise ApiError(400, "the model has no chat template, so only /v1/completions works; start the server "
                                "with --template FILE to enable chat", "no_chat_template")
        else:
            text, plan = self.render_chat(req)
            tokens = tgt.tokenize(text, add_special=False, parse_special=True)
            if tgt.add_bos and not text.startswith(self.bos_text or "\0"):
                tokens = [tgt.bos] + tokens
        if not tokens:
            raise ApiError(400, "the prompt is empty; give some text to start from", "empty_prompt")
        if len(tokens) + 1 > self.engine.n_ctx:
            raise ApiError(400, f"the prompt does not fit in the context ({len(tokens)} tokens, ctx "
                                f"{self.engine.n_ctx}); send a shorter prompt or start the server with a larger --ctx",
                           "context_length_exceeded")
        return tokens, plan

    def render_chat(self, req: ApiRequest) -> tuple[str, AnswerPlan]:
        return render_chat(self.formatter, self.family, self.think, req)

    def compile(self, c: Constraint, param: str | None = None) -> Constraint:
        """A request's constraint compiled for the target's vocabulary; a 400 naming its field where it cannot be."""
        try:
            return compile_constraint(self.engine.target, c)
        except ConstraintError as e:
            param = param or constraint_param(c)
            raise ApiError(400, f"'{param}': {e}", "invalid_value", param=param)

    def call_constraint(self, req: ApiRequest, plan: AnswerPlan) -> Constraint:
        """tool_choice required or a named function: the call grammar, compiled (a response_format cannot
        constrain the same answer)."""
        if req.constraint is not None:
            raise ApiError(400, f"'tool_choice' {plan.forced.choice!r} and '{constraint_param(req.constraint)}' "
                                "cannot both constrain one answer; send one", "invalid_value", param="tool_choice")
        tgt = self.engine.target
        grammar, after = call_grammar(plan, lambda text, special: tgt.tokenize(text, add_special=False,
                                                                               parse_special=special))
        return self.compile(Constraint("lark", grammar, after=after), "tool_choice")

    def seed_for(self, req: ApiRequest) -> int:
        return self.cfg.seed if self.cfg.seed is not None else random.SystemRandom().randrange(1 << 32)


# ==== HTTP ========================================================================================
def _json(body: dict, status: int = 200, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


def error_response(e: ApiError):
    return _json(e.body(), e.status, e.headers)


def authorize(request, api_key: str | None) -> None:
    if api_key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if not auth:
        raise ApiError(401, "missing API key; send it as 'Authorization: Bearer KEY'", "invalid_api_key")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise ApiError(401, "incorrect API key; send the server's key as 'Authorization: Bearer KEY'",
                       "invalid_api_key")


async def read_body(request, max_body: int) -> bytes:
    """The body, refusing one larger than max_body before reading it all."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body:
        raise ApiError(413, f"the request body is too large ({declared} bytes > {max_body}); send less or start "
                            "the server with a larger --max-body", "request_too_large")
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_body:
            raise ApiError(413, f"the request body is too large (over {max_body} bytes); send less or start the "
                                "server with a larger --max-body", "request_too_large")
        chunks.append(part)
    return b"".join(chunks)


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _event_stream(ids: ResponseIds, req: ApiRequest, events: asyncio.Queue, plan: AnswerPlan):
    """Server-sent events: a role chunk (chat), text chunks (a chat answer read for reasoning and tool calls:
    its deltas), the closing chunk, usage if asked, [DONE]."""
    answer = AnswerStream(plan) if ids.kind == "chat" and not plan.plain else None

    async def gen():
        if ids.kind == "chat":
            yield sse(chunk(ids, None, first=True))
        held: list[dict] | None = None  # logprobs entries of tokens whose text has not gone out yet
        sent = 0
        while True:
            kind, value = await events.get()
            if kind == "logprobs":
                held = (held or []) + [value]
            elif kind == "text" and answer is None:
                yield sse(chunk(ids, value, logprobs=held, offset=sent))
                held, sent = None, sent + len(value)
            elif kind == "text":
                for delta in answer.feed(value):  # logprobs ride on the first delta after their tokens
                    yield sse(chunk(ids, None, logprobs=held, delta=delta))
                    held = None
            elif kind == "done":
                finish = value.finish
                if answer is not None:
                    for delta in answer.flush():
                        yield sse(chunk(ids, None, logprobs=held, delta=delta))
                        held = None
                    finish = answer.finish_reason(FINISH.get(finish, "stop"))
                if held:
                    yield sse(chunk(ids, "" if ids.kind == "completion" else None, logprobs=held, offset=sent))
                yield sse(chunk(ids, None, finish=finish))
                if req.include_usage:
                    yield sse(usage_chunk(ids, value))
                yield sse("[DONE]")
                return
            else:
                yield sse(value.body())
                return

    return gen()


def _make_event_stream_response():
    from starlette.responses import StreamingResponse

    class EventStream(StreamingResponse):
        """SSE that cancels its generation as soon as the client disconnects (under ASGI 2.4 Starlette
        would only notice at the next write, which never comes for a request still waiting in the queue)."""

        def __init__(self, content, on_disconnect: Callable[[], None]):
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.on_disconnect = on_disconnect

        async def __call__(self, scope, receive, send) -> None:
            import anyio

            finished = False
            try:
                async with anyio.create_task_group() as tg:
                    async def stream() -> None:
                        nonlocal finished
                        with contextlib.suppress(OSError):
                            await self.stream_response(send)
                            finished = True
                        tg.cancel_scope.cancel()

                    tg.start_soon(stream)
                    await _until_disconnect(receive)
                    tg.cancel_scope.cancel()
            finally:
                if not finished:  # the client left, or the server's drain timed out and cancelled us
                    self.on_disconnect()

    return EventStream


class Handlers:
    """The endpoints. Each returns a response; ApiError becomes OpenAI's error object."""

    def __init__(self, state: ServerState):
        self.state = state
        self.EventStream = _make_event_stream_response()

    def route(self, endpoint: str, fn: Callable[..., Awaitable], auth: bool = True):
        async def handler(request):
            try:
                if auth:
                    authorize(request, self.state.cfg.api_key)
                resp = await fn(request)
            except ApiError as e:
                resp = error_response(e)
            except Exception as e:
                log.warning("%s failed (%s: %s); -v shows where", endpoint, type(e).__name__, e)
                log.debug("the traceback", exc_info=True)
                resp = error_response(ApiError(500, "internal error; run the server with -v for details",
                                               "internal_error", "server_error"))
            self.state.metrics.requests.labels(endpoint=endpoint, status=str(resp.status_code)).inc()
            return resp

        return handler

    async def health(self, request):
        w = self.state.scheduler
        return _json({"status": "ok", "model": self.state.limits.model_id, "queue": w.waiting,
                      "slots": {"total": w.n_slots, "busy": w.busy}})

    async def models(self, request):
        eng = self.state.engine
        return _json({"object": "list", "data": [{
            "id": self.state.limits.model_id, "object": "model", "created": int(Path(eng.target.path).stat().st_mtime),
            "owned_by": "specq", "draft": Path(eng.draft.path).stem if eng.draft is not None else None,
            "n_ctx": eng.n_ctx}]})

    async def metrics(self, request):
        from starlette.responses import Response

        m, w = self.state.metrics, self.state.scheduler
        m.deferred.set(w.waiting)
        m.slots(w.n_slots, w.busy, self.state.engine.tgt_ctx.n_multi_decodes)
        m.contexts(self.state.engine)
        if w.n_slots > 1:
            m.batch(w.batch.planner)
        return Response(m.render(), media_type=m.content_type)

    async def chat(self, request):
        return await self._complete(request, "chat")

    async def completions(self, request):
        return await self._complete(request, "completion")

    async def _complete(self, request, kind: str):
        from starlette.concurrency import run_in_threadpool

        st = self.state
        body = parse_json(await read_body(request, st.cfg.max_body))
        req = parse_request(body, kind, st.limits)
        tokens, plan = await run_in_threadpool(st.prompt_tokens, req)
        try:
            settings = settings_for(req, st.defaults, st.seed_for(req)).validate()
        except UsageError as e:  # a combination the per-field checks let through (draft_min > draft_max…)
            raise ApiError(400, str(e), "invalid_value")
        if plan.forced is not None:  # compiled here, off the engine's thread (cached by its text)
            settings = replace(settings, constraint=await run_in_threadpool(st.call_constraint, req, plan))
        elif req.constraint is not None:  # a thinking model's answer comes after its reasoning: the format holds it
            c = req.constraint
            if plan.think is not None and plan.in_thinking:
                c = replace(c, after=plan.think.end)
            settings = replace(settings, constraint=await run_in_threadpool(st.compile, c))
        events: asyncio.Queue = asyncio.Queue()
        job = Job(tokens, settings, req.stops, lambda item: None, cache_prompt=req.cache_prompt,
                  speculative=req.speculative, outbox=st.outbox())
        job.emit = emitter(job.outbox, events, on_overflow=job.cancel)
        st.scheduler.submit(job)
        ids = ResponseIds(kind, st.limits.model_id)
        if req.stream:
            return self.EventStream(_event_stream(ids, req, events, plan), on_disconnect=job.cancel)
        return await self._collect(request, ids, job, events, plan)

    async def _collect(self, request, ids: ResponseIds, job: Job, events: asyncio.Queue, plan: AnswerPlan):
        """Wait for the whole answer; a client that leaves first cancels its generation."""

        async def answer():
            parts, entries = [], []
            while True:
                kind, value = await events.get()
                if kind == "text":
                    parts.append(value)
                elif kind == "logprobs":
                    entries.append(value)
                elif kind == "done":
                    return "".join(parts), value, entries
                else:
                    raise value

        task = asyncio.ensure_future(answer())
        gone = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():  # the client left (or the drain timed out): stop its generation
                job.cancel()
                task.cancel()
            gone.cancel()
        if task not in done:
            raise ApiError(499, "the client closed the connection", "client_closed")
        text, outcome, entries = task.result()
        logprobs = entries if job.settings.logprobs is not None else None
        if ids.kind != "chat" or plan.plain:
            return _json(full_response(ids, text, outcome, logprobs))
        answer = AnswerStream(plan)
        message = merge(answer.feed(text) + answer.flush())
        finish = answer.finish_reason(FINISH.get(outcome.finish, "stop"))
        return _json(full_response(ids, text, outcome, logprobs, message, finish))


def create_app(state: ServerState, on_ready: Callable[[], None] | None = None):
    """The ASGI app; `on_ready` runs once uvicorn has its signal handlers in place (so a Ctrl-C right after
    the ready line still drains and exits 0)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    h = Handlers(state)

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(ApiError(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})", code))

    routes = [
        Route("/health", h.route("/health", h.health, auth=False), methods=["GET"]),
        Route("/v1/models", h.route("/v1/models", h.models), methods=["GET"]),
        Route("/metrics", h.route("/metrics", h.metrics), methods=["GET"]),
        Route("/v1/chat/completions", h.route("/v1/chat/completions", h.chat), methods=["POST"]),
        Route("/v1/completions", h.route("/v1/completions", h.completions), methods=["POST"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if on_ready is not None:
            on_ready()
        yield

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)


# ==== the server's life ============================================================================
def _quiet_server_class():
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn re-raises Ctrl-C/SIGTERM after its graceful shutdown; an orderly stop here exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

    return QuietServer


class SpecqServer:
    """A loaded pair behind an HTTP app; `serve(sock)` blocks until Ctrl-C/SIGTERM has drained it.

    The engine stays on the thread that loaded it (this one, the main thread), which runs the scheduler's loop;
    uvicorn runs on a thread of its own. llama.cpp's CPU backend computes with GNU OpenMP, whose thread team
    belongs to the calling thread: an engine driven from another thread than its own decodes slower
    (docs/benchmarks.md, "The engine driven from another thread")."""

    def __init__(self, engine: Engine, template: str | None, defaults: GenerationSettings, cfg: ServeConfig,
                 model_name: str):
        self.engine = engine
        self.state = ServerState(engine, template, defaults, cfg, model_name)
        self._http = None  # the uvicorn server while serve() runs

    def serve(self, sock: socket.socket, verbose: bool = False, on_ready: Callable[[], None] | None = None) -> None:
        import uvicorn

        config = uvicorn.Config(create_app(self.state, on_ready), log_config=None, access_log=verbose, lifespan="on",
                                timeout_graceful_shutdown=self.state.cfg.drain_s)
        http = self._http = _quiet_server_class()(config)
        failed: list[BaseException] = []

        def run_http() -> None:
            try:
                http.run(sockets=[sock])
            except BaseException as e:  # re-raised on the main thread, which reports it
                failed.append(e)
            finally:
                self.state.scheduler.stop()  # drained (or failed): the engine's loop ends

        thread = threading.Thread(target=run_http, name="specq-http", daemon=True)
        # uvicorn installs no signal handlers off the main thread: Ctrl-C/SIGTERM reach it through these
        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, http.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        thread.start()
        try:
            self.state.scheduler.run()
        finally:
            http.should_exit = True
            thread.join()
            for s, handler in old.items():
                signal.signal(s, handler)
        if failed:
            raise failed[0]

    def shutdown(self) -> None:
        """Ask a running serve() to drain and return, as Ctrl-C would (from any thread)."""
        if self._http is not None:
            self._http.should_exit = True

    def close(self) -> None:
        """Free the models (on the thread that loaded them)."""
        try:
            self.state.scheduler.stop()
        finally:
            self.engine.close()


def open_server(engine: EngineConfig, *, template: str | None, defaults: GenerationSettings, cfg: ServeConfig,
                engine_factory: Callable[..., Engine] = Engine) -> SpecqServer:
    """Load the models and build the app (closing the engine if the template is unusable)."""
    eng = engine.open(factory=engine_factory)
    try:
        tpl = load_template(template, eng.target.chat_template(), engine.target) \
            if template or eng.target.chat_template() else None
        return SpecqServer(eng, tpl, defaults, cfg.validate(), model_id(engine.target))
    except BaseException:
        eng.close()
        raise

