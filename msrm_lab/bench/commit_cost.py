"""What a change cost in time: densities, gradients and value+grad time of two source trees, side by side.

    python -m msrm_lab.bench.commit_cost compare --base ../old-checkout --head . [--rounds 3] [--repeats 5]
    python -m msrm_lab.bench.commit_cost compare --base-commit bcd61a9 [--pairs x8-K5:state_space ...]

Each case is built once, by ``data_synth.synthetic_dataset`` in the base tree, and pickled, so both trees
evaluate the very same data and parameters (the generator's own rounding may differ between trees). Each (case,
backend) is then measured in a fresh process per tree, the two trees alternating round by round (so a slow
period of the machine hits both), with the tree first on ``PYTHONPATH``. A process loads the case and times
``model.value_and_grad(u)`` at the true parameters: one compiling call, then ``--repeats`` warm calls (the
median is its figure). It uses only the public API, so any commit with ``GPMSRM``/``data_synth`` can be
measured. The report gives, per case, the relative difference of the log density and of the gradient
(max-norm) between the trees, each tree's median over rounds with the spread, and head/base.

:func:`checkout` makes the base tree from a commit of this repository (a detached ``git worktree`` in a
temporary folder, removed afterwards); :func:`cost_rows` turns a comparison into results rows.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["CASES", "checkout", "compare", "cost_rows"]

CASES = {
    # name: (profile, n_features, K, duration_scale)
    "tiny": ("tiny", 3, 2, 1.0),
    "one-eighth-K3": ("one-eighth", 3600, 3, 1.0),
    "x8-K5": ("one-eighth", 3600, 5, 8.0),
}


def build(case: str, path: Path) -> None:
    """Pickle (data, spec, params) of a case, built by this process's data_synth."""
    import pickle

    import data_synth

    profile, F, K, scale = CASES[case]
    data, truth = data_synth.synthetic_dataset(profile, n_features=F, n_factors=K, duration_scale=scale, seed=0)
    path.write_bytes(pickle.dumps((data, truth.spec, truth.params)))


def measure(case: str, backend: str, repeats: int, path: Path) -> dict:
    import pickle

    import numpy as np
    from threadpoolctl import threadpool_info

    import msrm

    msrm.runtime.configure(platform="cpu")
    data, spec, params = pickle.loads(path.read_bytes())
    out = {"case": case, "backend": backend, "msrm_file": msrm.__file__,
           "blas": [{k: d.get(k) for k in ("internal_api", "architecture", "num_threads")} for d in threadpool_info()],
           "loadavg": os.getloadavg()[0]}
    try:
        model = msrm.GPMSRM(data, spec, linear_algebra=backend)
    except MemoryError as exc:  # the memory guard refuses before any numerics
        return {**out, "refused": str(exc)[:300]}
    u = model.unconstrain(params)
    t0 = time.perf_counter()
    value, grad = model.value_and_grad(u)
    out["first_s"] = time.perf_counter() - t0
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.value_and_grad(u)
        samples.append(time.perf_counter() - t0)
    out.update(value=float(value), grad=np.asarray(grad, dtype=float).tolist(), samples=samples,
               median_s=statistics.median(samples))
    return out


