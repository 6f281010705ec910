"""The prepared device run: CUDA qualification tests and the ``device`` profile of the benchmarks, in one command.

    bash tools/bench_device.sh                         # on the GPU machine (make bench-device)
    python -m msrm_lab.device --device cpu --profile smoke --results /tmp/r   # the CPU dry run, tiny sizes
    python -m msrm_lab.device --fetch-wheels           # here, before: the wheels the GPU image lacks

:mod:`.parts` holds the parts and their sizes, :mod:`.driver` runs them one process each within the time budget
and writes ``results/<label>/<profile>/status.json``, :mod:`.wheels` downloads and lists the carried wheels.
"""
from __future__ import annotations

from .driver import MIN_PART_S, STATUS_FILE, load_status, run_device
from .parts import FAIL_ENV, PARTS, PROFILES, PartFailed

__all__ = ["FAIL_ENV", "MIN_PART_S", "PARTS", "PROFILES", "PartFailed", "STATUS_FILE", "load_status", "run_device"]
