"""The ASGI app of `fuselm serve` (Starlette): OpenAI's /v1/chat/completions, /v1/completions,
/v1/models and /v1/models/{model}, plus /health. Handlers parse and check requests, tokenize off
the event loop, hand a Job to the scheduler and turn its delivery (delivery.py) into a response or a
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
from functools import partial
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
from fuselm.converter.serve.scheduler import EngineLost, Job, OverBudget, QueueFull, Scheduler
from fuselm.converter.serve.schema import (
    ChatRequest,
    Choice,
    CompletionRequest,
    TextOffsets,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    error_body,
    new_id,
    not_implemented,
    usage,
    usage_chunk,
    without_no_ops,
)
from fuselm.converter.serve.structured import (
    Structure,
    ToolStream,
    call_deltas,
    openai_calls,
    request_structure,
    template_messages,
)
from fuselm.runtime_metal.chat_template import (
    ChatTemplateError,
    chat_ids,
    chat_text,
    start_workers,
    tokenizer_template,
)
from fuselm.runtime_metal.chat_window import fit
from fuselm.runtime_metal.constraint import ConstraintError, TokenConstraint, constraint_vocab
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.sampling import SamplingOptions, TokenLogprobs
from fuselm.runtime_metal.text_stream import token_text
from fuselm.runtime_metal.tool_calls import parse_reply

log = logging.getLogger("fuselm.serve")
DROPPED_HEADER = "x-fuselm-dropped-messages"  # the oldest messages a chat's cut dropped


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
    # The longest prompt + completion the whole KV budget holds (at most max_context; 0: that):
    # what a chat is cut to fit (chat_window.py) and a default max_tokens stops at.
    kv_window: int = 0
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share
        self._vocab: Any = None  # llguidance's vocabulary (vocab()), once built
        start_workers()  # chat templates render in worker processes (chat_template.py)

    def encode(self, fn: Callable[[Any], list[int]]) -> list[int]:
        with self._tok_lock:
            return fn(self.tokenizer)

    def structure(self, req: ChatRequest | CompletionRequest) -> Structure:
        """The request's response_format / tools, checked (structured.py)."""
        template = None
        if isinstance(req, ChatRequest) and req.tools:
            try:
                template = tokenizer_template(self.tokenizer)
            except ChatTemplateError as e:
                raise ApiError(400, str(e), param="messages", code="chat_template_error"
                               ) from None
        special = {t: i for t, i in zip(self.tokenizer.all_special_tokens,
                                        self.tokenizer.all_special_ids, strict=False)}
        return request_structure(req, template, special)

    def vocab(self) -> Any:
        """llguidance's view of this model's vocabulary (its tokens' bytes), built once."""
        if self._vocab is None:
            with self._tok_lock:  # built from the tokenizer once, on first use
                self._vocab = constraint_vocab(self.tokenizer, self.vocab_size,
                                               sorted(self.scheduler.eos))
        return self._vocab

    def constraint(self, grammar: str) -> TokenConstraint:
        """A request's own grammar state over this model's vocabulary."""
        return TokenConstraint(self.vocab(), grammar)

    def token_bytes(self, token: int) -> bytes | None:
        """One token's own bytes, a piece of a UTF-8 character included (None: a tokenizer
        llguidance cannot read). Call `vocab` off the event loop first: its first build takes
        a while (afterwards no lock is taken)."""
        try:
            return bytes(self.vocab().decode_bytes([int(token)]))
        except ConstraintError:
            return None


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
        errors = e.errors()
        at = [_where(data, x["loc"], x["type"] == "missing") for x in errors]
        # a union's branches fail apart: the one that got furthest into the value says most
        # (["a", 5] as `stop`: item 1, rather than "not a string")
        deepest = max(range(len(errors)), key=lambda i: at[i].count(".") + bool(at[i]))
        first, param = errors[deepest], at[deepest] or None
        if first["type"] == "not_implemented":  # a message field (schema.Message)
            param = f"{param}.{first['ctx']['name']}"
            raise ApiError(400, f"{param}: fuselm does not implement this message field; leave "
                                "it out", param=param, code="unsupported_parameter") from None
        if first["type"] == "missing_field":  # a message's (schema.Message)
            param = f"{param}.{first['ctx']['name']}"
            raise ApiError(400, f"{param}: {first['msg']}", param=param,
                           code="missing_required_parameter") from None
        if first["type"] == "content_part":  # the message names the part
            at = f"{param}.{first['ctx']['at']}"
            raise ApiError(400, first["msg"].replace(first["ctx"]["at"], at, 1), param=at,
                           code="unsupported_content" if at.endswith(".type") else None
                           ) from None
        if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
            raise ApiError(400, f"{param}: unknown parameter; fuselm does not implement it",
                           param=param, code="unknown_parameter") from None
        # a union's branches each fail at the same parameter: one message names them all
        alike = [x["msg"] for x, where in zip(errors, at, strict=True) if where == at[deepest]]
        message = " or ".join(dict.fromkeys(
            m if i == 0 else m.removeprefix("Input should be ") for i, m in enumerate(alike)))
        others = e.error_count() - len(alike)
        more = f" (and {others} more)" if others else ""
        raise ApiError(400, f"{param}: {message}{more}", param=param) from None


