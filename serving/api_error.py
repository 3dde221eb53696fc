"""ApiError: the one error type of the OpenAI-compatible surface, with its JSON body and HTTP status.

Owns the error object's shape ({"error": {"message", "type", "code", "param"}}) and rebuilding one from a
worker's answer. Sits below protocol.py and validate.py (both raise it; protocol re-exports it), so neither
imports the other for it. Never decides a status itself: the raiser names it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ApiError"]


class ApiError(Exception):
    """An error returned to the client as {"error": {"message", "type", "code", "param"}} with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after = retry_after  # seconds; sent as Retry-After (429/503 of a busy or empty pool)

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(max(1, round(self.retry_after)))}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    @classmethod
    def from_body(cls, status: int, body: Any, prefix: str = "") -> "ApiError":
        """Rebuild an error a worker returned (anything else becomes a server_error naming what came)."""
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return cls(status, prefix + err["message"], str(err.get("type") or "server_error"),
                       err.get("code") if isinstance(err.get("code"), str) else None,
                       err.get("param") if isinstance(err.get("param"), str) else None)
        return cls(502 if status < 400 else status,
                   f"{prefix}unexpected answer (HTTP {status}): {body!r:.300}", "server_error",
                   "bad_worker_response")
