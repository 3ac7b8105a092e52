"""The server's errors, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.

Statuses: 400 a request that breaks a rule (its message is the rule's, naming the value and the fix), 401 no key or a
wrong key, 404 no such video, 409 the video is not in a state that allows it (content before completion), 413 a body
or upload over its cap, 429 the queue is full, 503 the model is not loaded (yet, or it failed to load).
"""
from __future__ import annotations

import re

from fastwan.errors import InvalidArgumentType, UserError, one_line

CLI_REMARK = r"\s*\(CLI:? --[a-z0-9-]+(?: [A-Z]+)?\)"  # a message's note for command-line users, not for HTTP
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
         503: "server_error"}


class ApiError(Exception):
    """An answer other than success: ``status`` and the body :meth:`body` writes."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def from_user_error(exc: UserError, param: str | None = None) -> ApiError:
    """A fastwan user error raised while checking a request as a 400; ``param``: the field it is about, else the
    error's own ``field`` (set by the check that raised it; None, as OpenAI's API answers, when no one field is
    at fault). The message is never read for a field name."""
    message = re.sub(CLI_REMARK, "", one_line(exc))
    code = "invalid_type" if isinstance(exc, InvalidArgumentType) else "invalid_value"
    return ApiError(400, message, code=code, param=exc.field if param is None else param)
