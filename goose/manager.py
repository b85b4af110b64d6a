"""The plugin manager and the component registry. Built-in components (``DEFAULT_PLUGINS``) register through the
same hooks as installed plugins; a broken installed plugin is left out whole with a :class:`PluginWarning`, one
registered at run time fails whole with a ``PluginError`` (docs/hooks.md)."""

from __future__ import annotations

import importlib
import inspect
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata

import pluggy
from pydantic import ValidationError

from goose import hookspecs
from goose.errors import (_ROLE_ERRORS, ComponentError, GooseError, InvalidInputError, PluginError,
                          UnknownComponentError)
from goose.interfaces import DraftSource, Options, TreePolicy, Verifier

ENTRY_POINT_GROUP = "goose"
ENV_DISABLE = "GOOSE_DISABLE_PLUGIN_AUTOLOAD"
ENV_ALLOW = "GOOSE_PLUGINS"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "goose.plugins.pld", "goose.plugins.tr", "goose.plugins.suffix",
    "goose.policies.chain", "goose.policies.isotropic", "goose.policies.spine", "goose.policies.fit",
    "goose.verifiers.transformers_tree",
)

KINDS = {"source": DraftSource, "policy": TreePolicy, "verifier": Verifier}
_HOOKS = {"source": "goose_register_sources", "policy": "goose_register_policies",
          "verifier": "goose_register_verifiers"}
_KIND_WORDS = {"source": "draft source", "policy": "tree policy", "verifier": "verifier"}


@dataclass(frozen=True)
class Entry:
    """One registered name: its component class, who registered it, and the preset defaults of its options."""

    kind: str
    name: str
    cls: type
    provider: str  # plugin name that registered it
    origin: str  # "builtin" or the distribution that provides the entry point
    defaults: dict = field(default_factory=dict)
    description: str = ""
    alias_of: str | None = None
    deprecated: bool = False  # an old name: building by it warns (DeprecationWarning) and builds alias_of

    def options(self, overrides: dict | None = None) -> Options:
        return self.cls.Options(**{**self.defaults, **(overrides or {})})


class Registry:
    """Names -> components, per kind. Built once from the hooks, never changed once published; read by ``compose``."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}

    def add(self, entry: Entry) -> None:
        table = self.entries[entry.kind]
        if entry.name in table:
            prev = table[entry.name]
            raise PluginError(
                f"Duplicate {_KIND_WORDS[entry.kind]} name {entry.name!r}: registered by plugin {prev.provider!r} "
                f"({prev.origin}) and again by plugin {entry.provider!r} ({entry.origin}). "
                "Rename one of them, or disable one plugin with GOOSE_PLUGINS=<allow-list>.")
        table[entry.name] = entry

    def get(self, kind: str, name: str) -> Entry:
        table = self.entries[kind]
        if not isinstance(name, str):
            raise TypeError(f"{kind} name must be a str, got {type(name).__name__}")
        if name not in table:
            raise UnknownComponentError(_KIND_WORDS[kind], name, table, _broken)
        return table[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])


class PluginWarning(UserWarning):
    """An installed plugin was left out (it failed to load or registered something malformed)."""


_pm: pluggy.PluginManager | None = None
_registry: Registry | None = None
_origins: dict[str, str] = {}
_broken: dict[str, str] = {}  # plugin name -> why it was left out
# Building, changing and resetting the registry take this lock (two threads composing their first decoders at
# once build it once); reading a published registry does not.
_lock = threading.RLock()


_HOOK_NAMES = tuple(sorted(n for n in dir(hookspecs) if n.startswith("goose_")))
_KNOWN_HOOKS = ", ".join(_HOOK_NAMES)


def plugin_origins() -> dict[str, str]:
    """Each loaded plugin's origin: "builtin", the entry point and its distribution, or "registered at run time"."""
    get_registry()
    return dict(_origins)


def broken_plugins() -> dict[str, str]:
    """Installed plugins that were left out, and why (empty when every plugin loaded)."""
    get_registry()
    return dict(_broken)


