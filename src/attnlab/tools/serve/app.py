"""The web application of ``attnlab serve``: the inspector page, its files, and a JSON API.

``GET /`` is the inspector page: the same ``viewer.html``, ``viewer.css`` and ``viewer.js`` as the
offline page (package data of :mod:`attnlab.interpret`), linked instead of inlined, with a live data
source that asks the API for what the page shows. The API's routes are below, each with its summary
(the schema at ``/openapi.json``; docs/inspect.md lists them): info and stats, a prompt's tokens,
inspection, next tokens and ablation, generation and chat as server-sent events, patching, circuits,
the Features tab's routes and the six-word demo.

Safe by default: request bodies are limited (Content-Length and the bytes actually streamed), POSTs
must be JSON, the Host header must name the loopback address the server is bound to (no DNS
rebinding), every error is a 4xx/5xx with a one-line ``{"detail": "..."}``, files are served from a
fixed list (nothing else is reachable), and the page's Content-Security-Policy allows requests to
this server only.
"""

from __future__ import annotations

import base64
import html
import json
import secrets
from collections.abc import AsyncIterator, Callable
from string import Template
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from attnlab import __version__
from attnlab.interpret.circuit_view import CIRCUIT_ASSETS, read_circuit_asset
from attnlab.interpret.codec import Packed
from attnlab.interpret.page import ASSETS, json_for_script, read_asset
from attnlab.tools.circuit import serve_circuit
from attnlab.tools.serve.api import (
    AblateAnswer,
    AblateRequest,
    ChatRequest,
    CircuitRequest,
    FeaturesRequest,
    GenerateRequest,
    InfoAnswer,
    InspectRequest,
    LatentRequest,
    NextAnswer,
    NextRequest,
    PatchRequest,
    PromptRequest,
    StatsAnswer,
    SteerRequest,
    TokenizeAnswer,
)
from attnlab.tools.serve.chat import NoChatTemplate, advance_chat, start_chat
from attnlab.tools.serve.engine import Engine, NotALanguageModel
from attnlab.tools.serve.features import NoSAE, features_answer, latent_answer, steer_answer
from attnlab.tools.serve.patching import patch_answer, patch_sites, prepare_patch, unpatched_runs

__all__ = ["LIVE_CSP", "LOOPBACK_NAMES", "PAGE_CSP", "create_app", "live_page", "packed_json"]

# The live page talks to this server only: its own scripts and styles, fetches to itself, canvases
# as data: images. No inline script runs (the page's configuration is a JSON block, not code).
LIVE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src data:; "
    "base-uri 'none'; form-action 'none'"
)
PAGE_CSP = LIVE_CSP + "; frame-ancestors 'none'"  # in the header: a <meta> policy cannot forbid framing
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}
CONTENT_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript"}
COMMON_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]


def live_page(engine: Engine) -> str:
    """The inspector page as served: the offline page's template, its files linked, a live source."""
    config = {"api": "api/", "name": engine.name, "version": __version__}
    return Template(read_asset("viewer.html")).substitute(
        csp=LIVE_CSP,
        title=html.escape(engine.name),
        styles='<link rel="icon" href="data:,">\n<link rel="stylesheet" href="assets/viewer.css">'
        '\n<link rel="stylesheet" href="assets/patching.css">\n<link rel="stylesheet" href="assets/circuit.css">'
        '\n<link rel="stylesheet" href="assets/features.css">',
        data=f'<script type="application/json" id="attn-live">{json_for_script(config)}</script>',
        scripts='<script src="assets/patching.js"></script>\n<script src="assets/circuit.js"></script>'
        '\n<script src="assets/sae_dashboard.js"></script>\n<script src="assets/features.js"></script>'
        '\n<script src="assets/viewer.js"></script>',
    )


