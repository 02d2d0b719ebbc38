"""OpenAI request bodies (validated with pydantic) and the response / chunk / error objects
`fuselm serve` returns, in the shapes the official `openai` client parses."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from fuselm.runtime_metal.sampling import SamplingOptions

MAX_STOP = 4  # OpenAI's limit on stop sequences


# OpenAI parameters fuselm does not implement, with the values that ask for nothing (clients
# such as LangChain send n=1 or logprobs=false by default): any other value is refused by name
# (HTTP 400), never accepted and ignored. None (JSON null) always asks for nothing.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "parallel_tool_calls": (), "functions": ([],), "function_call": ("none",),
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "verbosity": (), "prompt_cache_key": (),
    "safety_identifier": (),
}
NOT_IMPLEMENTED_CHAT = {**NOT_IMPLEMENTED, "logprobs": (False,), "top_logprobs": (0,)}
NOT_IMPLEMENTED_COMPLETION = {**NOT_IMPLEMENTED, "logprobs": (), "best_of": (1,),
                              "echo": (False,), "suffix": ("",)}


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
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    # None: the model's default (generation_config.json, else greedy; see ServeState).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Not OpenAI's, but vLLM's and llama.cpp's (the openai client sends them in extra_body).
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, lt=float("inf"))
    seed: int | None = Field(None, ge=0, lt=2**63)  # the sampler's range
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # Sent by clients for OpenAI's bookkeeping; nothing here to do with them.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # {"type": "text" | "json_object" | "json_schema", ...}: checked by structured.py
    response_format: dict[str, Any] | None = None

    def sampling(self, defaults: SamplingOptions) -> SamplingOptions:
        """The request's sampling over the server's defaults, parameter by parameter."""
        return defaults.overridden(temperature=self.temperature, top_p=self.top_p,
                                   top_k=self.top_k, min_p=self.min_p,
                                   repetition_penalty=self.repetition_penalty, seed=self.seed)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return [s for s in stops if s]

    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


# Message fields fuselm does not implement. A client that sends an earlier reply back (the
# openai client's message.model_dump()) sends them empty (null, [] or ""), which asks for
# nothing; with a value they are refused, never dropped.
MESSAGE_NOT_IMPLEMENTED = ("name", "refusal", "function_call", "audio", "annotations")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

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
        return {k: v for k, v in data.items() if k not in MESSAGE_NOT_IMPLEMENTED}

    def text(self) -> str:
        """Plain text; a content-part list may only hold text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            out.append(part["text"])
        return "".join(out)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # OpenAI function tools and the choice among them: checked by structured.py
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] = Field(
        description="text, token ids, or a list of one text")
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

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


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_response(rid: str, model: str, text: str | None, finish: str, use: dict[str, Any],
                  tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": None, "finish_reason": finish}],
            "usage": use}


def completion_response(rid: str, model: str, text: str, finish: str, use: dict[str, Any]
                        ) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any],
               finish: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}]}


def completion_chunk(rid: str, model: str, created: int, text: str,
                     finish: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict[str, Any]
                ) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}