def _where(data: Any, loc: tuple[str | int, ...], missing: bool) -> str:
    """The parameter an error's location names, without pydantic's union branches
    ("stop.str"): the longest part of `loc` that is a path in the body (a missing field's
    name added)."""
    path: list[str] = []
    for key in loc:
        if isinstance(data, dict) and key in data or (
                isinstance(data, list) and isinstance(key, int) and key < len(data)):
            data = data[key]  # type: ignore[index]
            path.append(str(key))
    if missing and loc and (not path or path[-1] != str(loc[-1])):
        path.append(str(loc[-1]))
    return ".".join(path)


def _check_model(state: ServeState, req: ChatRequest | CompletionRequest) -> None:
    if req.model != state.model_id:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves "
                            f"{state.model_id!r}", param="model", code="model_not_found")


def _limit(state: ServeState, n_prompt: int, requested: int | None, prompt_param: str,
           limit_param: str) -> int:
    """max_tokens for this prompt: OpenAI refuses what does not fit rather than truncating.
    `limit_param`: the parameter that asked for `requested` (max_tokens or
    max_completion_tokens)."""
    if n_prompt >= state.max_context:
        raise ApiError(400, f"the prompt has {n_prompt} tokens; this server's context is "
                            f"{state.max_context} tokens. Shorten the prompt.",
                       param=prompt_param, code="context_length_exceeded")
    room = state.max_context - n_prompt
    if requested is None:  # what the KV budget can hold, at least one (else a 503 says why)
        fits = (state.kv_window or state.max_context) - n_prompt
        return min(room, state.default_max_tokens, max(fits, 1))
    if requested > room:
        raise ApiError(400, f"this server's context is {state.max_context} tokens, but "
                            f"{n_prompt + requested} were requested ({n_prompt} in the prompt, "
                            f"{requested} for the completion); lower {limit_param} or shorten "
                            "the prompt", param=limit_param, code="context_length_exceeded")
    return requested