# ------------------------------------------------------------------------------------------------
# Requests, checked before the application sees them
# ------------------------------------------------------------------------------------------------
def _host_name(value: str) -> str:
    """The name in a Host header, without its port: ``[::1]:8000`` -> ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """ASGI middleware: the Host header, the body's size and the content type of every request.

    The body is read here, counted as it streams in (a missing or false Content-Length changes
    nothing), and handed to the application only when it fits ``max_body_bytes``.
    """

    def __init__(self, app: Any, *, max_body_bytes: int, allowed_hosts: set[str] | None, router: Any):
        self.app, self.max_body_bytes, self.allowed_hosts, self.router = app, max_body_bytes, allowed_hosts, router

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *COMMON_HEADERS]}
            await send(message)

        if self.allowed_hosts is not None and _host_name(headers.get("host", "")) not in self.allowed_hosts:
            await _error(send_with_headers, 400, "the Host header must name this machine's loopback address")
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await _error(send_with_headers, 400, f"bad Content-Length header: {length!r}")
                return
            if int(length) > self.max_body_bytes:
                await _error(send_with_headers, 413, _too_big(int(length), self.max_body_bytes))
                return
        if scope["method"] not in ("POST", "PUT", "PATCH") or not self._routed(scope):
            await self.app(scope, receive, send_with_headers)  # (no route takes it: the router's 404 or 405)
            return
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            await _error(send_with_headers, 415, f"send JSON (Content-Type: application/json), got {ctype or 'none'!r}")
            return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            part = message.get("body", b"")
            total += len(part)
            if total > self.max_body_bytes:
                await _error(send_with_headers, 413, _too_big(total, self.max_body_bytes, at_least=True))
                return
            chunks.append(part)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:  # (FastAPI's own words for it: "There was an error parsing the body")
            await _error(send_with_headers, 400, f"the request body is not UTF-8 text (byte {e.start}: {e.reason})")
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, for streaming answers

        await self.app(scope, replay, send_with_headers)

    def _routed(self, scope: dict) -> bool:
        """Whether a route takes this path and method (else the body is not read, nor its type checked)."""
        return any(route.matches(scope)[0] == Match.FULL for route in self.router.routes)


def _too_big(n: int, limit: int, at_least: bool = False) -> str:
    return f"request body too large: {'more than ' if at_least else ''}{n} bytes, the limit is {limit}"


async def _error(send: Callable, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _one_line(exc: RequestValidationError) -> tuple[int, str]:
    """A validation error as (status, one line): bad JSON is a 400, a bad value a 422."""
    errors = exc.errors()
    for e in errors:
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx") or {}
            return 400, f"the request body is not valid JSON ({ctx.get('error', 'cannot be parsed')})"
    # One entry a field: the errors of a union's members (their locations end in pydantic's names of
    # the members' types, "str", "constrained-int") are one field's alternatives.
    fields: dict[str, tuple[list[str], Any]] = {}
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body" and not _type_name(p)) or "body"
        msgs, _ = fields.setdefault(loc, ([], e.get("input", _MISSING)))
        if (msg := e.get("msg", "invalid")) not in msgs:
            msgs.append(msg)
    parts = []
    for loc, (msgs, given) in list(fields.items())[:3]:
        got = "" if given is _MISSING or msgs == ["Field required"] else f", got {_short(given)}"
        parts.append(f"{loc}: {' or '.join(msgs)}{got}")
    more = f" (and {len(fields) - 3} more)" if len(fields) > 3 else ""
    return 422, "; ".join(parts).replace("\n", " ") + more


_MISSING = object()
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _type_name(part: object) -> bool:
    """Whether a location's ``part`` is pydantic's name of a union member's type, not a field or index."""
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part or "-" in part)


