"""What the router refuses, as exceptions serving maps to HTTP statuses (each crosses Ray intact)."""

from __future__ import annotations


class _NotFound(KeyError, ValueError):
    """A failed lookup caused by a request (so also a ValueError); prints its message unquoted."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownClientError(_NotFound):
    """A client id this tenant never started (or that expired / was finished)."""


class UnknownWorkflowError(_NotFound):
    """A workflow template this tenant never registered."""


class TenantLimitError(ValueError):
    """A tenant asked for more than its limits allow (`TenantLimits`); `limit` names the field."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{message} (limits.{limit})")
        self.limit, self.detail = limit, message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses Ray intact
        return type(self), (self.limit, self.detail)


class NoReplicaError(RuntimeError):
    """No engine replica is registered (starting up, or all lost): the caller should retry later."""
