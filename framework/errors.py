"""Error types shared by the whole project.

A user error is a `ValueError` subclass whose message names the parameter and what is
allowed; the server maps it to HTTP 400 in OpenAI's error shape.
"""

from __future__ import annotations


class PortaserveError(Exception):
    """Base class for portaserve's own errors."""


class InvalidParameterError(PortaserveError, ValueError):
    """A user-supplied value is out of range. `param` names it, for the HTTP error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        # picklable with both arguments: errors cross from the engine process to the server
        return (type(self), (self.param, str(self)))


class UnsupportedError(PortaserveError, ValueError):
    """A valid request that the chosen platform or model cannot serve (plan-time errors)."""


class PlatformUnavailableError(PortaserveError, RuntimeError):
    """A forced `--device` is not usable on this machine; the message says why."""


class PluginError(PortaserveError, RuntimeError):
    """A plugin failed to load or misbehaved, raised under `--strict-plugins`."""


class RequestFailedError(PortaserveError, RuntimeError):
    """One request failed inside the engine (the engine and the other requests go on)."""


class EngineDeadError(PortaserveError, RuntimeError):
    """The engine process (or a worker) died; in-flight requests fail with this."""


def invalid(param: str, message: str) -> InvalidParameterError:
    """Shorthand for building an `InvalidParameterError` whose message starts with the name."""
    return InvalidParameterError(param, f"{param}: {message}")
