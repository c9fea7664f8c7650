"""The gateway's refusals: an HTTP status, a reason (the metric's label) and a message."""

from __future__ import annotations

from gateway import metrics


class GatewayError(Exception):
    """A request the gateway refuses; counted under `reason` when raised."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        metrics.REJECTED.labels(reason).inc()

    @property
    def kind(self) -> str:
        """OpenAI's error `type` for this status."""
        if self.status == 401:
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        if self.status == 429:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.reason}}
