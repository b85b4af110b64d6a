"""The ``goose`` command line: plugins, models, generate, bench, theory."""

from __future__ import annotations

import argparse
import sys


def _cmd_plugins(args) -> int:
    from goose.manager import get_plugin_manager, get_registry

    pm = get_plugin_manager()
    reg = get_registry()
    words = {"source": "Draft sources", "policy": "Tree policies", "verifier": "Verifiers"}
    for kind, title in words.items():
        print(f"{title}:")
        for name in reg.names(kind):
            e = reg.entries[kind][name]
            extra = f" = {e.alias_of}" if e.alias_of else ""
            preset = f" {e.defaults}" if e.defaults else ""
            print(f"  {name:<16}{extra}{preset}  [{e.cls.__module__}.{e.cls.__name__}; plugin {e.provider}, {e.origin}]")
            if e.description:
                print(f"      {e.description}")
    from goose.manager import _origins

    print("Plugins loaded:")
    for name, plugin in pm.list_name_plugin():
        print(f"  {name}  ({_origins.get(name, '?')})")
    return 0


def _cmd_models(args) -> int:
    from goose import models

    if args.action == "list":
        have = models.installed()
        for name, spec in models.MODELS.items():
            state = f"converted at {models.model_dir(name)}" if have[name] else "not pulled"
            print(f"{name:<10} {spec.description}  [{state}]")
        return 0
    path = models.pull(args.name, force=args.force)
    print(f"{args.name}: ready at {path}")
    return 0


def _cmd_theory(args) -> int:
    from goose.theory.__main__ import main as theory_main

    return theory_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    from goose.errors import GooseError

    p = argparse.ArgumentParser(prog="goose", description="Lossless speculative decoding (GOOSE).")
    sub = p.add_subparsers(dest="cmd", required=True)

    sp = sub.add_parser("plugins", help="list registered sources, policies, verifiers and their origin")
    sp.set_defaults(func=_cmd_plugins)

    sm = sub.add_parser("models", help="obtain and convert the offline models")
    sm.add_argument("action", choices=["pull", "list"])
    sm.add_argument("name", nargs="?", default="smollm2")
    sm.add_argument("--force", action="store_true", help="convert again even if converted")
    sm.set_defaults(func=_cmd_models)

    from goose import bench as bench_mod
    from goose import generate as gen_mod

    gen_mod.add_parser(sub)
    bench_mod.add_parser(sub)

    st = sub.add_parser("theory", help="acceptance model and proposition checks (see docs/theory.md)")
    st.add_argument("rest", nargs=argparse.REMAINDER)
    st.set_defaults(func=_cmd_theory)

    args = p.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GooseError as exc:
        print(f"goose: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