def _short(value: Any) -> str:
    """``value`` as JSON, cut to 60 characters (the error names what came, not all of it)."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------------------
# The application
# ------------------------------------------------------------------------------------------------
def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return Response(text, status_code=status, media_type="application/json", headers=headers)


def packed_json(data: Any) -> bytes:
    """``json.dumps(to_json(data))`` as UTF-8 bytes, made faster: each packed array's base64 is spliced
    into the text instead of passing through ``json.dumps``, which would scan its megabytes for a
    character to escape (base64 has none)."""
    arrays: list[Packed] = []
    marker = "attnlab-" + secrets.token_hex(12) + "-"  # no text of the request can know it

    def walk(obj: Any) -> Any:
        if isinstance(obj, Packed):
            arrays.append(obj)
            return {**obj.header(), "b64": f"{marker}{len(arrays) - 1}"}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [walk(v) for v in obj]
        return obj

    text = json.dumps(walk(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    pieces = text.split(f'"{marker}'.encode())
    out = [pieces[0]]
    for piece in pieces[1:]:  # each: the array's number, the closing quote, the text up to the next array
        number, rest = piece.split(b'"', 1)
        out += [b'"', base64.b64encode(arrays[int(number)].data), b'"', rest]
    return b"".join(out)


def _packed_response(data: Any) -> Response:
    return Response(packed_json(data), media_type="application/json")


def _sse(event: str, data: Any) -> bytes:
    """A server-sent event ``event`` of ``data``, its packed arrays spliced in (:func:`packed_json`)."""
    return b"event: " + event.encode() + b"\ndata: " + packed_json(data) + b"\n\n"


def create_app(engine: Engine, *, allowed_hosts: set[str] | None = None) -> FastAPI:
    """The ASGI application serving ``engine``.

    Args:
        engine: the model (or the six-word example) and its limits.
        allowed_hosts: names the Host header may carry (a loopback server: :data:`LOOPBACK_NAMES`);
            None accepts any (a server bound to another address).
    """
    app = FastAPI(
        title="attnlab serve",
        version=__version__,
        description="The attnlab inspector of one model, live: what attnlab.interpret computes, as JSON. "
        "Arrays are packed (see attnlab.interpret.codec): {dtype, shape, tri, b64}.",
        docs_url=None,  # Swagger UI and ReDoc load their code from a CDN: the schema is at /openapi.json
        redoc_url=None,
    )
    app.add_middleware(
        Guard, max_body_bytes=engine.limits.max_body_bytes, allowed_hosts=allowed_hosts, router=app.router
    )
    _add_error_handlers(app)
    _add_page_routes(app, engine)
    _add_prompt_routes(app, engine)
    _add_generate_route(app, engine)
    _add_chat_route(app, engine)
    _add_patch_and_demo_routes(app, engine)
    _add_features_routes(app, engine)
    return app


async def _call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn`` in a worker thread (model work blocks), its errors as one-line 4xx answers. A request's
    fields are named as the arguments of the function it goes to: the routes pass ``**req.model_dump()``."""
    return await run_in_threadpool(fn, *args, **kwargs)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as a one-line ``{"detail": "..."}``: a bad request 400/422, a model that cannot do
    what was asked 409, something missing 404, anything else 500."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        status, detail = _one_line(exc)
        return _json({"detail": detail}, status)

    @app.exception_handler(NotALanguageModel)
    @app.exception_handler(NoChatTemplate)
    @app.exception_handler(NoSAE)
    async def not_a_language_model(request: Request, exc: Exception) -> Response:
        return _json({"detail": str(exc)}, 409)

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> Response:
        return _json({"detail": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}, 422)

    @app.exception_handler(LookupError)
    async def not_here(request: Request, exc: LookupError) -> Response:
        return _json({"detail": str(exc)}, 404)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = getattr(exc, "headers", None) or {}
        detail = str(exc.detail)
        if exc.status_code == 405 and "Allow" in headers:  # (Starlette's "Method Not Allowed": say which)
            detail = f"{request.method} is not allowed on {request.url.path}: use {headers['Allow']}"
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # (FastAPI's words)
            detail = "the request body is not valid JSON (nested too deeply to read)"
        return _json({"detail": detail}, exc.status_code, headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return _json({"detail": f"internal error: {type(exc).__name__}: {first}"}, 500)


def _add_page_routes(app: FastAPI, engine: Engine) -> None:
    """``/``, the inspector page, and ``/assets/{name}``, its files."""
    assets = {name: read_asset(name) for name in ASSETS}
    assets |= {name: read_circuit_asset(name) for name in CIRCUIT_ASSETS if not name.endswith(".html")}
    page = live_page(engine)

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False)
    async def index() -> Response:
        return HTMLResponse(page, headers={"content-security-policy": PAGE_CSP, "cache-control": "no-store"})

    @app.get("/assets/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:  # a fixed list: no path, encoded or not, reaches anything else
            return _json({"detail": f"no such file: {name!r}"}, 404)
        suffix = name[name.rfind(".") :]
        return Response(assets[name], media_type=CONTENT_TYPES[suffix], headers={"cache-control": "no-cache"})


def _add_prompt_routes(app: FastAPI, engine: Engine) -> None:
    """The API's answers in one piece: info, stats, and what one forward of a prompt shows."""

    @app.get("/api/info", response_model=InfoAnswer, summary="the model, the limits, what the page can do")
    async def info() -> dict:
        return engine.info()

    @app.get("/api/stats", response_model=StatsAnswer, summary="counters of the work done")
    async def stats() -> dict:
        return engine.snapshot()

    @app.post("/api/tokenize", response_model=TokenizeAnswer, summary="the prompt's tokens")
    async def tokenize(req: PromptRequest) -> dict:
        return await _call(engine.tokenize, req.prompt)

    @app.post(
        "/api/inspect",
        summary="attnlab.interpret.inspector_data of a prompt, the sections asked for",
        responses={200: {"description": "the page data: tokens, labels, model, and each section asked for"}},
    )
    async def inspect(req: InspectRequest) -> Response:
        data = await _call(engine.inspect, **req.model_dump())
        return await _call(_packed_response, data)  # a worker thread: megabytes to encode, the event loop free

    @app.post("/api/next", response_model=NextAnswer, summary="next-token probabilities after a position")
    async def next_tokens(req: NextRequest) -> dict:
        return await _call(engine.next_tokens, **req.model_dump())

    @app.post("/api/ablate", response_model=AblateAnswer, summary="the effect of removing heads")
    async def ablate(req: AblateRequest) -> dict:
        return await _call(engine.ablate, **req.model_dump())


def _event_stream(
    engine: Engine, run: Any, start: dict, step: Callable[[], Any], done: Callable[[], dict], what: str
) -> StreamingResponse:
    """``start``, a ``token`` event per ``step()`` until it gives None, then ``done()`` (or ``error``
    if ``what`` failed midway), as server-sent events; ``engine.finish(run)`` runs when the stream ends
    and also after the response, in case the stream was cancelled before it started."""

    async def events() -> AsyncIterator[bytes]:
        try:
            yield _sse("start", start)
            while (token := await run_in_threadpool(step)) is not None:
                yield _sse("token", token)
            yield _sse("done", done())
        except Exception as exc:  # the answer has begun (200): a failure is the stream's last event
            first = str(exc).splitlines()[0] if str(exc) else ""
            yield _sse("error", {"detail": f"{what} failed: {type(exc).__name__}: {first}"})
        finally:
            with anyio.CancelScope(shield=True):  # also when the client left (the stream is cancelled)
                await run_in_threadpool(engine.finish, run)

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        background=BackgroundTask(run_in_threadpool, engine.finish, run),
    )


