"""Who may talk to `fuselm serve`, checked before any handler runs (a pure ASGI middleware, so
streamed responses pass through untouched).

A web page the user happens to visit must not be able to drive a server on their machine:
- Host: a DNS-rebinding page reaches 127.0.0.1 under its own name, so the Host header must name
  this server (loopback names, the bound address, or --allowed-host); others get 421.
- Origin: a browser names the page's origin on every cross-origin fetch (and on the "simple"
  text/plain POST that needs no preflight). Only origins given with --cors-origin are answered
  (with Access-Control-Allow-Origin and correct preflights); any other gets 403 before its body
  is read, so it never generates. Clients that are not browsers send no Origin.
- API key: with --api-key every path but /health needs `Authorization: Bearer KEY` (401).
A preflight carries no credentials by the CORS rules, so it is answered before the key check.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fuselm.converter.errors import UserError
from fuselm.converter.serve.schema import error_body

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"
OPEN_PATHS = ("/health",)  # liveness probes need no key; it tells the model id and engine
PREFLIGHT_MAX_AGE = 600  # seconds a browser may cache a preflight answer


def _split_host(value: str) -> tuple[str, str] | None:
    """'Name[:port]' or '[v6][:port]' -> (lower-case name without brackets, port or '');
    None when it is not of that form."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:]
    elif value.count(":") > 1:  # a bare IPv6 address (no port possible)
        name, port = value, ""
    else:
        name, _, port = value.partition(":")
    name = name.removesuffix(".")  # "localhost." names the same host
    if not name or (port and not port.isdigit()):
        return None
    return name, port


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    addrs = {info[4][0].split("%")[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def check_bind(host: str, api_key: str | None, insecure_no_auth: bool) -> None:
    """Refuse to listen beyond this machine without an API key (unless asked to, by name)."""
    if api_key or insecure_no_auth or is_loopback(host):
        return
    raise UserError(f"--host {host} listens beyond this machine, where anyone who reaches "
                    "the port can use the model; give --api-key KEY (or FUSELM_API_KEY), or "
                    "--insecure-no-auth to serve without one")


def normalize_origin(value: str) -> str:
    """An --cors-origin value as a browser writes Origin ('scheme://host[:port]'), or '*'."""
    if value == ANY_HOST:
        return value
    try:
        parts = urlsplit(value.strip())
        parts.port  # noqa: B018 - parsed for its check of the port
    except ValueError:  # e.g. "http://[::1" (an unclosed IPv6 bracket)
        parts = urlsplit("")
    if (parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/")
            or parts.query or parts.fragment or "@" in parts.netloc
            or _split_host(parts.netloc) is None):
        raise UserError(f"--cors-origin {value!r} is not an origin; give scheme://host[:port] "
                        "(e.g. http://localhost:3000) or '*'")
    return f"{parts.scheme}://{parts.netloc.lower()}"


@dataclass(frozen=True)
class AccessRules:
    """What the middleware enforces; built once from the command line."""

    allowed_hosts: frozenset[tuple[str, str]] = field(default_factory=frozenset)
    cors_origins: frozenset[str] = field(default_factory=frozenset)
    api_key: str | None = None

    @classmethod
    def build(cls, bound_host: str, allowed_hosts: Iterable[str] = (),
              cors_origins: Iterable[str] = (), api_key: str | None = None) -> AccessRules:
        """Loopback names and the bound host (any port: an ssh tunnel or a port map may
        change it) plus --allowed-host entries ('name' for any port, 'name:port', or '*')."""
        hosts = {(name, "") for name in LOOPBACK_NAMES}
        bound = _split_host(bound_host)
        if bound is not None and bound[0] not in ("0.0.0.0", "::"):
            hosts.add((bound[0], ""))
        for value in allowed_hosts:
            entry = (ANY_HOST, "") if value.strip() == ANY_HOST else _split_host(value)
            if entry is None:
                raise UserError(f"--allowed-host {value!r} is not a host name; give NAME, "
                                "NAME:PORT, an IP address, or '*'")
            hosts.add(entry)
        if api_key is not None and not api_key.strip():
            raise UserError("--api-key is empty; give a key, or leave the option out")
        return cls(frozenset(hosts), frozenset(normalize_origin(o) for o in cors_origins),
                   api_key)

    def host_allowed(self, host: str | None) -> bool:
        if (ANY_HOST, "") in self.allowed_hosts:
            return True
        parsed = None if host is None else _split_host(host)
        if parsed is None:
            return False
        name, port = parsed
        return (name, "") in self.allowed_hosts or (bool(port) and parsed in self.allowed_hosts)

    def origin_allowed(self, origin: str) -> bool:
        return ANY_HOST in self.cors_origins or origin.lower() in self.cors_origins

    def key_matches(self, authorization: bytes | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or b"").partition(b" ")
        # Constant time over the token, so its bytes cannot be guessed one by one.
        return hmac.compare_digest(token.strip(), self.api_key.encode()) and \
            scheme.lower() == b"bearer"


def _refusal(status: int, message: str, code: str, kind: str = "invalid_request_error",
             headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse(error_body(message, kind, code=code), status_code=status,
                        headers=dict(headers or {}))


class AccessGuard:
    """The ASGI middleware: Host, then Origin (and preflights), then the API key."""

    def __init__(self, app: ASGIApp, rules: AccessRules, methods: Mapping[str, Iterable[str]]
                 ) -> None:
        self.app, self.rules = app, rules
        # Each path's methods, for the Allow header of a plain OPTIONS request; a route that
        # ends in a path parameter ("/v1/models/{model:path}") stands for every path under it.
        self.methods = {path: sorted({*m, "OPTIONS"}) for path, m in methods.items()}
        self.prefixes = {path.split("{", 1)[0]: allow for path, allow in self.methods.items()
                         if path.endswith(":path}")}

    def allowed(self, path: str) -> list[str] | None:
        """The methods of the route `path` is, None where it is none."""
        if path in self.methods:
            return self.methods[path]
        return next((allow for prefix, allow in self.prefixes.items()
                     if path.startswith(prefix) and len(path) > len(prefix)), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal, cors = self._check(scope, headers)
        if refusal is not None:
            if cors:
                refusal.headers.update(cors)
            await refusal(scope, receive, send)
            return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *(
                    (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in cors.items())]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _check(self, scope: Scope, headers: Headers) -> tuple[Response | None, dict[str, str]]:
        """(a refusal or an answer, or None to pass on; CORS headers for the response)."""
        method, path, host = scope["method"], scope["path"], headers.get("host")
        if not self.rules.host_allowed(host):
            return _refusal(421, f"this server does not answer to the Host {host!r} (a page "
                                 "reaching it under another name, e.g. by DNS rebinding, is "
                                 "refused); start it with --allowed-host NAME to add a name",
                            "host_not_allowed"), {}
        origin = headers.get("origin")
        # Compared as text: an Origin is untrusted and need not parse as a URL.
        cross = origin is not None and origin.partition("://")[2].lower() != (host or "").lower()
        preflight = method == "OPTIONS" and "access-control-request-method" in headers
        cors: dict[str, str] = {}
        if cross:
            assert origin is not None
            if not self.rules.origin_allowed(origin):
                what = "preflight" if preflight else "request"
                return _refusal(403, f"cross-origin {what} from {origin!r} refused: this server "
                                     "answers no other origin unless started with "
                                     "--cors-origin ORIGIN", "origin_not_allowed"), {}
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if method == "OPTIONS" and (methods := self.allowed(path)) is not None:
            allow = ", ".join(methods)
            if preflight and cross:
                requested = headers.get("access-control-request-headers", "")
                cors.update({"Access-Control-Allow-Methods": allow,
                             "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE)})
                if requested:  # the origin is trusted by name: any header it asks for
                    cors["Access-Control-Allow-Headers"] = requested
            return Response(status_code=204, headers={"Allow": allow}), cors
        if path not in OPEN_PATHS and not self.rules.key_matches(
                dict(scope["headers"]).get(b"authorization")):
            return _refusal(401, "a missing or wrong API key: send the header "
                                 "`Authorization: Bearer KEY` with the server's --api-key",
                            "invalid_api_key", headers={"WWW-Authenticate": "Bearer"}), cors
        return None, cors
