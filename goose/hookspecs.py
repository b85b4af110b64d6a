"""Every hook Goose defines; plugins implement them with ``@goose.hookimpl`` (docs/hooks.md). Registration hooks
get ``register(cls, name=None, aliases=(), defaults=None, description=None, deprecated=())``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("goose")
hookimpl = pluggy.HookimplMarker("goose")


@hookspec
def goose_register_sources(register: Callable[..., None]) -> None:
    """Register draft sources (subclasses of :class:`goose.DraftSource`) with ``register``."""


@hookspec
def goose_register_policies(register: Callable[..., None]) -> None:
    """Register tree policies (subclasses of :class:`goose.TreePolicy`); ``defaults`` makes a preset (``iso3``
    is the isotropic policy with ``{"k": 3}``)."""


@hookspec
def goose_register_verifiers(register: Callable[..., None]) -> None:
    """Register verifiers (subclasses of :class:`goose.Verifier`) with ``register``."""


@hookspec
def goose_on_generation_start(decoder: Any, request: Any) -> None:
    """Called at the start of each ``generate`` call, after the prompt is validated."""


@hookspec
def goose_on_step(decoder: Any, step: Any) -> None:
    """Called after every verification step with a :class:`goose.StepRecord`."""


@hookspec
def goose_on_generation_end(decoder: Any, output: Any) -> None:
    """Called at the end of each ``generate`` call with the :class:`goose.GenerationOutput`."""
