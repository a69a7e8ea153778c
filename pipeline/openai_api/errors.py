"""The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations


class ApiError(Exception):
    """A request the endpoint answers with an OpenAI error body; the message is one line naming the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        # OpenAI's types: a client's mistake is an invalid_request_error, the server's own failure a server_error.
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str, message: str, code: str | None = None) -> ApiError:
    """400 for one field: the message starts with the field's name, as every error of this project does."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def error_body(status: int, message: str) -> dict:
    """The OpenAI error body of a refusal made outside the app (the front's guard, its 503s and 408s)."""
    return ApiError(status, message).body()
