"""The exceptions mappa_graph raises on purpose, in one place, so a user can catch them without knowing which
subpackage raised them (and so `judging` need not import `serving` to name another part's error)."""

from __future__ import annotations


class JudgeError(RuntimeError):
    """Raised only when asked (`strict=True`); by default a failed verdict becomes an unscored Reward."""


class ReplyError(ValueError):
    """A judge reply that cannot be used; `kind` names the failure (it keys `JudgeStats.unscored`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UnknownAgentError(KeyError):
    """An agent name the team does not have; the message lists the agents it does have."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class BaseMismatchError(ValueError):
    """The base model loaded is not the one the adapters were trained on."""


class VLLMError(RuntimeError):
    """The server refused or failed a request (the message carries its answer)."""
