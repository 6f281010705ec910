"""The wheels the GPU image lacks: downloaded here with ``pip download``, carried, installed there with one command.

``tools/device-wheels.txt`` pins them: ArviZ and the packages it needs beyond the image's own, and ducc0, which
runs the diagnostics' FFTs where it is installed (the notebooks' papermill is not among them: the device run calls
the benchmark functions directly). All but ducc0 are pure-Python wheels; every one is fetched without its
dependencies (``--no-deps``: everything else they import is in the image) for CPython 3.12 on manylinux x86_64.
On the GPU machine ``tools/bench_device.sh`` installs them with::

    python3 -m pip install --no-index --no-deps --find-links <folder> --target <site> -r tools/device-wheels.txt

and puts ``<site>`` on ``PYTHONPATH`` (``--target`` leaves the image's own environment untouched).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["REQUIREMENTS", "DEFAULT_FOLDER", "MAX_TOTAL_BYTES", "PLATFORMS", "download_command", "fetch_wheels"]

REQUIREMENTS = Path("tools") / "device-wheels.txt"
DEFAULT_FOLDER = Path(".device-wheels")
MAX_TOTAL_BYTES = 50 * 2**20  # what travels with the working tree is capped at 64 MiB in all
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download_command(folder: Path, requirements: Path) -> list[str]:
    """``pip download`` of the pinned wheels for CPython 3.12, manylinux x86_64, binaries only, no dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "none"]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    return cmd + ["-d", str(folder), "-r", str(requirements)]


def fetch_wheels(folder: Path, requirements: Path) -> tuple[list[Path], int]:
    """Download the wheels into ``folder``; returns them and their total bytes.

    Raises:
        FileNotFoundError: the requirements file is missing.
        RuntimeError: pip failed, or the wheels exceed :data:`MAX_TOTAL_BYTES`.
    """
    requirements = Path(requirements)
    if not requirements.is_file():
        raise FileNotFoundError(f"requirements file {str(requirements)!r} does not exist")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(download_command(folder, requirements), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    wheels = sorted(folder.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    if total > MAX_TOTAL_BYTES:
        raise RuntimeError(f"the wheels in {folder} take {total / 2**20:.1f} MiB, over the "
                           f"{MAX_TOTAL_BYTES / 2**20:.0f} MiB that may travel with the working tree")
    return wheels, total
