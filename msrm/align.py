r"""Alignment of latent factors: one K x K transform that maps estimated latents onto a reference.

Latent-factor models identify their factors only up to a transform. R-MSRM fixes a convention (centred, whitened,
ordered by signal) but a rotation of (Z, W) leaves its fit unchanged, so comparing R-MSRM latents with the truth
or with another fit needs the best **orthogonal** map (Procrustes). GP-MSRM with distinct lengthscales identifies
its factors up to **sign and order** only (each factor's prior is its own), so a signed permutation is the right
map there; a rotation would mix factors whose priors differ.

:func:`align` finds T (K x K) with ``(Z - c) T + o ~ reference``:

- ``"procrustes"``: T = argmin over orthogonal T of ``||(Z - c) T - (R - o)||_F``
  (``scipy.linalg.orthogonal_procrustes``, reflections included, so signs are free too);
- ``"signed_permutation"``: the assignment of latent factors to reference factors that maximises the summed
  absolute correlation (``scipy.optimize.linear_sum_assignment``), then each factor's sign is the sign of its
  correlation with the reference factor it is assigned to;
- ``"auto"``: signed permutation for :class:`~msrm.LatentPosterior` input (GP-MSRM), Procrustes for arrays.

**Centring.** Both models identify the latents' mean only together with the intercepts (``Z -> Z + 1 m^T,
b -> b - W m`` is exact in R-MSRM; in GP-MSRM the prior mean is zero but a finite run's mean is not), so a
comparison with the truth compares *centred* latents. With ``center=True`` (the default for Procrustes) T is
fitted to the centred latents and centred reference (means pooled over all runs): ``c`` is the latents' mean and
``o`` the reference's, so the aligned latents ``(Z - c) T + o`` have the reference's mean. With ``center=False``
(the default for a signed permutation: a permutation and sign flips map a zero-mean prior onto itself, and
nothing is shifted) ``c = o = 0`` and T is fitted to the raw values. Correlations for the signed permutation are
always those of centred columns (their definition).

Several runs (a list of arrays) are aligned with ONE transform fitted to all their grid points together: the
factors are shared by the runs, so a per-run transform would be wrong.

The same transform applies to the other side of the factorisation: ``y = b + W z`` is unchanged when
``z' = (z - c) T + o``, ``W' = W T^{-T}`` (for an orthogonal T, ``W T``) and ``b' = b + W c - W' o``
(:meth:`Alignment.apply_loadings`, :meth:`Alignment.apply_intercepts`). A LatentPosterior's mean maps like the
latents; its marginal sd maps exactly under a signed permutation (|T| permutes it); under a general rotation the
marginal sd of ``z T`` needs the K x K covariance at each grid point (``sd'^2 = diag(T^T C T)``), so a posterior
without ``cov`` is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.linalg import orthogonal_procrustes
from scipy.optimize import linear_sum_assignment

from .latent import LatentPosterior

__all__ = ["align", "Alignment", "METHODS", "signed_permutation"]

METHODS = ("auto", "procrustes", "signed_permutation")


@dataclass(frozen=True, eq=False)
class Alignment:
    """The result of :func:`align`.

    Fields:
        latents: the aligned latents, in the form they were given (a (J, K) array, a list of them, a
            LatentPosterior or a list of those).
        transform: (K, K) T with ``aligned = (latents - center) @ T + offset``.
        method: ``"procrustes"`` or ``"signed_permutation"``.
        center: (K,) the mean subtracted from the latents (zeros when not centred).
        offset: (K,) the reference mean added back (zeros when not centred).
        loadings: the aligned loadings when ``align(..., loadings=...)`` was given them, else None.
    """

    latents: Any
    transform: np.ndarray
    method: str
    center: np.ndarray
    offset: np.ndarray
    loadings: Any = None

    @property
    def permutation(self) -> np.ndarray | None:
        """For a signed permutation, ``perm`` with aligned factor l = sign_l * latent factor ``perm[l]``; else
        None."""
        if self.method != "signed_permutation":
            return None
        return np.argmax(np.abs(self.transform), axis=0)

    @property
    def signs(self) -> np.ndarray | None:
        """For a signed permutation, the (K,) signs (+1 / -1) of the aligned factors; else None."""
        if self.method != "signed_permutation":
            return None
        return self.transform[self.permutation, np.arange(self.transform.shape[1])]

    def apply(self, latents):
        """The same transform on other latents: a (J, K) array, a list of them, a LatentPosterior or a list."""
        if isinstance(latents, (list, tuple)):
            return [self.apply(z) for z in latents]
        if isinstance(latents, LatentPosterior):
            return self._apply_posterior(latents)
        z = _as_latents(latents, "latents")
        _check_k(z.shape[1], self.transform.shape[0], "latents")
        return (z - self.center) @ self.transform + self.offset

    def _apply_posterior(self, post: LatentPosterior) -> LatentPosterior:
        T = self.transform
        _check_k(post.n_factors, T.shape[0], "LatentPosterior")
        mean = (post.mean - self.center) @ T + self.offset
        cov = None
        if post.cov is not None:
            cov = np.einsum("ki,jkl,lm->jim", T, post.cov, T)  # T^T C_j T at each grid point j
        if self.method == "signed_permutation":
            sd = post.sd @ np.abs(T)  # |T| is a permutation matrix: the sd permutes
        elif cov is not None:
            sd = np.sqrt(np.maximum(np.einsum("jkk->jk", cov), 0.0))
        else:
            raise ValueError("Alignment.apply: a rotation mixes factors, so the aligned marginal sd needs the "
                             "posterior covariance; get it with model.latent_posterior(params, cov=True)")
        return LatentPosterior(grid=post.grid, mean=mean, sd=sd, cov=cov)

    def apply_loadings(self, loadings):
        """``W -> W T^{-T}`` (``W T`` for an orthogonal T): an (F, K) array or a dict of them (stream key -> W)."""
        if isinstance(loadings, dict):
            return {k: self.apply_loadings(W) for k, W in loadings.items()}
        W = np.asarray(loadings, dtype=np.float64)
        if W.ndim != 2:
            raise ValueError(f"loadings must be (n_features, K), got shape {W.shape}")
        _check_k(W.shape[1], self.transform.shape[0], "loadings")
        return np.linalg.solve(self.transform, W.T).T  # W T^{-T} = (T^{-1} W^T)^T

    def apply_intercepts(self, intercepts, loadings):
        """``b -> b + W c - W' o`` with W the loadings before alignment and ``W' = apply_loadings(W)``, so that
        ``b + W z = b' + W' z'``; arrays (F,), (F, K) or dicts of them keyed alike."""
        if isinstance(intercepts, dict):
            return {k: self.apply_intercepts(b, loadings[k]) for k, b in intercepts.items()}
        W = np.asarray(loadings, dtype=np.float64)
        return np.asarray(intercepts, dtype=np.float64) + W @ self.center - self.apply_loadings(W) @ self.offset


