"""OpenAI request bodies (validated with pydantic) and the response / chunk / error objects
`fuselm serve` returns, in the shapes the official `openai` client parses."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingOptions,
    TokenLogprobs,
    parse_logit_bias,
)
from fuselm.runtime_metal.text_stream import REPLACEMENT

MAX_STOP = 4  # OpenAI's limit on stop sequences
# Choices per request at most: each is a batch row (and a place in the queue) of its own.
MAX_N = 16


# OpenAI parameters fuselm does not implement, with the values that ask for nothing (clients
# such as LangChain send n=1 or logprobs=false by default; parallel_tool_calls=true: a reply may
# make several calls, as every one is parsed): any other value is refused by name
# (HTTP 400), never accepted and ignored. None (JSON null) always asks for nothing.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "parallel_tool_calls": (True,), "functions": ([],), "function_call": ("none",),
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "verbosity": (), "prompt_cache_key": (),
    "safety_identifier": (),
    "store": (False,),  # store: true asks OpenAI to keep the completion for later retrieval
}
NOT_IMPLEMENTED_CHAT = NOT_IMPLEMENTED
NOT_IMPLEMENTED_COMPLETION = {**NOT_IMPLEMENTED, "best_of": (1,), "echo": (False,),
                              "suffix": ("",)}


# OpenAI checks a parameter's JSON type: "stream": "yes", "n": 2.0 or "temperature": "0.5" is
# a 400 naming the parameter, never read as true, 2 or 0.5 (strict=True; an integer is still a
# number). Every model of a request body below is strict.
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    """OpenAI's stream_options: the usage chunk; obfuscation padding is not implemented."""
    model_config = STRICT

    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("fuselm does not implement obfuscation padding; leave it out or "
                             "send false")
        return v


def not_implemented(data: dict[str, Any], chat: bool) -> str | None:
    """The first parameter of a request body that asks for something fuselm does not do."""
    table = NOT_IMPLEMENTED_CHAT if chat else NOT_IMPLEMENTED_COMPLETION
    for name, value in data.items():
        if name in table and value is not None and not any(
                value == ok and isinstance(value, bool) == isinstance(ok, bool)
                for ok in table[name]):
            return name
    return None


def without_no_ops(data: dict[str, Any], chat: bool) -> dict[str, Any]:
    """`data` without the NOT_IMPLEMENTED parameters (call after `not_implemented`)."""
    table = NOT_IMPLEMENTED_CHAT if chat else NOT_IMPLEMENTED_COMPLETION
    return {k: v for k, v in data.items() if k not in table}


