"""Child processes of the tooling (the notebook runner, the device run): stopping one with its process group."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess

__all__ = ["kill_group"]


def kill_group(proc: subprocess.Popen, term_grace: float = 10.0) -> None:
    """Stop a child started with ``start_new_session=True`` and its process group: SIGTERM, then SIGKILL if it
    has not exited after ``term_grace`` seconds (and 5 s more for the SIGKILL to land)."""
    for sig, grace in ((signal.SIGTERM, term_grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
