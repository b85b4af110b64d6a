"""Every error Goose raises on purpose; catch :class:`GooseError` for all of them.

Each message says what failed, the offending value, what is allowed, and a hint.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GooseError(Exception):
    """Base class of all errors raised by Goose on purpose."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``choices``, or ""."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


class UnknownComponentError(GooseError, KeyError):
    """A draft source, tree policy or verifier name that nobody registered."""

    def __init__(self, kind: str, name: str, available: Iterable[str], left_out: dict | None = None):
        self.kind, self.name = kind, name
        self.available = sorted(available)
        msg = f"Unknown {kind} {name!r}. Available: {', '.join(self.available) or '(none)'}."
        msg += (did_you_mean(name, self.available)
                or " Run `goose plugins` to list what is registered and where it came from.")
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


class ComponentError(GooseError):
    """A component raised in one of its methods, or returned what its interface does not allow. ``component``
    is its registered name, ``hook`` the method (None where the fault is not one call's); the component's own
    exception, if any, is chained as ``__cause__``. The subclasses name the role."""

    role = "Component"

    def __init__(self, component: str, message: str, hook: str | None = None):
        self.component, self.hook = component, hook
        super().__init__(message)

    @classmethod
    def raised(cls, component: str, hook: str, exc: BaseException, hint: str = "") -> ComponentError:
        """The error for ``exc`` raised inside ``component.hook()``, with ``exc`` chained (``hint``: what to do)."""
        err = cls(component, cls._raised_text(component, hook, exc) + (f". Hint: {hint}" if hint else ""), hook)
        err.__cause__ = exc
        return err

    @classmethod
    def _raised_text(cls, component: str, hook: str, exc: BaseException) -> str:
        return f"{cls.role} {component!r} raised in {hook}(): {type(exc).__name__}: {exc}"


class DraftSourceError(ComponentError):
    """A draft source raised, or returned something that is not a valid proposal."""

    role = "Draft source"

    def __init__(self, source: str, message: str, hook: str | None = None):
        self.source = source
        super().__init__(source, f"Draft source {source!r} failed: {message}", hook)

    @classmethod
    def _raised_text(cls, component: str, hook: str, exc: BaseException) -> str:
        return f"{hook}() raised {type(exc).__name__}: {exc}"  # __init__ names the source


class TreePolicyError(ComponentError, PluginError):
    """A tree policy raised, or returned a tree the loop cannot verify (not a tree, over its limit, ...)."""

    role = "Tree policy"


class VerifierError(ComponentError, PluginError):
    """A verifier raised, or returned a pass the loop cannot read (logit rows that do not match its tokens)."""

    role = "Verifier"


class DecoderBusyError(GooseError, RuntimeError):
    """A concurrent ``generate`` on a decoder whose components cannot be copied per call."""


class UnsupportedModelError(GooseError):
    """The model (or its attention implementation) cannot be served by tree verification."""


_ROLE_ERRORS = {"source": DraftSourceError, "policy": TreePolicyError, "verifier": VerifierError}


def call_component(role: str, component, hook: str, *args, **kwargs):
    """``component.<hook>(*args, **kwargs)`` (``role``: "source", "policy" or "verifier"): a :class:`GooseError`
    goes through as raised; any other exception comes back as the role's :class:`ComponentError` naming the
    component and the hook, the exception chained."""
    try:
        return getattr(component, hook)(*args, **kwargs)
    except GooseError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the component's name and the hook
        raise _ROLE_ERRORS[role].raised(getattr(component, "name", "") or type(component).__name__, hook, exc) from exc
