"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

``APIError`` is raised anywhere in a handler; ``error_middleware`` turns it, aiohttp's own HTTP
exceptions (404 route, 405 method, 413 body) and any unexpected exception (500, logged) into that
JSON body, so every error a client sees has the same shape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger("pagedserve.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answer. ``type`` defaults from the status (OpenAI's names)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        fallback = "server_error" if status >= 500 else "invalid_request_error"
        self.type = type or _TYPES.get(status, fallback)

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return web.json_response(self.body(), status=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        return err.response()
    except web.HTTPRequestEntityTooLarge as err:
        message = err.text or "request body too large"
        return APIError(413, message, code="request_too_large").response()
    except web.HTTPException as err:
        if err.status < 400:
            raise
        message = f"{err.reason}: {request.method} {request.path}"
        return APIError(err.status, message, code=err.reason.lower().replace(" ", "_")).response()
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return APIError(500, "internal server error", code="internal_error").response()