def _leave_out(name: str, why: str) -> None:
    _broken[name] = why
    warnings.warn(f"Goose left plugin {name!r} out: {why}", PluginWarning, stacklevel=3)


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use (never at import time)."""
    global _pm
    if _pm is not None:
        return _pm
    with _lock:
        if _pm is None:
            _pm = _new_plugin_manager()
        return _pm


def _new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("goose")
    pm.add_hookspecs(hookspecs)
    for modname in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(modname), name=modname)
        _origins[modname] = "builtin"
    if os.environ.get(ENV_DISABLE, "").strip().lower() not in ("1", "true", "yes"):
        _load_entry_points(pm)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"Plugin {exc.plugin_name!r} implements a hook Goose does not define: {exc}. "
                          f"Known hooks: {_KNOWN_HOOKS}.") from exc
    return pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    allow = os.environ.get(ENV_ALLOW)
    allowed = None if not allow else {a.strip() for a in allow.split(",") if a.strip()}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if (allowed is not None and ep.name not in allowed) or pm.get_plugin(ep.name) is not None:
            continue
        dist = ep.dist.name if ep.dist is not None else "?"
        where = f"entry point {ep.value!r} from distribution {dist!r}"
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001
            _leave_out(ep.name, f"{where} failed to load: {type(exc).__name__}: {exc}. "
                       f"Fix or uninstall it, or set {ENV_DISABLE}=1.")
            continue
        unmarked = _unmarked_hooks(pm, plugin)
        if unmarked:
            _leave_out(ep.name, f"{where}: " + _unmarked_message(ep.name, unmarked))
            continue
        try:
            pm.register(plugin, name=ep.name)
            pm.check_pending()
        except (pluggy.PluginValidationError, ValueError) as exc:
            if pm.get_plugin(ep.name) is not None:
                pm.unregister(name=ep.name)
            _leave_out(ep.name, f"{where} is malformed: {exc}. Known hooks: {_KNOWN_HOOKS}.")
            continue
        _origins[ep.name] = f"entry point {ep.value} ({dist})"


def _unmarked_hooks(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """The plugin's ``goose_*`` callables that lack ``@goose.hookimpl``: pluggy would pass over them in silence."""
    out = []
    for attr in sorted(dir(plugin)):
        if not attr.startswith("goose_"):
            continue
        try:
            value = getattr(plugin, attr)
        except Exception:  # noqa: BLE001 - a property that raises is not a hook
            continue
        if callable(value) and pm.parse_hookimpl_opts(plugin, attr) is None:
            out.append(attr)
    return out


