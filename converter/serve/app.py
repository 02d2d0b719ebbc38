"""The ASGI app of `fuselm serve` (Starlette): OpenAI's /v1/chat/completions, /v1/completions
and /v1/models, plus /health. Handlers parse and check requests, tokenize off the event loop,
hand a Job to the scheduler and turn its delivery (delivery.py) into a response or a
server-sent-event stream. Every failure is a JSON error in OpenAI's schema with its status;
none reaches the client as a traceback, and none stops the server. Before any handler,
access.AccessGuard checks who is asking (Host, Origin, API key); request_body checks what the
body is."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fuselm.converter.serve.access import AccessGuard, AccessRules
from fuselm.converter.serve.delivery import deliver
from fuselm.converter.serve.errors import ApiError
from fuselm.converter.serve.request_body import read_json
from fuselm.converter.serve.scheduler import EngineLost, Job, QueueFull, Scheduler
from fuselm.converter.serve.schema import (
    ChatRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    new_id,
    not_implemented,
    usage,
    usage_chunk,
    without_no_ops,
)
from fuselm.runtime_metal.chat_template import (
    ChatTemplateError,
    chat_ids,
    chat_text,
    start_workers,
)
from fuselm.runtime_metal.sampling import SamplingOptions

log = logging.getLogger("fuselm.serve")


@dataclass
class ServeState:
    scheduler: Scheduler
    tokenizer: Any  # the handlers' own tokenizer (the engine thread decodes with another)
    model_id: str
    max_context: int
    vocab_size: int
    default_max_tokens: int
    max_body: int
    engine: dict[str, object]
    # A request's sampling where it sets none: the model's generation_config.json, else greedy.
    sampling: SamplingOptions = SamplingOptions()
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share
        start_workers()  # chat templates render in worker processes (chat_template.py)

    def encode(self, fn: Callable[[Any], list[int]]) -> list[int]:
        with self._tok_lock:
            return fn(self.tokenizer)


def _parse(chat: bool, data: dict[str, Any]) -> Any:
    name = not_implemented(data, chat)
    if name is not None:
        shown = json.dumps(data[name], ensure_ascii=False)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ApiError(400, f"{name}: fuselm does not implement this parameter (got {shown}); "
                            "leave it out", param=name, code="unsupported_parameter")
    try:
        return (ChatRequest if chat else CompletionRequest).model_validate(
            without_no_ops(data, chat))
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "not_implemented":  # a message field (schema.Message)
            param = f"{param}.{first['ctx']['name']}"
            raise ApiError(400, f"{param}: fuselm does not implement this message field; leave "
                                "it out", param=param, code="unsupported_parameter") from None
        if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
            raise ApiError(400, f"{param}: unknown parameter; fuselm does not implement it",
                           param=param, code="unknown_parameter") from None
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ApiError(400, f"{param}: {first['msg']}{more}", param=param) from None


def _check_model(state: ServeState, req: ChatRequest | CompletionRequest) -> None:
    if req.model != state.model_id:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves "
                            f"{state.model_id!r}", param="model", code="model_not_found")


def _limit(state: ServeState, n_prompt: int, requested: int | None, prompt_param: str) -> int:
    """max_tokens for this prompt: OpenAI refuses what does not fit rather than truncating."""
    if n_prompt >= state.max_context:
        raise ApiError(400, f"the prompt has {n_prompt} tokens; this server's context is "
                            f"{state.max_context} tokens. Shorten the prompt.",
                       param=prompt_param, code="context_length_exceeded")
    room = state.max_context - n_prompt
    if requested is None:
        return min(room, state.default_max_tokens)
    if requested > room:
        raise ApiError(400, f"this server's context is {state.max_context} tokens, but "
                            f"{n_prompt + requested} were requested ({n_prompt} in the prompt, "
                            f"{requested} for the completion); lower max_tokens or shorten the "
                            "prompt", param="max_tokens", code="context_length_exceeded")
    return requested


def _chat_ids(state: ServeState, req: ChatRequest) -> list[int]:
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    except ValueError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    if not getattr(state.tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions")
    # Rendered in a worker process with a time limit, outside the tokenizer lock: a slow
    # template holds this request only, never the others waiting to encode.
    try:
        text = chat_text(state.tokenizer, messages)
    except ChatTemplateError as e:
        code = "chat_template_limit" if e.kind == "limit" else "chat_template_error"
        raise ApiError(400, str(e), param="messages", code=code) from None
    return state.encode(lambda tok: chat_ids(tok, text))


def _completion_ids(state: ServeState, req: CompletionRequest) -> list[int]:
    if isinstance(req.prompt, list):
        ids = [int(i) for i in req.prompt]
        if any(i < 0 or i >= state.vocab_size for i in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {state.vocab_size})",
                           param="prompt")
        return ids
    text = req.prompt
    ids = state.encode(lambda tok: [int(i) for i in tok.encode(text, add_special_tokens=True)])
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


async def _submit(request: Request, kind: str) -> Response:
    state: ServeState = request.app.state.serve
    data = await read_json(request, state.max_body)
    chat = kind == "chat"
    req = _parse(chat, data)
    _check_model(state, req)
    ids = await run_in_threadpool(_chat_ids if chat else _completion_ids, state, req)
    max_tokens = _limit(state, len(ids), req.token_limit(), "messages" if chat else "prompt")
    sampling = req.sampling(state.sampling)
    job = Job(new_id("chatcmpl" if chat else "cmpl"), ids, sampling, max_tokens,
              req.stop_list(), asyncio.get_running_loop())
    try:
        state.scheduler.submit(job)
    except QueueFull as e:
        raise ApiError(503, str(e), kind="server_error", code="queue_full") from None
    except EngineLost as e:
        raise ApiError(503, str(e), kind="server_error", code="engine_lost") from None
    if req.stream:
        return StreamingResponse(_stream(state, job, chat, req.include_usage()),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _collect(request, state, job, chat)


async def _collect(request: Request, state: ServeState, job: Job, chat: bool) -> Response:
    async def read() -> tuple[str, Any]:
        parts: list[str] = []
        async for event in deliver(job, state.scheduler.decode):
            if event[0] == "delta":
                parts.append(event[1])
            elif event[0] == "error":
                raise ApiError(event[1], event[2], kind="server_error")
            else:
                return "".join(parts), event
        raise AssertionError("a delivery ends with done or error")

    task = asyncio.ensure_future(read())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                break
            if await request.is_disconnected():
                job.cancelled.set()
                return Response(status_code=499)
        text, (_, finish, u) = task.result()
        use = usage(u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"])
        make = chat_response if chat else completion_response
        return JSONResponse(make(job.rid, state.model_id, text, finish, use))
    finally:
        task.cancel()
        job.cancelled.set()  # a no-op once done; frees the slot if the handler was cancelled


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(state: ServeState, job: Job, chat: bool, include_usage: bool
                  ) -> AsyncIterator[str]:
    """One SSE chunk per delivery turn: all the text that came since the last (delivery.py)."""
    created, model = int(time.time()), state.model_id
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None = None) -> dict[str, Any]:
        if chat:
            return chat_chunk(job.rid, model, created, {} if text is None else
                              {"content": text}, finish)
        return completion_chunk(job.rid, model, created, text or "", finish)

    try:
        if chat:
            yield _sse(chat_chunk(job.rid, model, created, {"role": "assistant", "content": ""}))
        async for event in deliver(job, state.scheduler.decode):
            if event[0] == "delta":
                yield _sse(chunk(event[1]))
            elif event[0] == "error":
                yield _sse(error_body(event[2], "server_error"))
            else:
                _, finish, u = event
                yield _sse(chunk(None, finish))
                if include_usage:
                    use = usage(u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"])
                    yield _sse(usage_chunk(job.rid, model, created, obj, use))
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # the client left (or we are done): free the slot at once


async def chat_completions(request: Request) -> Response:
    return await _submit(request, "chat")


async def completions(request: Request) -> Response:
    return await _submit(request, "completion")


async def models(request: Request) -> Response:
    state: ServeState = request.app.state.serve
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_id, "object": "model", "created": state.created,
         "owned_by": "fuselm",
         "fuselm": {"max_context": state.max_context,
                    "sampling_defaults": state.sampling.describe()}}]})


async def health(request: Request) -> Response:
    state: ServeState = request.app.state.serve
    ok = state.scheduler.alive()
    lost = {"error": state.scheduler.lost} if state.scheduler.lost else {}
    return JSONResponse({"status": "ok" if ok else "error", "model": state.model_id,
                         "engine": state.engine, **lost, **state.scheduler.stats()},
                        status_code=200 if ok else 503)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind),
                        status_code=exc.status_code)


async def _disconnect(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # the client left while sending its body; nobody reads


async def _internal(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body("internal server error (see the server log)",
                                   "server_error"), status_code=500)


def create_app(state: ServeState, access: AccessRules | None = None) -> Starlette:
    """`access` defaults to loopback Host names only, no cross-origin caller and no key."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    guard = Middleware(AccessGuard, rules=access or AccessRules.build("127.0.0.1"),
                       methods={r.path: r.methods or () for r in routes})
    app = Starlette(routes=routes, middleware=[guard], exception_handlers={
        ApiError: _api_error, HTTPException: _http_error, ClientDisconnect: _disconnect,
        Exception: _internal})
    app.state.serve = state
    return app