def _child(tree: Path, *args: str) -> str:
    """Run this file as a script in a fresh process with ``tree`` first on ``PYTHONPATH`` (as a script, not as
    ``-m msrm_lab...``, so that nothing of the tree's own ``msrm_lab`` is needed); its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"{tree} {' '.join(args)} failed:\n{res.stderr[-3000:]}")
    return res.stdout


def _run(tree: Path, case: str, backend: str, repeats: int, path: Path) -> dict:
    out = _child(tree, "measure", "--case", case, "--backend", backend, "--repeats", str(repeats),
                 "--data", str(path))
    row = json.loads(out.strip().splitlines()[-1])
    if not row["msrm_file"].startswith(str(tree.resolve())):
        raise RuntimeError(f"{tree}: measured msrm from {row['msrm_file']}, not from the tree")
    return row


def compare(base: Path, head: Path, rounds: int, repeats: int, pairs, workdir: Path) -> dict:
    import numpy as np

    report = {}
    cases = {}
    for case in sorted({c for c, _ in pairs}):
        cases[case] = workdir / f"{case}.pkl"
        _child(base, "build", "--case", case, "--data", str(cases[case]))
    for case, backend in pairs:
        runs = {"base": [], "head": []}
        for r in range(rounds):
            order = ("base", "head") if r % 2 == 0 else ("head", "base")
            for side in order:
                runs[side].append(_run(base if side == "base" else head, case, backend, repeats, cases[case]))
        b, h = runs["base"][0], runs["head"][0]
        key = f"{case}/{backend}"
        if "refused" in b or "refused" in h:
            report[key] = {"refused": {"base": b.get("refused"), "head": h.get("refused")}}
            continue
        gb, gh = np.asarray(b["grad"]), np.asarray(h["grad"])
        med = {s: [x["median_s"] for x in runs[s]] for s in runs}
        report[key] = {
            "value_base": b["value"], "value_head": h["value"],
            "value_rel_diff": abs(h["value"] - b["value"]) / abs(b["value"]),
            # the same tree's rounds agree to this (the floor any comparison can reach)
            "value_rel_spread_within": max(abs(x["value"] - runs[s][0]["value"]) / abs(b["value"])
                                           for s in runs for x in runs[s]),
            "grad_rel_diff": float(np.max(np.abs(gh - gb)) / np.max(np.abs(gb))),
            "median_s": {s: statistics.median(v) for s, v in med.items()},
            "per_round_s": med,
            "head_over_base": statistics.median(med["head"]) / statistics.median(med["base"]),
            # the fastest round of each side: least touched by other jobs on a shared machine
            "head_over_base_fastest": min(med["head"]) / min(med["base"]),
            "blas": h["blas"], "loadavg": [x["loadavg"] for s in runs for x in runs[s]],
        }
        print(key, json.dumps({k: v for k, v in report[key].items() if k not in ("blas",)}), file=sys.stderr)
    return report


@contextlib.contextmanager
def checkout(commit: str, repo: Path | None = None):
    """Context: a detached ``git worktree`` of ``commit`` of the repository at ``repo`` (default: the one holding
    this package) in a temporary folder; yields its path and removes it afterwards. Raises ``RuntimeError`` naming
    the commit when git cannot make it (no git, a shallow clone without that commit)."""
    repo = Path(__file__).resolve().parents[2] if repo is None else Path(repo)
    tmp = Path(tempfile.mkdtemp(prefix="msrm-base-"))
    tree = tmp / "tree"
    try:
        res = subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=repo,
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"cannot check out {commit}: {exc}") from exc
    if res.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"cannot check out {commit}: {res.stderr.strip()[-500:]}")
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True,
                       timeout=300)
        shutil.rmtree(tmp, ignore_errors=True)


def cost_rows(base_commit: str, pairs, *, rounds: int, repeats: int, notebook: str, info: dict,
              head: Path | None = None) -> list[dict]:
    """Results rows of :func:`compare` between ``base_commit`` (checked out by :func:`checkout`) and the tree at
    ``head`` (default: this checkout), one per (case, backend) pair: metric ``head_over_base`` (the ratio of the
    two trees' medians over rounds, unit ``x``) with each tree's median and per-round figures, the load averages
    seen by the measuring processes, and the relative differences of the density and the gradient as params.
    When the base cannot be checked out, or a pair is refused, the rows say so with the reason."""
    from .rows import make_row

    head = Path(__file__).resolve().parents[2] if head is None else Path(head)
    common = dict(base_commit=base_commit, rounds=rounds, repeats=repeats)
    try:
        with checkout(base_commit, head) as base, tempfile.TemporaryDirectory() as work:
            report = compare(base, head.resolve(), rounds, repeats, pairs, Path(work))
    except RuntimeError as exc:
        return [make_row(notebook, "accuracy_cost", "head_over_base", None, "x", status="error", info=info,
                         case=c, backend=b, reason=str(exc)[:500], **common) for c, b in pairs]
    rows = []
    for key, r in report.items():
        case, backend = key.split("/")
        if "refused" in r:
            rows.append(make_row(notebook, "accuracy_cost", "head_over_base", None, "x", status="refused",
                                 info=info, case=case, backend=backend, reason=str(r["refused"])[:500], **common))
            continue
        rows.append(make_row(notebook, "accuracy_cost", "head_over_base", r["head_over_base"], "x", info=info,
                             case=case, backend=backend, base_median_s=r["median_s"]["base"],
                             head_median_s=r["median_s"]["head"], base_rounds_s=r["per_round_s"]["base"],
                             head_rounds_s=r["per_round_s"]["head"],
                             head_over_base_fastest=r["head_over_base_fastest"],
                             value_rel_diff=r["value_rel_diff"], grad_rel_diff=r["grad_rel_diff"],
                             load_min=min(r["loadavg"]), load_max=max(r["loadavg"]), **common))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    bd = sub.add_parser("build")
    bd.add_argument("--case", choices=sorted(CASES), required=True)
    bd.add_argument("--data", type=Path, required=True)
    m = sub.add_parser("measure")
    m.add_argument("--case", choices=sorted(CASES), required=True)
    m.add_argument("--backend", required=True)
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("--data", type=Path, required=True)
    c = sub.add_parser("compare")
    base = c.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", type=Path, help="the base source tree")
    base.add_argument("--base-commit", help="a commit of this repository, checked out for the comparison")
    c.add_argument("--head", type=Path, default=Path("."))
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--pairs", nargs="+", default=["one-eighth-K3:grouped", "one-eighth-K3:state_space",
                                                  "x8-K5:state_space", "x8-K5:grouped"])
    c.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.command == "build":
        build(args.case, args.data)
        return 0
    if args.command == "measure":
        print(json.dumps(measure(args.case, args.backend, args.repeats, args.data)))
        return 0
    pairs = [tuple(s.split(":")) for s in args.pairs]
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        base = args.base if args.base is not None else stack.enter_context(checkout(args.base_commit))
        report = compare(base.resolve(), args.head.resolve(), args.rounds, args.repeats, pairs, work)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    # run as a file (the child processes of _child), this folder is first on sys.path: drop it, so that its
    # module names (gp, linalg, measure, ...) cannot shadow anything the measured tree imports
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.exit(main())