def _unmarked_message(pname: str, unmarked: list[str]) -> str:
    what = ", ".join(f"{m}()" + ("" if m in _HOOK_NAMES else " (not a Goose hook either)") for m in unmarked)
    return (f"Plugin {pname!r} defines {what} without @goose.hookimpl, so pluggy would never call "
            f"{'it' if len(unmarked) == 1 else 'them'}. Hint: decorate each hook with @goose.hookimpl (known hooks: "
            f"{_KNOWN_HOOKS}), or rename a helper so that it does not start with 'goose_'.")


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin (a module or instance with ``@goose.hookimpl`` functions) and its components now, or
    raise a ``PluginError`` saying why, with nothing of it registered."""
    global _registry
    with _lock:
        pm = get_plugin_manager()
        before, broken_before = get_registry(), dict(_broken)
        if name is not None and pm.get_plugin(name) is not None:
            raise PluginError(f"A plugin named {name!r} is registered already ({_origins.get(name, '?')}). "
                              f"Hint: goose.unregister_plugin({name!r}) first, or pick another name.")
        unmarked = _unmarked_hooks(pm, plugin)
        if unmarked:
            raise PluginError(_unmarked_message(name or pm.get_canonical_name(plugin), unmarked))
        try:
            pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:  # pluggy leaves nothing registered here
            raise PluginError(f"Plugin {name or plugin!r} is malformed: {exc}") from exc
        except ValueError as exc:
            raise PluginError(f"Plugin {name or plugin!r} cannot be registered: {exc}") from exc
        pname = pm.get_name(plugin)
        try:
            try:
                pm.check_pending()
            except pluggy.PluginValidationError as exc:
                raise PluginError(f"Plugin {pname!r} is malformed: {exc}. Known hooks: {_KNOWN_HOOKS}.") from exc
            _origins[pname] = "registered at run time"
            _registry = _build_registry(pm, strict_for=pname)
        except BaseException:
            if pm.get_plugin(pname) is not None:
                pm.unregister(name=pname)
            _origins.pop(pname, None)
            _registry = before
            _broken.clear()
            _broken.update(broken_before)
            raise


def unregister_plugin(name: str) -> None:
    """Remove a plugin (registered at run time or loaded from an entry point) and its components; a name that
    is not registered is a ``PluginError`` naming the registered ones."""
    global _registry
    with _lock:
        pm = get_plugin_manager()
        if pm.get_plugin(name) is None:
            names = sorted(n for n, _ in pm.list_name_plugin())
            raise PluginError(f"No plugin named {name!r} is registered. Registered: {', '.join(names)}")
        pm.unregister(name=name)
        _origins.pop(name, None)
        _registry = None


def get_registry() -> Registry:
    """The component registry, built from the registration hooks on first use."""
    global _registry
    reg = _registry
    if reg is not None:
        return reg
    with _lock:
        if _registry is None:
            _registry = _build_registry(get_plugin_manager())
        return _registry


def _build_registry(pm: pluggy.PluginManager, strict_for: str | None = None) -> Registry:
    """Every plugin's components; a plugin whose registration fails is left out whole (a warning), except
    ``strict_for``, whose failure raises (register_plugin)."""
    reg = Registry()
    staged: dict[str, list[Entry]] = {}  # plugin -> its entries, in the order the plugins registered
    failed: dict[str, str] = {}
    for kind, hookname in _HOOKS.items():
        # each implementation is called on its own, so that every entry records which plugin provided it
        for impl in getattr(pm.hook, hookname).get_hookimpls():  # trylast (built-ins) first
            provider = impl.plugin_name
            if provider in failed:
                continue
            origin = _origins.get(provider, "registered at run time")
            try:
                impl.function(register=_make_register(staged.setdefault(provider, []), kind, provider, origin))
            except PluginError as exc:
                failed[provider] = str(exc)
            except Exception as exc:  # noqa: BLE001
                failed[provider] = f"Plugin {provider!r} ({origin}) raised in {hookname}: {type(exc).__name__}: {exc}"
    if strict_for in failed:
        raise PluginError(failed[strict_for])
    for provider in staged:
        if provider in failed:
            continue
        trial = Registry()  # this plugin's entries on a copy: all of them, or none
        trial.entries = {k: dict(v) for k, v in reg.entries.items()}
        try:
            for e in staged[provider]:
                trial.add(e)  # a duplicate name (its own, or an earlier plugin's) raises
        except PluginError as exc:
            if provider == strict_for:
                raise
            failed[provider] = str(exc)
            continue
        reg = trial
    for provider, why in failed.items():
        if _broken.get(provider) != why:
            _leave_out(provider, why)
    return reg


def _check_roles(cls, provider: str) -> None:
    """A draft source drafts through ``propose`` (a chain source), ``successors`` (a successor source), or both."""
    chain = cls.propose is not DraftSource.propose
    succ = cls.successors is not DraftSource.successors
    said = f"Plugin {provider!r} registered draft source {cls.__name__}"
    if succ and not cls.provides_successors:
        raise PluginError(f"{said}, which implements successors() but says provides_successors = False, so no "
                          "policy would ask it. Hint: set provides_successors = True.")
    if cls.provides_successors and not succ:
        raise PluginError(f"{said} with provides_successors = True without implementing: successors. "
                          "Hint: implement successors(token, prev), or set it False.")
    if not chain and not succ:
        raise PluginError(f"{said} without implementing: propose (a chain source) or successors with "
                          "provides_successors = True (a successor source).")


def _make_register(reg: list, kind: str, provider: str, origin: str):
    """The ``register`` a registration hook is called with: it checks each component and stages its entries."""
    base = KINDS[kind]

    def register(cls, name=None, aliases=(), defaults=None, description=None, deprecated=()) -> None:
        if not (inspect.isclass(cls) and issubclass(cls, base)):
            raise PluginError(
                f"Plugin {provider!r} registered {cls!r} as a {_KIND_WORDS[kind]}, but it is not a subclass of "
                f"goose.{base.__name__}. Subclass goose.{base.__name__} and implement its abstract methods.")
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            raise PluginError(f"Plugin {provider!r} registered {_KIND_WORDS[kind]} {cls.__name__} without "
                              f"implementing: {missing}.")
        if kind == "source":
            _check_roles(cls, provider)
        nm = name or cls.name
        if not nm or not isinstance(nm, str):
            raise PluginError(f"Plugin {provider!r} registered {cls.__name__} with no name: set the class "
                              "attribute `name` or pass name=... to register().")
        if not (inspect.isclass(cls.Options) and issubclass(cls.Options, Options)):
            raise PluginError(f"Plugin {provider!r}: {cls.__name__}.Options must subclass goose.Options "
                              f"(a pydantic model with extra='forbid'), got {cls.Options!r}.")
        defaults = dict(defaults or {})
        try:
            cls.Options(**defaults)
        except Exception as exc:  # noqa: BLE001
            raise PluginError(f"Plugin {provider!r}: defaults for {nm!r} are invalid: {exc}") from exc
        doc = description or (inspect.getdoc(cls) or "").split("\n")[0]
        reg.append(Entry(kind, nm, cls, provider, origin, defaults, doc))
        for alias in aliases:
            reg.append(Entry(kind, alias, cls, provider, origin, defaults, doc, alias_of=nm))
        for old in deprecated:
            reg.append(Entry(kind, old, cls, provider, origin, defaults, doc, alias_of=nm, deprecated=True))

    return register


def reset() -> None:
    """Forget the plugin manager and registry (tests; after installing a plugin at run time)."""
    global _pm, _registry
    with _lock:
        _pm = None
        _registry = None
        _origins.clear()
        _broken.clear()


# -- building components by name ------------------------------------------------------------------
def component_options(entry: Entry, overrides: Mapping | None):
    """``overrides`` validated against a registry entry's Options (defaults applied), or an
    :class:`InvalidInputError` saying what is allowed (the role's ComponentError where the Options code raised)."""
    try:
        return entry.options(dict(overrides or {}))
    except ValidationError as exc:
        fields = sorted(entry.cls.Options.model_fields)
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(options)'}: {e['msg']}"
            + ("" if e["type"] == "value_error" and "got " in e["msg"] else f" (got {e.get('input')!r})")
            for e in exc.errors()
        )
        raise InvalidInputError(f"Invalid options for {entry.kind} {entry.name!r}: {problems}. "
                                f"Allowed options: {', '.join(fields) or '(none)'}.") from exc
    except GooseError:
        raise
    except Exception as exc:  # noqa: BLE001 - a validator of the plugin's own raised: named with the component
        raise _component_error(entry, "Options", exc, overrides) from exc


