"""Every hook Goose defines. Plugins implement them with ``@goose.hookimpl``.

Registration hooks run once, when :func:`goose.compose` (or ``goose plugins``) first needs the
registry. Observer hooks run once per generation and once per verification step, never per node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("goose")
hookimpl = pluggy.HookimplMarker("goose")


@hookspec
def goose_register_sources(register: Callable[..., None]) -> None:
    """Register draft sources: call ``register(cls, name=None, aliases=(), defaults=None, description=None)``.

    ``cls`` must subclass :class:`goose.DraftSource`. Called once per plugin when the registry is
    built. A name already taken by another plugin is refused with an error naming both.
    """


@hookspec
def goose_register_policies(register: Callable[..., None]) -> None:
    """Register tree policies: ``register(cls, name=None, aliases=(), defaults=None, description=None)``.

    ``cls`` must subclass :class:`goose.TreePolicy`; ``defaults`` makes a preset (e.g. ``iso3``
    is the isotropic policy with ``{"k": 3}``). Called once per plugin when the registry is built.
    """


@hookspec
def goose_register_verifiers(register: Callable[..., None]) -> None:
    """Register verifiers: ``register(cls, name=None, aliases=(), defaults=None, description=None)``.

    ``cls`` must subclass :class:`goose.Verifier`. Called once per plugin when the registry is built.
    """


@hookspec
def goose_on_generation_start(decoder: Any, request: Any) -> None:
    """Called once at the start of each ``generate`` call, after the prompt is validated."""


@hookspec
def goose_on_step(decoder: Any, step: Any) -> None:
    """Called after every verification step with a :class:`goose.StepRecord` (not per node)."""


@hookspec
def goose_on_generation_end(decoder: Any, output: Any) -> None:
    """Called once at the end of each ``generate`` call with the :class:`goose.GenerationOutput`."""
