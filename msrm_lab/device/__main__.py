"""Command line of the device run.

    python -m msrm_lab.device [--device cuda|cpu|auto] [--profile device|smoke] [--results DIR]
                              [--parts NAME,NAME] [--budget-s S] [--fail NAME,NAME]
    python -m msrm_lab.device --fetch-wheels [--wheels DIR]

The first form runs the parts (:mod:`msrm_lab.device.parts`) into ``<results>/<label>/<profile>/`` and exits 0
when every part was done, 1 when one failed or was not run. ``--device cuda`` (the default) without a CUDA GPU
visible to JAX exits 2 with one line on stderr, before anything runs. ``--fail`` (or ``MSRM_DEVICE_FAIL``) makes
the named parts fail at their start, to check that the others still run. The second form downloads the wheels of
``tools/device-wheels.txt`` for the GPU image into ``--wheels`` (default ``.device-wheels``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PROG = "python -m msrm_lab.device"


def _parser() -> argparse.ArgumentParser:
    from .parts import PARTS, PROFILES

    p = argparse.ArgumentParser(prog=PROG, description="CUDA qualification tests and the device benchmarks.")
    p.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    p.add_argument("--profile", default="device", choices=sorted(PROFILES))
    p.add_argument("--results", default=None, help="results root (default: <repo>/results)")
    p.add_argument("--parts", default=None, help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    p.add_argument("--budget-s", type=float, default=None, help="total seconds (default: the profile's)")
    p.add_argument("--fail", default=None, help="comma-separated parts made to fail at their start (a check)")
    p.add_argument("--fetch-wheels", action="store_true", help="download the wheels the GPU image lacks, then exit")
    p.add_argument("--wheels", default=None, help="wheel folder for --fetch-wheels (default: <repo>/.device-wheels)")
    return p


def _names(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def _child(argv: list[str]) -> int:
    """``_part NAME``: run one part in this process (started by the driver, never by hand)."""
    p = argparse.ArgumentParser(prog=f"{PROG} _part")
    p.add_argument("name")
    p.add_argument("--profile", required=True)
    p.add_argument("--platform", required=True, choices=("cpu", "cuda"))
    p.add_argument("--folder", required=True)
    p.add_argument("--timeout-s", type=float, required=True)
    a = p.parse_args(argv)
    import msrm.runtime

    # CUDA: JAX's own choice (the GPU first, the CPU beside it); CPU: pinned
    msrm.runtime.configure(platform="cpu" if a.platform == "cpu" else None, preallocate=False)
    from msrm import atomic

    from .parts import PartFailed, run_part

    folder = Path(a.folder)
    try:
        n = run_part(a.name, a.profile, a.platform, folder, a.timeout_s,
                     write=lambda rows: atomic.append_jsonl(folder / "rows.jsonl", rows))
    except PartFailed as exc:
        print(f"part failed: {exc}", flush=True)
        return 1
    except Exception as exc:  # the traceback goes to the part's log; its last line names the error
        import traceback

        traceback.print_exc()
        print(f"part failed: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        return 1
    print(f"part done: {n} rows", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_part"]:
        return _child(argv[1:])
    args = _parser().parse_args(argv)
    from msrm_lab.paths import repo_root

    try:
        root = repo_root()
        if args.fetch_wheels:
            from .wheels import DEFAULT_FOLDER, REQUIREMENTS, fetch_wheels

            folder = Path(args.wheels) if args.wheels else root / DEFAULT_FOLDER
            wheels, total = fetch_wheels(folder, root / REQUIREMENTS)
            print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {folder}: " + ", ".join(w.name for w in wheels))
            return 0
        from msrm_lab.notebooks.device import resolve_device

        from .driver import run_device

        platform, label = resolve_device(args.device)
        results = Path(args.results) if args.results else root / "results"
        status = run_device(profile=args.profile, platform=platform, label=label, results=results, root=root,
                            parts=_names(args.parts) or None, budget_s=args.budget_s, fail=_names(args.fail))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    base = results / label / args.profile
    print(f"[device] done: {status['done']}; failed: {status['failed']}; not run: {status['not_run']} "
          f"({base / 'status.json'})")
    return 0 if not status["failed"] and not status["not_run"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
