"""``python -m goose.theory check [--out DIR] [--records PATH]`` (also ``goose theory check``), and
``python -m goose.theory record --out PATH`` to log real runs for ``--records``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="goose theory",
        description="Acceptance model of spine trees and numerical checks of Propositions 2-4 and of the N-source "
                    "allocation (docs/theory.md).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="run every check: one line each, exit 1 if any fails")
    c.add_argument("--out", default="theory_out", help="folder for the PNG plots (default: ./theory_out)")
    c.add_argument("--records", default=None,
                   help="JSON lines of logged verification steps for Prop. 4 and the tau calibration "
                        "(format: docs/theory.md, 'Records')")
    c.add_argument("--tau-tol", type=float, default=0.10,
                   help="largest relative tau error per dataset that counts as holding (default 0.10)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random cases (default 0)")
    c.add_argument("--no-plots", action="store_true", help="do not write PNG files")
    r = sub.add_parser("record", help="decode benchmark prompts and log every step as JSON lines for --records")
    r.add_argument("--out", required=True, help="JSON-lines file to write")
    r.add_argument("--datasets", default="humaneval,gsm8k,mt_bench", help="comma-separated goose dataset specs")
    r.add_argument("--model", default="smollm2", help="registry name or local Hugging Face folder")
    r.add_argument("--num-prompts", type=int, default=5, help="prompts per dataset (default 5)")
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--sources", default="pld,tr", help="comma-separated draft sources (default pld,tr)")
    r.add_argument("--policy", default="spine", help="tree policy (default spine)")
    r.add_argument("--budget", type=int, default=60)
    r.add_argument("--data-dir", default=None,
                   help="benchmark data folder (default: $GOOSE_DATA; demo and humaneval need none)")
    r.add_argument("--threads", type=int, default=None)
    return p


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(None if argv is None else list(argv))
    if args.cmd == "record":
        from goose.errors import GooseError
        from goose.theory.collect import record_runs

        try:
            recs = record_runs(_names(args.datasets), args.out, args.model, args.num_prompts, args.max_new_tokens,
                               _names(args.sources), args.policy, args.budget, args.data_dir, args.threads)
        except GooseError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {len(recs)} step records to {args.out}")
        return 0
    from goose.theory.calibrate import load_records
    from goose.theory.checks import run_all

    records = None
    if args.records:
        try:
            records = load_records(args.records)
        except (OSError, ValueError) as exc:
            print(f"error: cannot read --records {args.records}: {exc}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    report = run_all(records, seed=args.seed, tau_tol=args.tau_tol)
    for check in report.checks:
        print(check.line())
    if not args.no_plots:
        try:
            from goose.theory.plots import write_plots

            for path in write_plots(report.plots, args.out):
                print(f"plot: {path}")
        except ImportError:
            print("plots skipped: matplotlib is not installed (pip install matplotlib)")
    n_fail = sum(c.status == "fails" for c in report.checks)
    n_hold = sum(c.status == "holds" for c in report.checks)
    print(f"{n_hold} hold, {n_fail} fail ({time.perf_counter() - t0:.1f}s)")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
