"""The server's one error type: a status and an OpenAI-shaped JSON error body."""

from __future__ import annotations

from starlette.responses import JSONResponse

from fuselm.converter.serve.schema import error_body


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.kind, self.param, self.code),
                            status_code=self.status)
