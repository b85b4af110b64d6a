"""The plugin manager and the component registry.

Built-in components are plugins too: the modules in ``DEFAULT_PLUGINS`` register through the same
hooks as third-party distributions, which are discovered through the entry-point group ``goose``.

Environment:
    GOOSE_DISABLE_PLUGIN_AUTOLOAD=1   do not load third-party entry points
    GOOSE_PLUGINS=name1,name2         load only these entry points (allow-list)
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from goose import hookspecs
from goose.errors import PluginError, UnknownComponentError
from goose.interfaces import DraftSource, Options, TreePolicy, Verifier

ENTRY_POINT_GROUP = "goose"
ENV_DISABLE = "GOOSE_DISABLE_PLUGIN_AUTOLOAD"
ENV_ALLOW = "GOOSE_PLUGINS"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "goose.plugins.pld",
    "goose.plugins.tr",
    "goose.policies.chain",
    "goose.policies.isotropic",
    "goose.policies.spine",
    "goose.policies.fit",
    "goose.verifiers.greedy",
)

KINDS = {"source": DraftSource, "policy": TreePolicy, "verifier": Verifier}
_HOOKS = {
    "source": "goose_register_sources",
    "policy": "goose_register_policies",
    "verifier": "goose_register_verifiers",
}


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    cls: type
    provider: str  # plugin name that registered it
    origin: str  # "builtin" or the distribution that provides the entry point
    defaults: dict = field(default_factory=dict)
    description: str = ""
    alias_of: str | None = None

    def options(self, overrides: dict | None = None) -> Options:
        return self.cls.Options(**{**self.defaults, **(overrides or {})})


class Registry:
    """Names -> components, per kind. Built once from the hooks; read by ``compose``."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}

    def add(self, entry: Entry) -> None:
        table = self.entries[entry.kind]
        if entry.name in table:
            prev = table[entry.name]
            raise PluginError(
                f"Duplicate {_KIND_WORDS[entry.kind]} name {entry.name!r}: registered by plugin {prev.provider!r} "
                f"({prev.origin}) and again by plugin {entry.provider!r} ({entry.origin}). "
                "Rename one of them, or disable one plugin with GOOSE_PLUGINS=<allow-list>."
            )
        table[entry.name] = entry

    def get(self, kind: str, name: str) -> Entry:
        table = self.entries[kind]
        if not isinstance(name, str):
            raise TypeError(f"{kind} name must be a str, got {type(name).__name__}")
        if name not in table:
            raise UnknownComponentError(_KIND_WORDS[kind], name, table)
        return table[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])


_KIND_WORDS = {"source": "draft source", "policy": "tree policy", "verifier": "verifier"}

_pm: pluggy.PluginManager | None = None
_registry: Registry | None = None
_origins: dict[str, str] = {}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use (never at import time)."""
    global _pm
    if _pm is not None:
        return _pm
    pm = pluggy.PluginManager("goose")
    pm.add_hookspecs(hookspecs)
    for modname in DEFAULT_PLUGINS:
        mod = importlib.import_module(modname)
        pm.register(mod, name=modname)
        _origins[modname] = "builtin"
    if os.environ.get(ENV_DISABLE, "").strip().lower() not in ("1", "true", "yes"):
        _load_entry_points(pm)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(
            f"Plugin {exc.plugin_name!r} implements a hook Goose does not define: {exc}. "
            f"Known hooks: {', '.join(sorted(n for n in dir(hookspecs) if n.startswith('goose_')))}."
        ) from exc
    _pm = pm
    return pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    allow = os.environ.get(ENV_ALLOW)
    allowed = None if not allow else {a.strip() for a in allow.split(",") if a.strip()}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        if pm.get_plugin(ep.name) is not None:
            continue
        dist = ep.dist.name if ep.dist is not None else "?"
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001
            raise PluginError(
                f"Plugin {ep.name!r} (entry point {ep.value!r} from distribution {dist!r}) failed to "
                f"load: {type(exc).__name__}: {exc}. Fix or uninstall it, or set {ENV_DISABLE}=1."
            ) from exc
        try:
            pm.register(plugin, name=ep.name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise PluginError(f"Plugin {ep.name!r} from distribution {dist!r} is malformed: {exc}") from exc
        _origins[ep.name] = f"entry point {ep.value} ({dist})"


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin object (module or instance with ``@goose.hookimpl`` functions) at run time."""
    pm = get_plugin_manager()
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise PluginError(f"Plugin {name or plugin!r} is malformed: {exc}") from exc
    pname = pm.get_name(plugin)
    _origins[pname] = "registered at run time"
    global _registry
    _registry = None


def unregister_plugin(name: str) -> None:
    pm = get_plugin_manager()
    pm.unregister(name=name)
    _origins.pop(name, None)
    global _registry
    _registry = None


def get_registry() -> Registry:
    """The component registry, built from the registration hooks on first use."""
    global _registry
    if _registry is not None:
        return _registry
    pm = get_plugin_manager()
    reg = Registry()
    for kind, hookname in _HOOKS.items():
        caller = getattr(pm.hook, hookname)
        # Call each implementation on its own, so every entry records which plugin provided it.
        for impl in caller.get_hookimpls():  # trylast (built-ins) first
            provider = impl.plugin_name
            origin = _origins.get(provider, "registered at run time")
            register = _make_register(reg, kind, provider, origin)
            try:
                impl.function(register=register)
            except PluginError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise PluginError(
                    f"Plugin {provider!r} ({origin}) raised in {hookname}: {type(exc).__name__}: {exc}"
                ) from exc
    _registry = reg
    return reg


def _make_register(reg: Registry, kind: str, provider: str, origin: str):
    base = KINDS[kind]

    def register(cls, name=None, aliases=(), defaults=None, description=None) -> None:
        if not (inspect.isclass(cls) and issubclass(cls, base)):
            raise PluginError(
                f"Plugin {provider!r} registered {cls!r} as a {_KIND_WORDS[kind]}, but it is not a "
                f"subclass of goose.{base.__name__}. Subclass goose.{base.__name__} and implement "
                f"its abstract methods."
            )
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            raise PluginError(
                f"Plugin {provider!r} registered {_KIND_WORDS[kind]} {cls.__name__} without "
                f"implementing: {missing}."
            )
        nm = name or cls.name
        if not nm or not isinstance(nm, str):
            raise PluginError(
                f"Plugin {provider!r} registered {cls.__name__} with no name: set the class "
                "attribute `name` or pass name=... to register()."
            )
        if not (inspect.isclass(cls.Options) and issubclass(cls.Options, Options)):
            raise PluginError(
                f"Plugin {provider!r}: {cls.__name__}.Options must subclass goose.Options "
                f"(a pydantic model with extra='forbid'), got {cls.Options!r}."
            )
        defaults = dict(defaults or {})
        try:
            cls.Options(**defaults)
        except Exception as exc:  # noqa: BLE001
            raise PluginError(f"Plugin {provider!r}: defaults for {nm!r} are invalid: {exc}") from exc
        doc = description or (inspect.getdoc(cls) or "").split("\n")[0]
        reg.add(Entry(kind, nm, cls, provider, origin, defaults, doc))
        for alias in aliases:
            reg.add(Entry(kind, alias, cls, provider, origin, defaults, doc, alias_of=nm))

    return register


def reset() -> None:
    """Forget the plugin manager and registry (tests; after installing a plugin at run time)."""
    global _pm, _registry
    _pm = None
    _registry = None
    _origins.clear()