def _chat_ids(state: ServeState, req: ChatRequest, structure: Structure
              ) -> tuple[list[int], int]:
    """The prompt's token ids (the request's tools rendered by the template), and how many of
    the oldest messages were dropped to fit the window (chat_window.py: the system messages and
    the last turn are kept; the reply's room is max_tokens, or one token when the request sets
    none)."""
    try:
        messages = template_messages(req)
    except ValueError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    if not getattr(state.tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions")

    def render(kept: list[dict[str, Any]]) -> list[int]:
        # Rendered in a worker process with a time limit, outside the tokenizer lock: a slow
        # template holds this request only, never the others waiting to encode.
        try:
            text = chat_text(state.tokenizer, kept, tools=structure.tools)
        except ChatTemplateError as e:
            code = "chat_template_limit" if e.kind == "limit" else "chat_template_error"
            raise ApiError(400, str(e), param="messages", code=code) from None
        return state.encode(lambda tok: chat_ids(tok, text))

    fitted = fit(messages, render, state.kv_window or state.max_context,
                 req.token_limit() or 1)
    if fitted.dropped_messages:
        log.info("dropped the %d oldest message(s) (%d turn(s)) of %d to fit %d tokens",
                 fitted.dropped_messages, fitted.dropped_turns, len(messages),
                 state.kv_window or state.max_context)
    return fitted.tokens, fitted.dropped_messages


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
    if req.n > state.scheduler.max_queue:  # its choices wait together: never admitted
        raise ApiError(400, f"n: {req.n} choices wait in the queue together, but this server "
                            f"queues at most {state.scheduler.max_queue} (--max-queue); ask "
                            "for fewer", param="n", code="invalid_value")
    structure = state.structure(req)
    if chat:
        ids, dropped = await run_in_threadpool(_chat_ids, state, req, structure)
    else:
        ids, dropped = await run_in_threadpool(_completion_ids, state, req), 0
    max_tokens = _limit(state, len(ids), req.token_limit(), "messages" if chat else "prompt",
                        req.token_limit_param())
    sampling = [req.sampling(state.sampling, i) for i in range(req.n)]
    try:
        sampling[0].check_vocab(state.vocab_size)
    except RuntimeUserError as e:
        raise ApiError(400, str(e), param="logit_bias") from None
    if req.alternatives() is not None:
        await run_in_threadpool(_prepare_bytes, state)
    constraints: list[TokenConstraint | None] = [None] * req.n
    if structure.grammar is not None:  # each choice follows the grammar with its own state
        grammar = structure.grammar
        constraints = [await run_in_threadpool(state.constraint, grammar) for _ in sampling]
    rid, loop = new_id("chatcmpl" if chat else "cmpl"), asyncio.get_running_loop()
    # One job (a batch row) per choice; the later ones start from the first's prompt.
    jobs: list[Job] = []
    for opts, constraint in zip(sampling, constraints, strict=True):
        jobs.append(Job(rid, ids, opts, max_tokens, req.stop_list(), loop,
                        top_logprobs=req.alternatives(), fork_of=jobs[0] if jobs else None,
                        constraint=constraint, tool_format=structure.fmt,
                        tool_names=structure.names))
    try:
        state.scheduler.submit(*jobs)
    except QueueFull as e:
        raise ApiError(503, str(e), kind="server_error", code="queue_full") from None
    except OverBudget as e:
        raise ApiError(503, str(e), kind="server_error", code="kv_budget_exceeded") from None
    except EngineLost as e:
        raise ApiError(503, str(e), kind="server_error", code="engine_lost") from None
    # What the chat's cut dropped, in a header: the response body stays OpenAI's.
    headers = {DROPPED_HEADER: str(dropped)} if dropped else {}
    if req.stream:
        return StreamingResponse(_stream(state, jobs, chat, req.include_usage(), structure),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    return await _collect(request, state, jobs, chat, headers, structure)


async def _events(state: ServeState, jobs: list[Job]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, delivery event) of every job, as they come (n > 1: interleaved)."""
    if len(jobs) == 1:
        async for event in deliver(jobs[0], state.scheduler.decode):
            yield 0, event
        return
    merged: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async for event in deliver(job, state.scheduler.decode):
                await merged.put((i, event))
        finally:
            await merged.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            i, event = await merged.get()
            if event is None:
                left -= 1
            else:
                yield i, event
    finally:
        for task in tasks:
            task.cancel()


def _token_text(state: ServeState) -> Callable[[int], str]:
    return partial(token_text, state.scheduler.decode)


def _prepare_bytes(state: ServeState) -> None:
    """Build the vocabulary logprobs' token bytes read (state.token_bytes) now, off the event
    loop; a tokenizer llguidance cannot read leaves them the token text's."""
    try:
        state.vocab()
    except ConstraintError:
        pass


def _total(jobs_usage: list[dict[str, int]]) -> dict[str, Any]:
    """One request's usage: its prompt once, every choice's completion tokens."""
    first = jobs_usage[0]
    return usage(first["prompt_tokens"], sum(u["completion_tokens"] for u in jobs_usage),
                 first["cached_tokens"])


async def _collect(request: Request, state: ServeState, jobs: list[Job], chat: bool,
                   headers: dict[str, str], structure: Structure) -> Response:
    async def read() -> list[tuple[str, list[TokenLogprobs], Any]]:
        parts: list[list[str]] = [[] for _ in jobs]
        records: list[list[TokenLogprobs]] = [[] for _ in jobs]
        ends: list[Any] = [None] * len(jobs)
        async for i, event in _events(state, jobs):
            if event[0] == "delta":
                parts[i].append(event[1])
                records[i] += event[2]
            elif event[0] == "error":
                raise ApiError(event[1], event[2], kind=_error_kind(event[1]))
            else:
                ends[i] = event
        return [("".join(p), r, e) for p, r, e in zip(parts, records, ends, strict=True)]

    task = asyncio.ensure_future(read())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                break
            if await request.is_disconnected():
                for job in jobs:
                    job.cancelled.set()
                return Response(status_code=499)
        results = task.result()
        use = _total([end[2] for _, _, end in results])
        token_text = _token_text(state)
        choices: list[Choice] = []
        calls: list[list[dict[str, Any]] | None] = []
        for job, (text, records, (_, finish, _)) in zip(jobs, results, strict=True):
            lp = None
            if job.top_logprobs is not None:
                lp = (chat_logprobs(records, token_text, state.token_bytes) if chat else
                      completion_logprobs(records, token_text, state.token_bytes,
                                          TextOffsets()))
            content: str | None = text
            found = None
            if chat and structure.fmt is not None:
                parsed = parse_reply(text, structure.fmt, structure.names)
                if parsed.calls:
                    content, finish, found = parsed.content, "tool_calls", openai_calls(
                        parsed.calls)
            choices.append((content, finish, lp))
            calls.append(found)
        if chat:
            body = chat_response(jobs[0].rid, state.model_id, choices, use, calls)
        else:
            body = completion_response(jobs[0].rid, state.model_id, choices, use)
        return JSONResponse(body, headers=headers)
    finally:
        task.cancel()
        for job in jobs:
            job.cancelled.set()  # a no-op once done; frees the slot if the handler was cancelled


def _error_kind(status: int) -> str:
    """OpenAI's error type for a status the engine thread ended a request with: a request the
    engine refused (a 4xx: its prompt, its sampling options) is the client's error."""
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(state: ServeState, jobs: list[Job], chat: bool, include_usage: bool,
                  structure: Structure) -> AsyncIterator[str]:
    """One SSE chunk per delivery turn of a choice: all the text that came since its last
    (delivery.py), with those tokens' logprobs when asked for. With tools, text that may be a
    tool call is held back (structured.ToolStream; the held tokens' logprobs go with the next
    text sent) and a call goes out as OpenAI's tool_calls deltas at the end."""
    rid, created, model = jobs[0].rid, int(time.time()), state.model_id
    obj = "chat.completion.chunk" if chat else "text_completion"
    token_text = _token_text(state)
    offsets = [TextOffsets() for _ in jobs]  # completions' text_offset: text sent
    tools = [ToolStream(structure.fmt, structure.names) for _ in jobs] if (
        chat and structure.fmt is not None) else None
    held: list[list[TokenLogprobs]] = [[] for _ in jobs]  # logprobs of text held back

    def logprobs(i: int, records: list[TokenLogprobs]) -> dict[str, Any] | None:
        if jobs[i].top_logprobs is None:
            return None
        if chat:
            return chat_logprobs(records, token_text, state.token_bytes)
        return completion_logprobs(records, token_text, state.token_bytes, offsets[i])

    def chunk(i: int, text: str | None, finish: str | None = None,
              records: list[TokenLogprobs] | None = None) -> dict[str, Any]:
        lp = logprobs(i, records) if records else None
        if chat:
            return chat_chunk(rid, model, created, {} if text is None else {"content": text},
                              finish, i, lp)
        return completion_chunk(rid, model, created, text or "", finish, i, lp)

    def sse(out: dict[str, Any]) -> str:
        # with include_usage every chunk has a usage field, null but in the last (OpenAI's)
        if include_usage and "choices" in out and "usage" not in out:
            out["usage"] = None
        return _sse(out)

    ended: dict[int, dict[str, int]] = {}
    try:
        if chat:
            for i in range(len(jobs)):
                yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                      index=i))
        async for i, event in _events(state, jobs):
            if event[0] == "delta":
                if tools is None:
                    yield sse(chunk(i, event[1], records=event[2]))
                    continue
                held[i] += event[2]
                text = tools[i].push(event[1])
                if text:
                    yield sse(chunk(i, text, records=held[i]))
                    held[i] = []
            elif event[0] == "error":
                yield sse(error_body(event[2], _error_kind(event[1])))
                break
            else:
                _, finish, u = event
                ended[i] = u
                if tools is not None:
                    rest, calls = tools[i].finish()
                    if rest or held[i]:
                        yield sse(chunk(i, rest, records=held[i]))
                        held[i] = []
                    for delta in call_deltas(calls):
                        yield sse(chat_chunk(rid, model, created, delta, index=i))
                    finish = "tool_calls" if calls else finish
                yield sse(chunk(i, None, finish))
        if include_usage and len(ended) == len(jobs):
            yield sse(usage_chunk(rid, model, created, obj,
                                   _total([ended[i] for i in range(len(jobs))])))
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
            job.cancelled.set()  # the client left (or we are done): free the slot at once


