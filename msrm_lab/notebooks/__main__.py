"""Command line: ``python -m msrm_lab.notebooks run|check-book|label``.

    python -m msrm_lab.notebooks run --profile quick --device auto [--only NAME ...] [--timeout S] [--results DIR]
                                     [--repeats N] [--budget S|none]
    python -m msrm_lab.notebooks check-book _build/html [--results DIR] [--static]
    python -m msrm_lab.notebooks label --device auto
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from .device import DEVICES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m msrm_lab.notebooks", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="execute the notebooks into results/<device-label>/<profile>/")
    run.add_argument("--profile", default="quick", choices=("quick", "note", "full", "smoke"))
    run.add_argument("--device", default="auto", choices=DEVICES)
    run.add_argument("--only", nargs="+", metavar="NAME", help="notebook stems to run (e.g. inventory)")
    run.add_argument("--timeout", type=float, default=None,
                     help="seconds per execution of a notebook (default: per profile)")
    run.add_argument("--budget", default="profile",
                     help="soft seconds per execution after which no new experiment or size starts (default: per "
                          "profile; 'none' for no budget)")
    run.add_argument("--repeats", type=int, default=1,
                     help="executions of each notebook, each in its own process; rows hold the median (default 1)")
    run.add_argument("--results", default=None, help="results root (default: <repo>/results)")
    run.add_argument("--notebooks", default=None, help="notebooks folder (default: <repo>/notebooks)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")

    chk = sub.add_parser("check-book", help="open the built HTML in headless Chromium and check it")
    chk.add_argument("html", help="the built book, e.g. _build/html")
    chk.add_argument("--results", default=None, help="results roots the book was built from (os.pathsep list)")
    chk.add_argument("--chromium", default="/usr/bin/chromium")
    chk.add_argument("--static", action="store_true",
                     help="only the reader's checks of the HTML (tables, placeholders, captions), no browser")

    lab = sub.add_parser("label", help="print this machine's device label")
    lab.add_argument("--device", default="auto", choices=DEVICES)

    ex = sub.add_parser("_execute", help=argparse.SUPPRESS)
    ex.add_argument("--input", required=True)
    ex.add_argument("--output", required=True)
    ex.add_argument("--cwd", required=True)
    ex.add_argument("--parameters", required=True)
    ex.add_argument("--error-file", required=True)
    ex.add_argument("--timeout", type=float, required=True)
    return p


def _exit_on_sigterm(signum, frame):  # pragma: no cover - exercised by a signal
    raise SystemExit(128 + signum)


def _budget(text: str) -> float | None | str:
    if text in ("profile", "none"):
        return None if text == "none" else text
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"--budget: expected seconds, 'profile' or 'none', got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "_execute":
        from ._execute import execute

        return execute(args.input, args.output, args.cwd, json.loads(args.parameters), args.error_file, args.timeout)
    if args.command == "label":
        from .device import device_label

        print(device_label(args.device))
        return 0
    if args.command == "check-book":
        from .check_book import check_book, static_check

        failures = static_check(args.html)
        print("\n".join(f"FAIL {f}" for f in failures) or "static book check: all pages pass")
        if args.static:
            return 0 if not failures else 1
        report = check_book(args.html, results=args.results, chromium=args.chromium)
        print(report.summary())
        return 0 if report.ok and not failures else 1
    from .runner import run_notebooks

    # a SIGTERM (a job scheduler, `kill`) unwinds like Ctrl-C, so the running notebook's process group is stopped
    # too instead of being left behind
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        results = run_notebooks(profile=args.profile, device=args.device, only=args.only, timeout=args.timeout,
                                results=args.results, notebooks_dir=args.notebooks, progress=not args.no_progress,
                                repeats=args.repeats, budget=_budget(args.budget))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n_failed = sum(r.status != "ok" for r in results)
    print(f"{len(results) - n_failed} notebooks ok, {n_failed} failed", file=sys.stderr)
    return 0 if n_failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