def _add_generate_route(app: FastAPI, engine: Engine) -> None:
    """``/api/generate``: a generation, token by token, with what the inspector plays back."""

    @app.post(
        "/api/generate",
        summary="a generation streamed as server-sent events",
        description="Events: `start` {prompt_length, tokens, labels, settings}; then per new token `token` "
        "{token, position, key_start, key_index, weights (L, H, S) packed, candidates, probs, token_prob, "
        "labels} (what attnlab.interpret.trace_generation records); then `done` {generated, reason} (or "
        "`error` {detail} if the generation failed midway). A client that disconnects stops the generation.",
        responses={200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
    )
    async def generate(req: GenerateRequest) -> Response:
        run = await _call(engine.start_generation, **req.model_dump())
        start = {
            "prompt_length": run.prompt_length,
            "tokens": list(run.ids),
            "labels": await _call(engine.labels, run.ids),
            "settings": {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "seed": req.seed},
            "max_new_tokens": req.max_new_tokens,
        }

        def done() -> dict:
            return {"generated": run.produced, "reason": run.end_reason}

        return _event_stream(engine, run, start, lambda: engine.advance(run), done, "generation")


def _add_chat_route(app: FastAPI, engine: Engine) -> None:
    """``/api/chat``: one assistant turn, token by token, as text."""

    @app.post(
        "/api/chat",
        summary="one assistant turn of a conversation, streamed as server-sent events",
        description="Events: `start` {prompt (the rendered conversation), prompt_length (tokens), dropped (messages "
        "dropped from the start to fit the context window)}; then per new token `token` {token, text (the text it "
        "completes, maybe empty)}; then `done` {answer, generated, reason (stop: the model's end-of-turn token; "
        "length; shutdown), inspect (the conversation and the answer: the inspector's prompt)}, or `error` "
        "{detail}. A client that disconnects stops the answer.",
        responses={200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
    )
    async def chat(req: ChatRequest) -> Response:
        run = await _call(start_chat, engine, **req.model_dump())  # (the messages as dicts)
        start = {"prompt": run.prompt_text, "prompt_length": run.prompt_length, "dropped": run.dropped}

        def done() -> dict:
            return dict(answer=run.answer, generated=run.produced, reason=run.end_reason, inspect=run.inspect_text)

        return _event_stream(engine, run, start, lambda: advance_chat(engine, run), done, "chat")


def _add_patch_and_demo_routes(app: FastAPI, engine: Engine) -> None:
    """``/api/patch``, the patching view, and ``/api/demo``, the six-word example's page."""

    @app.post(
        "/api/patch",
        summary="activation patching of a clean and a corrupted prompt: the patching view",
        description="The metric logit(A) - logit(B) at the last token of both runs, attnlab.interpret."
        "activation_patching of each site asked for (head_out (L, H), resid_pre (L, T): raw metric values, packed), "
        "and with `head` that head's attention pattern on both prompts. See attnlab.interpret.patch_view.",
    )
    async def patch(req: PatchRequest, request: Request) -> Response:
        job = await _call(prepare_patch, engine, req.clean, req.corrupted, req.answers, req.head)
        values, pattern = await _call(unpatched_runs, engine, job)
        results = await patch_sites(engine, job, req.sites, _call, request.is_disconnected)  # in pieces
        if results is None:  # the reader pressed stop, or patched again
            return _json({"detail": "the client left"}, 400)
        return await _call(_packed_response, patch_answer(engine, job, values, results, pattern))

    @app.post(
        "/api/circuit",
        summary="edge attribution of a clean and a corrupted prompt: the circuit view",
        description="Every edge's score by EAP or EAP-IG (attnlab.interpret.edge_attribution) for logit(A) - logit(B) "
        "at the last token, the faithfulness of the top edges' circuits at MIB's budgets (CPR, CMD), the circuit of "
        "`budget`'s top edges (its strongest drawn) and the attention of its heads on both prompts. Plain JSON; see "
        "attnlab.interpret.circuit_view.",
    )
    async def circuit(req: CircuitRequest, request: Request) -> Response:
        def left() -> bool:  # (asked from the worker thread: the event loop answers)
            return anyio.from_thread.run(request.is_disconnected)

        section = await _call(serve_circuit, engine, **req.model_dump(), left=left)
        if section is None:  # the reader pressed stop, or asked again
            return _json({"detail": "the client left"}, 400)
        return _json(section)

    @app.get("/api/demo", summary="the page data of the tutorials' six-word example (attnlab serve --demo)")
    async def demo() -> Response:
        return _packed_response(engine.demo_data())


def _add_features_routes(app: FastAPI, engine: Engine) -> None:
    """``/api/features``, ``/api/latent``, ``/api/steer``: the Features tab (``attnlab serve --sae DIR``)."""

    @app.post("/api/features", summary="each token's strongest SAE latents")
    async def features(req: FeaturesRequest) -> Response:
        return _json(await _call(features_answer, engine, **req.model_dump()))

    @app.post(
        "/api/latent",
        summary="one latent: its activation on each token of the prompt and its dashboard",
        description="The dashboard (attnlab.interpret.sae_view.dashboard_data): top-activating contexts, a histogram "
        "of its nonzero activations (log10 bins), its density, and the tokens it promotes and suppresses through "
        "the unembedding; over the prompt, or over the corpus given at start-up (--sae-data).",
    )
    async def latent(req: LatentRequest) -> Response:
        return _json(await _call(latent_answer, engine, **req.model_dump()))

    @app.post(
        "/api/steer",
        summary="a generation with latents' directions added at the SAE's hook point, and without them",
        description="attnlab.interpret.steer for each latent (strength x its decoder direction, at every position), "
        "the tokens drawn with a generator on the model's device seeded with seed; "
        "with compare, the same generation unsteered.",
    )
    async def steered(req: SteerRequest) -> Response:
        steering = [(s.latent, s.strength) for s in req.steer]
        return _json(await _call(steer_answer, engine, steering=steering, **req.model_dump(exclude={"steer"})))
