r"""GP prior kernels of the latent factors: one class per kernel, holding every form the models use.

Each factor ``k`` has a unit-variance stationary prior ``Cov(z(t), z(t + r)) = k(r; l_k)``. A kernel class
holds, for its name:

* the correlation ``k(r; l)`` for NumPy or JAX arrays (``xp=numpy`` or ``xp=jax.numpy``): the dense and
  grouped likelihoods, the brute-force reference, R-MSRM's lengthscale estimate and the synthetic study use it;
* the SDE form for the state-space filter: the number of states per factor, the feedback matrix ``F`` and the
  stationary covariance ``P_inf`` (:mod:`msrm.gp.state_space.sde` discretises them exactly on the grid).

Half-integer Matérn kernels, ``nu = p + 1/2``, with ``x = lambda r``, ``lambda = sqrt(2 nu) / l``:

.. math::

    k(r) = e^{-x} \sum_{n=0}^{p} c_n x^n, \qquad
    c_n = \frac{p!}{(2p)!} \frac{(2p - n)!}{n! (p - n)!} 2^n,

so ``matern12``: 1; ``matern32``: ``1 + x``; ``matern52``: ``1 + x + x^2/3``. Each is the first component of the ``p + 1``-state linear SDE in companion form
``s = (z, z', ..., z^{(p)})`` whose characteristic polynomial is ``(x + lambda)^{p+1}``; its stationary
covariance holds the kernel's derivatives at 0, ``P_inf[i, j] = (-1)^j k^{(i+j)}(0)`` (zero when ``i + j`` is
odd). Both follow from ``p`` alone, so a new half-integer Matérn kernel is its class and one registry line.

A new kernel of another family subclasses :class:`Kernel` and supplies ``correlation``, ``n_states``,
``companion`` and ``stationary_cov`` (the state-space backend needs a companion form whose characteristic
polynomial is ``(x + rate)^n_states``; :mod:`msrm.gp.state_space.sde` relies on it for its closed-form
transition).
"""
from __future__ import annotations

import math
from fractions import Fraction
from functools import cached_property

import numpy as np

__all__ = ["Kernel", "HalfIntegerMatern", "KERNELS", "register_kernel", "get_kernel"]


