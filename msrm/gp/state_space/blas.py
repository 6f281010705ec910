"""The host filter's BLAS entry points: one BLAS thread while it runs, and the in-place ``dgemm`` its covariance
updates use (:mod:`.host`)."""
from __future__ import annotations

import ctypes
import functools

import numpy as np

__all__ = ["one_blas_thread", "gemm_acc"]


def one_blas_thread():
    """Context: BLAS on one thread while the host filter runs (:func:`msrm.runtime.blas_limit`, which also works
    from JAX's callback threads). Its products are small (S x S x M K), too small to split across threads: with
    OpenBLAS's own worker threads waking beside XLA's thread pool, the wake-ups and the contention for cores
    cost more than the products themselves."""
    from ... import runtime

    return runtime.blas_limit(1)


@functools.lru_cache(maxsize=1)
def _dgemm():
    """SciPy's BLAS ``dgemm`` (the Fortran symbol ``scipy.linalg.cython_blas`` exports) as a ctypes function.

    ``scipy.linalg.blas.dgemm`` holds the GIL while it runs; a ctypes call releases it, so the reverse pass's
    recomputation on a second thread (:meth:`msrm.gp.state_space.host.HostFilter.backward`) runs beside the first one's BLAS calls."""
    from scipy.linalg import cython_blas

    cap = cython_blas.__pyx_capi__["dgemm"]
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    ptr = ctypes.pythonapi.PyCapsule_GetPointer
    ptr.restype, ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    i, d, v = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_double), ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, i, i, i, d, v, i, v, i, d, v, i)
    return proto(ptr(cap, name(cap)))


def gemm_acc(alpha: float, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    """``c += alpha a @ b`` in place by one ``dgemm`` (beta = 1), without holding the GIL.

    All three are float64 and Fortran-contiguous (a transposed C-order array is): a (m, k), b (k, n), c (m, n).
    """
    (m, k), n = a.shape, b.shape[1]
    for x, name in ((a, "a"), (b, "b"), (c, "c")):
        if x.dtype != np.float64 or not x.flags.f_contiguous:
            raise ValueError(f"gemm_acc: {name} must be Fortran-contiguous float64")
    if b.shape[0] != k or c.shape != (m, n):
        raise ValueError(f"gemm_acc: shapes {a.shape} @ {b.shape} -> {c.shape} do not match")
    ref = ctypes.byref
    I, D = ctypes.c_int, ctypes.c_double
    _dgemm()(b"N", b"N", ref(I(m)), ref(I(n)), ref(I(k)), ref(D(alpha)), a.ctypes.data, ref(I(max(m, 1))),
             b.ctypes.data, ref(I(max(k, 1))), ref(D(1.0)), c.ctypes.data, ref(I(max(m, 1))))