def _component_error(entry: Entry, hook: str, exc: BaseException, options) -> ComponentError:
    """The role's error for ``exc``, raised while building ``entry`` (its ``__init__`` or its ``Options``)."""
    given = dict(options) if isinstance(options, Mapping) else options
    hint = (f"the component's own code raised with options {given or {}}; fix it in plugin {entry.provider!r} "
            f"({entry.origin}), or leave {entry.name!r} out")
    return _ROLE_ERRORS[entry.kind].raised(entry.alias_of or entry.name, hook, exc, hint=hint)


def _construct(entry: Entry, options, overrides):
    """``entry.cls(options)``, named by its registered name: a :class:`GooseError` it raises goes through; any
    other exception comes back as the role's :class:`ComponentError` naming the component and ``__init__``."""
    if entry.deprecated:
        warnings.warn(f"{_KIND_WORDS[entry.kind]} name {entry.name!r} is deprecated: it is {entry.alias_of!r} now. "
                      f"Hint: {entry.kind}={entry.alias_of!r}", DeprecationWarning, stacklevel=4)
    try:
        inst = entry.cls(options)
    except GooseError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the component's name
        raise _component_error(entry, "__init__", exc, overrides) from exc
    inst.name = entry.alias_of or entry.name
    return inst


def build_inner(name: str, options: Mapping | None, inherit: Mapping | None = None, outer: str = "") -> TreePolicy:
    """An inner policy by registry name, for wrapping policies (bypass, fit). ``inherit``: the wrapping policy's
    options that reach the inner one where it has them; one set differently in ``options`` is an error."""
    entry = get_registry().get("policy", name)
    options = dict(options or {})
    for key, value in (inherit or {}).items():
        if value is None or key not in entry.cls.Options.model_fields:
            continue
        if key in options and options[key] != value:
            raise InvalidInputError(
                f"policy {outer or 'wrapper'!r}: {key}={value!r} and inner_options {key}={options[key]!r} disagree. "
                f"Hint: set {key} once, on the outer policy; it reaches the policies it wraps.")
        options[key] = value
    return _construct(entry, component_options(entry, options), options)


def build_component(kind: str, spec, base: type, extra_options: Mapping | None):
    """A component instance from a name, a (name, options) pair or a ready instance (returned as it is)."""
    if isinstance(spec, base):
        if extra_options:
            raise InvalidInputError(f"options given for a ready-made {kind} instance {spec!r}; set them on it")
        return spec
    opts = None
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str):
        spec, opts = spec
    for given in (opts, extra_options):
        if given is not None and not isinstance(given, Mapping):
            name = spec if isinstance(spec, str) else getattr(spec, "name", spec)
            raise InvalidInputError(
                f"options for {kind} {name!r} must be a dict of option names to values, got {type(given).__name__} "
                f"{given!r}. Hint: ({name!r}, {{'option': value}}); `goose plugins` lists each component's options")
    if not isinstance(spec, str):
        raise InvalidInputError(f"a {kind} is given by name (str), (name, options) or a goose.{base.__name__} "
                                f"instance; got {spec!r}")
    entry = get_registry().get(kind, spec)
    merged = {**(opts or {}), **(extra_options or {})}
    return _construct(entry, component_options(entry, merged), merged)
