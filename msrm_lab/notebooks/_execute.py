"""Child-process entry: execute one notebook with papermill (called by the runner, never imported by users).

A SIGTERM from the runner's time limit becomes ``SystemExit`` so papermill shuts its kernel down on the way out.
Any failure is written as ``{"type", "message", "traceback"}`` JSON to the error file and exits with status 1.
"""
from __future__ import annotations

import signal
import sys
import traceback
from pathlib import Path

from msrm import atomic

__all__ = ["execute"]


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through the runner's time limit
    raise SystemExit(f"stopped by signal {signum} (time limit)")


def execute(input_path: str, output_path: str, cwd: str, parameters: dict, error_file: str, timeout: float) -> int:
    """Run ``papermill.execute_notebook`` and return a process exit status (0 ok, 1 failed)."""
    import papermill

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        papermill.execute_notebook(
            input_path,
            output_path,
            parameters=parameters,
            kernel_name="python3",
            cwd=cwd,
            progress_bar=False,
            log_output=False,
            request_save_on_cell_execute=True,
            execution_timeout=int(timeout) + 1,
        )
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then reported by exit status
        message = str(exc)
        if type(exc).__name__ == "PapermillExecutionError":
            message = f"{exc.ename}: {exc.evalue} (cell {exc.exec_count})"
        atomic.write_json(Path(error_file), {
            "type": type(exc).__name__,
            "message": message,
            "traceback": traceback.format_exc()[-8000:],
        })
        print(traceback.format_exc(), file=sys.stderr)
        return 1
    return 0
