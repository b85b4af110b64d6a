"""Every error Goose raises on purpose.

Each message says what failed, the offending value, what is allowed, and a hint.
Catch :class:`GooseError` to handle all of them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GooseError(Exception):
    """Base class of all errors raised by Goose on purpose."""


class UnknownComponentError(GooseError, KeyError):
    """A draft source, tree policy or verifier name that nobody registered."""

    def __init__(self, kind: str, name: str, available: Iterable[str], left_out: dict | None = None):
        self.kind, self.name = kind, name
        self.available = sorted(available)
        msg = f"Unknown {kind} {name!r}. Available: {', '.join(self.available) or '(none)'}."
        close = difflib.get_close_matches(name, self.available, n=1, cutoff=0.5)
        if close:
            msg += f" Did you mean {close[0]!r}?"
        else:
            msg += " Run `goose plugins` to list what is registered and where it came from."
        if left_out:
            msg += " Plugins left out (one of them may provide it): " + "; ".join(
                f"{p}: {why}" for p, why in sorted(left_out.items()))
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class PluginError(GooseError):
    """A plugin is malformed: bad registration, duplicate name, or it raised while loading."""


class InvalidTreeError(GooseError, ValueError):
    """A draft tree violates the tree invariants (node index and value in the message)."""


class InvalidInputError(GooseError, ValueError):
    """A prompt, option or argument to ``generate`` that cannot be served."""


class DraftSourceError(GooseError):
    """A draft source raised, or returned something that is not a valid proposal."""

    def __init__(self, source: str, message: str):
        self.source = source
        super().__init__(f"Draft source {source!r} failed: {message}")


class DecoderBusyError(GooseError, RuntimeError):
    """A concurrent ``generate`` on a decoder whose components cannot be copied per call."""


class UnsupportedModelError(GooseError):
    """The model (or its attention implementation) cannot be served by tree verification."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""
