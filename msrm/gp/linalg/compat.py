"""Workarounds for jaxlib's CPU runtime, each gated on the jaxlib versions it applies to.

``jaxlib.version.__version__`` is parsed once, at import, into :data:`JAXLIB_VERSION`. Each workaround has a
flag that is true when the installed jaxlib lies in the range where the problem occurs: :data:`AFFECTED` holds,
per workaround, the first affected version and the first version on which the problem was checked and found
gone (None while no such version is known: the range is then open above, and a newer jaxlib keeps the
workaround until it has been checked). ``tools/probe_jaxlib.py`` runs one small program per problem in a
subprocess under a time limit (a stall never returns) and is how a new jaxlib is checked.

1. **Batched CPU LAPACK kernels can leave every thread of XLA's CPU pool waiting**
   (:data:`BATCHED_CPU_LAPACK_CAN_DEADLOCK`). On XLA:CPU a batched LAPACK kernel (Cholesky, LU, triangular
   solve over leading batch axes) splits its batch over XLA's intra-op thread pool from inside a pool thread
   and waits for the pieces. When as many such kernels run at once as the pool has threads (two host devices
   on two cores, or independent branches of one program), every thread waits for work only a waiting thread
   could do, and the program never finishes. Workaround: :func:`per_item_on_cpu` runs a batch one item at a
   time on the CPU, so that every LAPACK call inside is unbatched. Checked with the probe
   ``state_space_parallel`` (the parallel-in-time filter with every solve batched): it stalls on jaxlib 0.10.2
   and finishes on jaxlib 0.12.0.1; 0.11 was not checked, so the range ends at 0.12.0.
   (:func:`msrm.gp.linalg.small_cholesky`, used for the K x K node factors, makes no LAPACK call at all for
   small K; it is not gated, since it is also cheaper than a LAPACK call per node.)
2. **The LAPACK host callback needs two CPUs** (:data:`CALLBACK_NEEDS_TWO_CPUS`). With one usable CPU
   XLA's intra-op pool has a single worker, and a ``jax.pure_callback``, which runs on it, can wait forever
   for its own operands. Workaround: ``method="auto"`` resolves to the native path on one CPU
   (:func:`msrm.gp.linalg.resolve_method`). The probe ``callback_one_cpu`` (value and gradient of the callback
   under ``taskset -c 0``) finished on both jaxlib 0.10.2 and 0.12.0.1: it does not reproduce the stall, so it
   cannot show a fix, and the range stays open.
3. **The LAPACK host callback across several host devices** (:data:`CALLBACK_ACROSS_DEVICES_CAN_DEADLOCK`).
   With runs sharded over two host devices, both device threads can wait inside the callback while their
   arguments are being transferred. Workaround: on a mesh the factorization is the native one
   (:func:`msrm.gp.multirun.mesh_method`). The probe ``callback_across_devices`` (the callback inside
   ``jax.shard_map`` on two host devices) finished on both jaxlib 0.10.2 and 0.12.0.1, so as for 2 the range
   stays open.
"""
from __future__ import annotations

import re

import jax
import jaxlib.version
import numpy as np
from jax import lax

__all__ = [
    "JAXLIB_VERSION",
    "AFFECTED",
    "affected",
    "BATCHED_CPU_LAPACK_CAN_DEADLOCK",
    "CALLBACK_NEEDS_TWO_CPUS",
    "CALLBACK_ACROSS_DEVICES_CAN_DEADLOCK",
    "per_item_on_cpu",
]


def parse_version(text: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` from a version string such as ``"0.10.2"`` or ``"0.10.3.dev20260101"``."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"cannot read a jaxlib version from {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


#: The installed jaxlib, parsed once.
JAXLIB_VERSION: tuple[int, int, int] = parse_version(jaxlib.version.__version__)

#: Per workaround: (first affected version, first fixed version or None when no fix is known).
AFFECTED: dict[str, tuple[tuple[int, int, int], tuple[int, int, int] | None]] = {
    "batched_cpu_lapack": ((0, 10, 0), (0, 12, 0)),
    "callback_one_cpu": ((0, 10, 0), None),
    "callback_across_devices": ((0, 10, 0), None),
}


def affected(name: str, version: tuple[int, int, int] = JAXLIB_VERSION) -> bool:
    """Whether jaxlib ``version`` (default: the installed one) lies in the range of workaround ``name``."""
    first, fixed = AFFECTED[name]
    return first <= tuple(version) and (fixed is None or tuple(version) < fixed)


BATCHED_CPU_LAPACK_CAN_DEADLOCK: bool = affected("batched_cpu_lapack")
CALLBACK_NEEDS_TWO_CPUS: bool = affected("callback_one_cpu")
CALLBACK_ACROSS_DEVICES_CAN_DEADLOCK: bool = affected("callback_across_devices")


def per_item_on_cpu(fn, *args, batch_ndim: int = 1, batched: bool = True):
    """``fn`` over arrays whose leading ``batch_ndim`` axes are a batch.

    ``batched=True``: ``fn`` accepts any number of leading axes (``...`` broadcasting, batched ``jnp.linalg``
    calls); ``batched=False``: ``fn`` takes one item, and is vectorised with ``jax.vmap`` where that is wanted.
    On accelerators the whole batch goes through one call. On XLA:CPU, with a jaxlib whose batched LAPACK
    kernels can deadlock the intra-op pool (:data:`BATCHED_CPU_LAPACK_CAN_DEADLOCK`, module docstring), the
    batch is flattened and ``fn`` runs on one item at a time (``lax.map``), so that every LAPACK call inside it
    is unbatched. The platform is read at trace time (``jax.default_backend()``).
    """
    if batch_ndim == 0:
        return fn(*args)
    leaves = jax.tree_util.tree_leaves(args)
    batch = leaves[0].shape[:batch_ndim]
    if any(x.shape[:batch_ndim] != batch for x in leaves):  # checked on every path, before any numerics
        raise ValueError(f"per_item_on_cpu: every argument needs the batch shape {batch}")
    if jax.default_backend() != "cpu" or not BATCHED_CPU_LAPACK_CAN_DEADLOCK:
        if batched:
            return fn(*args)
        for _ in range(batch_ndim):
            fn = jax.vmap(fn)
        return fn(*args)
    size = int(np.prod(batch)) if batch else 1
    flat = jax.tree_util.tree_map(lambda x: x.reshape((size,) + x.shape[batch_ndim:]), args)
    out = lax.map(lambda a: fn(*a), flat)
    return jax.tree_util.tree_map(lambda y: y.reshape(batch + y.shape[1:]), out)