async def chat_completions(request: Request) -> Response:
    return await _submit(request, "chat")


async def completions(request: Request) -> Response:
    return await _submit(request, "completion")


def _model_card(state: ServeState) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": state.created,
            "owned_by": "fuselm",
            "fuselm": {"max_context": state.max_context,
                       "sampling_defaults": state.sampling.describe()}}


async def models(request: Request) -> Response:
    state: ServeState = request.app.state.serve
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model(request: Request) -> Response:
    """OpenAI's retrieve-a-model (GET /v1/models/{model}; the openai client's
    models.retrieve)."""
    state: ServeState = request.app.state.serve
    name = request.path_params["model"]
    if name != state.model_id:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                            f"{state.model_id!r}", param="model", code="model_not_found")
    return JSONResponse(_model_card(state))


async def health(request: Request) -> Response:
    state: ServeState = request.app.state.serve
    ok = state.scheduler.alive()
    lost = {"error": state.scheduler.lost} if state.scheduler.lost else {}
    # the batch decoder described now, not at start: its rows, free KV blocks and pipeline
    # slot counters move while the server runs (ints and lengths, read as kv_stats reads)
    decoder = state.scheduler.decoder
    engine = {**state.engine, **({"batch": decoder.describe()} if decoder is not None else {})}
    return JSONResponse({"status": "ok" if ok else "error", "model": state.model_id,
                         "engine": engine, **lost, **state.scheduler.stats()},
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
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    guard = Middleware(AccessGuard, rules=access or AccessRules.build("127.0.0.1"),
                       methods={r.path: r.methods or () for r in routes})
    app = Starlette(routes=routes, middleware=[guard], exception_handlers={
        ApiError: _api_error, HTTPException: _http_error, ClientDisconnect: _disconnect,
        Exception: _internal})
    app.state.serve = state
    return app
