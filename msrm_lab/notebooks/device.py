"""Device labels for results folders: ``results/<device-label>/<profile>/<notebook>/``.

A label names the platform and the device model so that results from different machines sit side by side:
``cpu-amd-epyc-7763-avx2-2c`` (slug of the CPU model, its widest vector extension, then the physical core count)
or ``cuda-h200`` (slug of the GPU's device kind without the vendor). The vector extension is part of a CPU's
label because it selects the BLAS kernel: virtual machines often report a bare "AMD EPYC", and an AVX-512 host
and an AVX2 host behind that one name differ by up to twice in dense float64 throughput. The CPU label never imports JAX; the CUDA label asks JAX in a child
process, so the runner itself never initialises a GPU backend.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

from msrm.runtime import cpu_model, cpu_vector_level, physical_cores

__all__ = ["slug", "cpu_label", "cuda_label", "gpu_kinds", "resolve_device", "device_label", "DEVICES"]

DEVICES = ("auto", "cpu", "cuda")

# Words that say nothing about which device it is.
_NOISE = re.compile(
    r"\((r|tm|c)\)|\b(processor|cpu|nvidia|geforce|corporation|with|radeon graphics)\b|\b\d+-core\b|@.*$",
    re.IGNORECASE,
)


def slug(text: str) -> str:
    """Lower-case ``text``, drop vendor noise (``(R)``, ``Processor``, ``64-Core``, ``@ 2.4GHz``, ``NVIDIA``)
    and join the remaining words with ``-``.

    >>> slug("AMD EPYC 7763 64-Core Processor")
    'amd-epyc-7763'
    >>> slug("NVIDIA GeForce RTX 3090")
    'rtx-3090'
    """
    text = _NOISE.sub(" ", text)
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "-".join(words) or "unknown"


def cpu_label(model: str | None = None, cores: int | None = None, vector: str | None = "auto") -> str:
    """``cpu-<model slug>-<vector level>-<physical cores>c``, e.g. ``cpu-amd-epyc-7763-avx2-2c``.

    ``vector="auto"`` reads this machine's level (:func:`msrm.runtime.cpu_vector_level`); ``None`` (or a level
    that cannot be read) leaves it out: ``cpu-amd-epyc-7763-2c``.
    """
    model = cpu_model() if model is None else model
    cores = physical_cores() if cores is None else cores
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive integer, got {cores!r}")
    if vector == "auto":
        vector = cpu_vector_level()
    if vector is not None and not re.fullmatch(r"[a-z0-9]+", str(vector)):
        raise ValueError(f"vector must be a lower-case SIMD level such as 'avx2', got {vector!r}")
    return f"cpu-{slug(model)}-{vector}-{cores}c" if vector else f"cpu-{slug(model)}-{cores}c"


def cuda_label(device_kind: str) -> str:
    """``cuda-<device kind slug>``, e.g. ``cuda-h200`` for ``"NVIDIA H200"``."""
    if not device_kind or not device_kind.strip():
        raise ValueError("device_kind must be a non-empty GPU model name")
    return f"cuda-{slug(device_kind)}"


def _cuda_plugin_installed() -> bool:
    return any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
        if _safe_parent(name)
    )


def _safe_parent(name: str) -> bool:
    parent = name.rpartition(".")[0]
    return not parent or importlib.util.find_spec(parent) is not None


def gpu_kinds(timeout: float = 120.0) -> list[str]:
    """Device kinds of the CUDA GPUs JAX can see, asked in a child process (``[]`` when there are none).

    Without a JAX CUDA plugin installed the answer is ``[]`` at once, without starting a process.
    """
    if not _cuda_plugin_installed():
        return []
    code = (
        "import json, jax\n"
        "try:\n    ds = jax.devices('cuda')\nexcept Exception:\n    ds = []\n"
        "print(json.dumps([d.device_kind for d in ds]))\n"
    )
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    try:
        return [str(k) for k in json.loads(out.stdout.strip().splitlines()[-1])]
    except (ValueError, IndexError):
        return []


def resolve_device(device: str) -> tuple[str, str]:
    """Turn ``auto|cpu|cuda`` into ``(platform, label)``.

    ``auto`` picks CUDA when JAX sees a GPU, else the CPU. ``cuda`` without a visible GPU is an error.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cpu":
        return "cpu", cpu_label()
    kinds = gpu_kinds()
    if kinds:
        return "cuda", cuda_label(kinds[0])
    if device == "cuda":
        raise ValueError("device='cuda' was asked for but JAX sees no CUDA GPU (install '.[cuda]' and check "
                         "CUDA_VISIBLE_DEVICES)")
    return "cpu", cpu_label()


def device_label(device: str = "auto") -> str:
    """The results-folder label for ``device`` on this machine."""
    return resolve_device(device)[1]