class _Request(BaseModel):
    # Unknown fields are refused (extra="forbid"); the parameters in NOT_IMPLEMENTED are
    # checked before this model and, holding no-op values there, dropped here.
    model_config = STRICT

    model: str
    max_tokens: int | None = Field(None, ge=1)
    # None: the model's default (generation_config.json, else greedy; see ServeState).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Not OpenAI's, but vLLM's and llama.cpp's (the openai client sends them in extra_body).
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, lt=float("inf"))
    # OpenAI's (range -2..2); they count the reply's tokens (sampling.process_logits).
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # {"token id": -100..100}
    n: int = Field(1, ge=1, le=MAX_N)
    # OpenAI's: any 64-bit signed integer (taken modulo 2**63, the sampler's range)
    seed: int | None = Field(None, ge=-2**63, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Sent by clients for OpenAI's bookkeeping; nothing here to do with them.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # {"type": "text" | "json_object" | "json_schema", ...}: checked by structured.py
    response_format: dict[str, Any] | None = None

    @field_validator("n", "stream", "max_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        # OpenAI's optional parameters are nullable: null asks for the default (the model's:
        # a completion's max_tokens 16)
        return cls.model_fields[info.field_name or ""].default if v is None else v

    def sampling(self, defaults: SamplingOptions, choice: int = 0) -> SamplingOptions:
        """The request's sampling over the server's defaults, parameter by parameter. Choice i
        of n draws with seed + i: a seeded request with n > 1 is reproducible, its choices
        differ from one another."""
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return defaults.overridden(temperature=self.temperature, top_p=self.top_p,
                                   top_k=self.top_k, min_p=self.min_p,
                                   repetition_penalty=self.repetition_penalty,
                                   presence_penalty=self.presence_penalty,
                                   frequency_penalty=self.frequency_penalty,
                                   logit_bias=parse_logit_bias(self.logit_bias), seed=seed)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        try:
            SamplingOptions(logit_bias=parse_logit_bias(v) or ()).validate()
        except RuntimeUserError as e:
            raise ValueError(str(e).removeprefix("logit bias: ")) from None
        return v

    def alternatives(self) -> int | None:
        """Alternatives per token to report with its logprob; None: no logprobs at all."""
        raise NotImplementedError

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return [s for s in stops if s]

    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo
                             ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):  # OpenAI's rule: an error
            raise ValueError("only allowed with stream: true")
        return v

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# Message fields fuselm does not implement. A client that sends an earlier reply back (the
# openai client's message.model_dump()) sends them empty (null, [] or ""), which asks for
# nothing; with a value they are refused, never dropped.
MESSAGE_NOT_IMPLEMENTED = ("name", "refusal", "function_call", "audio", "annotations")


CONTENT_PART_FIELDS = {"type", "text"}  # a text part's; this model reads no other part


class Message(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None  # None: an assistant's tool calls only
    # An assistant's earlier calls (OpenAI's shape), and a tool message's answer to one.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_ops(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # a tool call's id belongs to a tool message, calls to an assistant's: elsewhere no
        # template reads them
        misplaced = {"tool_call_id": "tool", "tool_calls": "assistant"}
        for name in (*MESSAGE_NOT_IMPLEMENTED, *misplaced):
            given = data.get(name) not in (None, [], "")
            if given and (name not in misplaced or data.get("role") != misplaced[name]):
                raise PydanticCustomError(
                    "not_implemented", "{name}: fuselm does not implement this message field",
                    {"name": name})
        if data.get("role") == "tool" and data.get("tool_call_id") in (None, ""):
            raise PydanticCustomError(  # OpenAI's rule: the answer names the call it answers
                "missing_field", "a tool message needs the tool_call_id of the call it "
                "answers", {"name": "tool_call_id"})
        if data.get("content") in (None, []) and not (data.get("role") == "assistant"
                                                      and data.get("tool_calls")):
            raise PydanticCustomError(  # OpenAI's rule, where a template would write ""
                "missing_field", "a message needs its content, a text or at least one part "
                "(an assistant's may be null beside tool_calls)", {"name": "content"})
        return {k: v for k, v in data.items() if k not in MESSAGE_NOT_IMPLEMENTED}

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        # A text model: a part of another type (image_url, input_audio, file) is refused by its
        # type, a field a text part does not have by its name; neither is dropped.
        for i, part in enumerate(v if isinstance(v, list) else []):
            if not isinstance(part, dict):
                continue  # the list[dict] type says what is wrong
            if part.get("type") != "text":
                raise PydanticCustomError(
                    "content_part", "{at}: {kind} content parts are not supported; this model "
                    "reads text parts only", {"at": f"{i}.type",
                                              "kind": json.dumps(part.get("type"))})
            extra = next((k for k in part if k not in CONTENT_PART_FIELDS), None)
            if extra is not None:
                raise PydanticCustomError(
                    "content_part", "{at}: a text content part has no such field (it has "
                    "type and text)", {"at": f"{i}.{extra}"})
            if not isinstance(part.get("text"), str):
                raise PydanticCustomError("content_part", "{at}: a text part's text must be "
                                          "a string", {"at": f"{i}.text"})
        return v

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        # OpenAI's shape, which the chat templates read: a name to write, arguments as text
        # (JSON) or an object
        for i, call in enumerate(v or []):
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                    fn.get("arguments", "{}"), str | dict):
                raise ValueError(f'call {i} must be {{"id": ..., "type": "function", "function": '
                                 '{"name": ..., "arguments": "<JSON text>"}}')
        return v

    def text(self) -> str:
        """Plain text (a content-part list holds only text parts: _parts)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)  # checked by _parts


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):  # as OpenAI: an error, not ignored
            raise ValueError("needs logprobs: true")
        return v

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    # OpenAI function tools and the choice among them: checked by structured.py
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def token_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] = Field(
        description="text, token ids, or a list of one text")
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    # OpenAI allows 0..5 here; vLLM's 20 (the chat limit) is taken.
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def alternatives(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (n=1)")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v  # type: ignore[return-value]

    def token_limit(self) -> int | None:
        return self.max_tokens

    def token_limit_param(self) -> str:
        return "max_tokens"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


TokenText = Callable[[int], str]  # one token id's text
TokenBytes = Callable[[int], bytes | None]  # one token id's own bytes (None: not known)


def _text_and_bytes(token_text: TokenText, token_bytes: TokenBytes, token: int
                    ) -> tuple[str, bytes]:
    """A token's text as it decodes alone, and its bytes: that text's UTF-8, or for a token
    holding part of a UTF-8 character (decoding alone to U+FFFD) its own bytes."""
    text = token_text(token)
    raw = token_bytes(token) if REPLACEMENT in text else None
    return text, text.encode("utf-8") if raw is None else raw


def _entry(token_text: TokenText, token_bytes: TokenBytes, token: int, logprob: float
           ) -> dict[str, Any]:
    text, raw = _text_and_bytes(token_text, token_bytes, token)
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(records: Sequence[TokenLogprobs], token_text: TokenText,
                  token_bytes: TokenBytes) -> dict[str, Any]:
    """A chat choice's `logprobs`: content[{token, logprob, bytes, top_logprobs}] (a token's
    text as it decodes alone; its bytes that text's UTF-8, or, for a token holding part of a
    UTF-8 character (which decodes alone to U+FFFD), its own bytes, as OpenAI gives them: the
    tokens' bytes joined make the reply's text)."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return _entry(token_text, token_bytes, token, logprob)

    return {"content": [{**entry(r.token, r.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in records], "refusal": None}


class TextOffsets:
    """Where each token's text starts in a completion (characters), from the tokens' bytes:
    a token holding the rest of a character starts where that character does."""

    def __init__(self) -> None:
        self.chars = 0  # characters begun so far: UTF-8 bytes that are no continuation byte

    def add(self, raw: bytes) -> int:
        continues = bool(raw) and 0x80 <= raw[0] < 0xC0
        start = self.chars - continues if self.chars else 0
        self.chars += sum(1 for b in raw if not 0x80 <= b < 0xC0)
        return start


def _legacy_name(raw: bytes) -> str:
    # OpenAI's name for a token that is not whole UTF-8 text: its bytes, escaped
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(records: Sequence[TokenLogprobs], token_text: TokenText,
                        token_bytes: TokenBytes, offsets: TextOffsets) -> dict[str, Any]:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs ({token:
    logprob}, likeliest first) and text_offset (where each token's text starts in the reply;
    `offsets` holds the choice's tokens sent before). A token is named by its text; one holding
    part of a UTF-8 character by its bytes ("bytes:\\xe6\\x97", OpenAI's), so that two such
    alternatives keep two keys and the tokens' texts joined make the reply's text."""
    def name(token: int) -> tuple[str, bytes]:
        raw = _text_and_bytes(token_text, token_bytes, token)[1]
        return _legacy_name(raw), raw

    tokens, starts = [], []
    for r in records:
        text, raw = name(r.token)
        tokens.append(text)
        starts.append(offsets.add(raw))
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{name(t)[0]: lp for t, lp in r.top} for r in records],
            "text_offset": starts}


Choice = tuple[str | None, str, dict[str, Any] | None]  # text, finish_reason, logprobs


def chat_message(text: str | None, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_response(rid: str, model: str, choices: Sequence[Choice], use: dict[str, Any],
                  tool_calls: Sequence[list[dict[str, Any]] | None] | None = None
                  ) -> dict[str, Any]:
    """tool_calls: each choice's parsed calls (None: none), when the request had tools."""
    calls = list(tool_calls) if tool_calls is not None else [None] * len(choices)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": chat_message(text, calls[i]),
                         "logprobs": lp, "finish_reason": finish}
                        for i, (text, finish, lp) in enumerate(choices)],
            "usage": use}


def completion_response(rid: str, model: str, choices: Sequence[Choice], use: dict[str, Any]
                        ) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
                        for i, (text, finish, lp) in enumerate(choices)],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any],
               finish: str | None = None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]}


def completion_chunk(rid: str, model: str, created: int, text: str,
                     finish: str | None = None, index: int = 0,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict[str, Any]
                ) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}