class Kernel:
    """A unit-variance stationary kernel of the latent factors (see the module docstring).

    Attributes:
        name: the ``ModelSpec.kernel`` string that selects it.
        n_states: SDE states per factor (state-space backend).
    """

    name: str = ""
    n_states: int = 0

    def correlation(self, r, lengthscale, xp=np):
        """``k(r; l)`` for distances ``r >= 0`` (any shape) and a broadcastable lengthscale ``l > 0``."""
        raise NotImplementedError

    def rate(self, lengthscale):
        """``lambda``, the root of the SDE's characteristic polynomial ``(x + lambda)^n_states``."""
        raise NotImplementedError

    def companion(self, lengthscale, xp=np):
        """Feedback matrix ``F`` (n_states, n_states) of the SDE."""
        raise NotImplementedError

    def stationary_cov(self, lengthscale, xp=np):
        """Stationary covariance ``P_inf`` (n_states, n_states) of the SDE."""
        raise NotImplementedError

    @cached_property
    def half_distance(self) -> float:
        """``c`` with ``k(c; 1) = 1/2``: a factor's correlation falls to one half at ``c l``."""
        from scipy.optimize import brentq

        return float(brentq(lambda s: float(self.correlation(np.float64(s), 1.0)) - 0.5, 1e-6, 50.0))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class HalfIntegerMatern(Kernel):
    """Matérn ``nu = p + 1/2``: correlation, companion form and stationary covariance from ``p`` (module
    docstring). Subclasses set ``name`` and ``p``."""

    p: int = 0

    @property
    def n_states(self) -> int:  # type: ignore[override]
        return self.p + 1

    @cached_property
    def coefficients(self) -> tuple[float, ...]:
        """``c_0 .. c_p`` of ``k = e^{-x} sum_n c_n x^n`` (exact rationals, then float)."""
        p = self.p
        scale = Fraction(math.factorial(p), math.factorial(2 * p))
        return tuple(float(scale * Fraction(math.factorial(2 * p - n) * 2**n, math.factorial(n) * math.factorial(p - n)))
                     for n in range(p + 1))

    @cached_property
    def derivatives_at_zero(self) -> tuple[float, ...]:
        """``k^{(n)}(0)`` for ``n = 0 .. 2p`` at ``lambda = 1`` (odd ones are 0): ``n!`` times the Taylor
        coefficients of ``e^{-x} sum_m c_m x^m``, computed in exact rationals."""
        p = self.p
        scale = Fraction(math.factorial(p), math.factorial(2 * p))
        c = [scale * Fraction(math.factorial(2 * p - n) * 2**n, math.factorial(n) * math.factorial(p - n))
             for n in range(p + 1)]
        out = []
        for n in range(2 * p + 1):
            # coefficient of x^n in e^{-x} poly(x): sum_m c_m (-1)^(n-m) / (n-m)!
            b = sum(c[m] * Fraction((-1) ** (n - m), math.factorial(n - m)) for m in range(min(n, p) + 1))
            out.append(float(b * math.factorial(n)))
        return tuple(out)

    def rate(self, lengthscale):
        return math.sqrt(2 * self.p + 1) / lengthscale

    def correlation(self, r, lengthscale, xp=np):
        x = math.sqrt(2 * self.p + 1) * r / lengthscale  # lambda r
        c = self.coefficients
        poly = c[-1]
        for cn in c[-2::-1]:  # Horner
            poly = cn + x * poly
        return poly * xp.exp(-x)

    def companion(self, lengthscale, xp=np):
        d = self.n_states
        lam = self.rate(lengthscale)
        zero, one = 0.0 * lam, 1.0 + 0.0 * lam
        rows = [xp.stack([one if j == i + 1 else zero for j in range(d)]) for i in range(d - 1)]
        rows.append(xp.stack([-math.comb(d, j) * lam ** (d - j) for j in range(d)]))
        return xp.stack(rows)

    def stationary_cov(self, lengthscale, xp=np):
        d = self.n_states
        lam = self.rate(lengthscale)
        m = self.derivatives_at_zero
        zero = 0.0 * lam

        def entry(i, j):
            n = i + j
            if n % 2:
                return zero
            if n == 0:
                return 1.0 + zero
            return ((-1) ** j * m[n]) * lam**n

        return xp.stack([xp.stack([entry(i, j) for j in range(d)]) for i in range(d)])


class Matern12(HalfIntegerMatern):
    """Matérn-1/2 (exponential): ``k(r) = e^{-r/l}``; one SDE state."""

    name, p = "matern12", 0


class Matern32(HalfIntegerMatern):
    """Matérn-3/2: ``k(r) = (1 + sqrt3 r/l) e^{-sqrt3 r/l}``; two SDE states."""

    name, p = "matern32", 1


class Matern52(HalfIntegerMatern):
    """Matérn-5/2: ``k(r) = (1 + sqrt5 r/l + 5 r^2/(3 l^2)) e^{-sqrt5 r/l}``; three SDE states."""

    name, p = "matern52", 2


class Matern72(HalfIntegerMatern):
    """Matérn-7/2: ``k(r) = (1 + sqrt7 r/l + 14 r^2/(5 l^2) + 7 sqrt7 r^3/(15 l^3)) e^{-sqrt7 r/l}``; four SDE
    states."""

    name, p = "matern72", 3


KERNELS: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel) -> Kernel:
    """Add a kernel to the registry under ``kernel.name`` (an existing name is an error)."""
    if not isinstance(kernel, Kernel) or not kernel.name:
        raise ValueError(f"register_kernel takes a Kernel instance with a name, got {kernel!r}")
    if kernel.name in KERNELS:
        raise ValueError(f"kernel {kernel.name!r} is already registered")
    KERNELS[kernel.name] = kernel
    return kernel


def get_kernel(name: str) -> Kernel:
    """The registered kernel called ``name``; ValueError naming the known kernels otherwise."""
    try:
        return KERNELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {name!r}") from None


register_kernel(Matern12())
register_kernel(Matern32())
register_kernel(Matern52())
register_kernel(Matern72())