def _check_k(got: int, want: int, what: str) -> None:
    if got != want:
        raise ValueError(f"{what}: {got} factors, but the alignment is for K = {want}")


def _as_latents(z, name: str) -> np.ndarray:
    if isinstance(z, LatentPosterior):
        z = z.mean
    arr = np.asarray(z, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name}: expected a (J, K) array, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: contains non-finite values (NaN or inf)")
    return arr


def _runs(x, name: str) -> tuple[list[np.ndarray], bool]:
    """(list of (J_r, K) arrays, whether x was a list)."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{name}: an empty list")
        return [_as_latents(z, f"{name}[{r}]") for r, z in enumerate(x)], True
    return [_as_latents(x, name)], False


def signed_permutation(corr: np.ndarray) -> np.ndarray:
    """The signed permutation T (K, K) maximising ``sum_l |corr[perm_l, l]|`` (linear_sum_assignment), with
    ``T[perm_l, l] = sign(corr[perm_l, l])`` (+1 for an exact zero): rows are the factors being aligned, columns
    the reference's."""
    corr = np.asarray(corr, dtype=np.float64)
    rows, cols = linear_sum_assignment(-np.abs(corr))
    T = np.zeros_like(corr)
    s = np.sign(corr[rows, cols])
    T[rows, cols] = np.where(s == 0, 1.0, s)
    return T


def align(latents, reference, *, method: str = "auto", loadings=None, center: bool | None = None) -> Alignment:
    """Map latents onto a reference with one K x K transform (module docstring).

    Args:
        latents: (J, K) array, a list of them (several runs, one transform), a LatentPosterior or a list of them.
        reference: the same structure (arrays or LatentPosteriors, whose means are used): same number of runs,
            same J per run, same K.
        method: ``"auto"``, ``"procrustes"`` or ``"signed_permutation"``.
        loadings: optional loadings of ``latents`` ((F, K) array or dict of them) to align with the same transform
            (``Alignment.loadings``).
        center: fit T to centred latents and reference (see the module docstring); None takes True for Procrustes
            and False for a signed permutation.
    Returns:
        :class:`Alignment`.
    Raises:
        ValueError: an unknown method; different numbers of runs, grid lengths or factors; non-finite values; a
            rotation of a LatentPosterior without covariance.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    Z, z_list = _runs(latents, "latents")
    R, r_list = _runs(reference, "reference")
    if len(Z) != len(R):
        raise ValueError(f"latents have {len(Z)} runs but reference has {len(R)}")
    for r, (z, ref) in enumerate(zip(Z, R)):
        if z.shape[0] != ref.shape[0]:
            raise ValueError(f"run {r}: latents have {z.shape[0]} grid points but reference has {ref.shape[0]}")
        if z.shape[1] != ref.shape[1]:
            raise ValueError(f"run {r}: latents have K = {z.shape[1]} factors but reference has K = {ref.shape[1]}")
    if method == "auto":
        first = latents[0] if z_list else latents
        method = "signed_permutation" if isinstance(first, LatentPosterior) else "procrustes"
    if center is None:
        center = method == "procrustes"
    allz, allr = np.concatenate(Z, axis=0), np.concatenate(R, axis=0)
    K = allz.shape[1]
    c = allz.mean(axis=0) if center else np.zeros(K)
    o = allr.mean(axis=0) if center else np.zeros(K)
    if method == "procrustes":
        T, _ = orthogonal_procrustes(allz - c, allr - o)
    else:
        zc, rc = allz - allz.mean(axis=0), allr - allr.mean(axis=0)
        norms = np.outer(np.linalg.norm(zc, axis=0), np.linalg.norm(rc, axis=0))
        if np.any(norms == 0):
            raise ValueError("signed_permutation: a factor is constant, so its correlation is undefined")
        T = signed_permutation(zc.T @ rc / norms)
    result = Alignment(latents=None, transform=T, method=method, center=c, offset=o)
    aligned = result.apply(list(latents) if z_list else latents)
    aligned_loadings = None if loadings is None else result.apply_loadings(loadings)
    return Alignment(latents=aligned, transform=T, method=method, center=c, offset=o, loadings=aligned_loadings)
