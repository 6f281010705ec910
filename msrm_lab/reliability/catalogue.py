"""A catalogue of bad inputs: each case builds something wrong and names the error it must raise.

Every case states the exception type and a regular expression the message must match (the offending stream,
key or argument, and the problem). The catalogue is run by the test suite and by the reliability notebook, which
records how many inputs were tried and how many raised the documented error before any numerics.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np

import msrm

__all__ = ["BadInput", "foundation_cases", "argument_cases", "all_cases", "run_catalogue"]


@dataclass(frozen=True)
class BadInput:
    """One bad input: ``build()`` must raise ``error`` with a message matching ``match``."""

    area: str
    name: str
    build: Callable[[], object]
    error: type
    match: str


def _stream(**kw):
    base = dict(participant="p1", modality="brain", dt=1.0, values=np.ones((5, 2)), offset=0.0)
    base.update(kw)
    return msrm.Stream(**base)


def _spec(**kw):
    base = dict(
        n_factors=2,
        latent_dt=1.0,
        responses={
            "brain": msrm.Identity(),
            "rating": msrm.GaussianLag(width=1.0, lag_bounds=(0.0, 3.0)),
            "physio": msrm.GaussianWidthLag(lag_bounds=(0.0, 3.0), width_bounds=(0.5, 1.5)),
        },
    )
    base.update(kw)
    return msrm.ModelSpec(**base)


def _tiny():
    import data_synth

    return data_synth.synthetic_dataset("tiny", n_features=3, seed=0)


def _with_nan_feature():
    v = np.ones((5, 3))
    v[:, 1] = np.nan
    return _stream(values=v)


def _with_inf():
    v = np.ones((5, 2))
    v[2, 1] = np.inf
    return _stream(values=v)


def _params_change(field: str, fn):
    data, truth = _tiny()
    p = truth.params
    value = fn(getattr(p, field))
    return p.replace(**{field: value}).validate(data, truth.spec)


def _dict_set(d, key, value):
    d = dict(d)
    d[key] = value
    return d


def _dict_drop(d, key):
    d = dict(d)
    d.pop(key)
    return d


def _features_differ():
    s1 = _stream(values=np.ones((5, 2)))
    s2 = _stream(values=np.ones((5, 3)))
    return msrm.Dataset([msrm.Run(10.0, [s1]), msrm.Run(10.0, [s2])])


def _no_response():
    data = msrm.Dataset([msrm.Run(10.0, [_stream(modality="eyetrack")])])
    return msrm.response_groups(data, _spec())


def foundation_cases() -> list[BadInput]:
    """Bad inputs of the data model, the spec and Params: each must raise a named error before any numerics."""
    P = "Params"
    cases = [
        BadInput("Stream", "dt zero", lambda: _stream(dt=0.0), ValueError, r"p1/brain.*dt must be finite and > 0"),
        BadInput("Stream", "dt negative", lambda: _stream(dt=-1.8), ValueError, r"p1/brain.*dt"),
        BadInput("Stream", "dt nan", lambda: _stream(dt=float("nan")), ValueError, r"p1/brain.*dt"),
        BadInput("Stream", "dt inf", lambda: _stream(dt=float("inf")), ValueError, r"p1/brain.*dt"),
        BadInput("Stream", "offset negative", lambda: _stream(offset=-0.5), ValueError, r"p1/brain.*offset must be"),
        BadInput("Stream", "values 1-D", lambda: _stream(values=np.ones(5)), ValueError, r"p1/brain.*must be 2-D"),
        BadInput("Stream", "values 3-D", lambda: _stream(values=np.ones((5, 2, 2))), ValueError, r"p1/brain.*2-D"),
        BadInput("Stream", "empty stream", lambda: _stream(values=np.ones((0, 2))), ValueError, r"p1/brain.*empty"),
        BadInput("Stream", "no features", lambda: _stream(values=np.ones((5, 0))), ValueError, r"p1/brain.*empty"),
        BadInput("Stream", "all-NaN feature", _with_nan_feature, ValueError, r"p1/brain.*feature\(s\) \[1\].*all NaN"),
        BadInput("Stream", "inf value", _with_inf, ValueError, r"p1/brain.*inf"),
        BadInput("Stream", "string values", lambda: _stream(values=np.array([["a"]])), ValueError, r"p1/brain.*numeric"),
        BadInput("Run", "samples beyond duration", lambda: msrm.Run(3.0, [_stream()]), ValueError,
                 r"p1/brain.*beyond the run's duration"),
        BadInput("Run", "duplicate stream", lambda: msrm.Run(10.0, [_stream(), _stream()]), ValueError,
                 r"p1/brain.*duplicate"),
        BadInput("Run", "duration zero", lambda: msrm.Run(0.0, [_stream()]), ValueError, r"duration"),
        BadInput("Dataset", "features differ between runs", _features_differ, ValueError,
                 r"p1/brain.*3 features in run 1 but 2"),
        BadInput("Dataset", "no runs", lambda: msrm.Dataset([]), ValueError, r"at least one run"),
        BadInput("ModelSpec", "modality without response", _no_response, KeyError, r"p1/eyetrack.*no response"),
        BadInput("ModelSpec", "n_factors zero", lambda: _spec(n_factors=0), ValueError, r"n_factors"),
        BadInput("ModelSpec", "latent_dt zero", lambda: _spec(latent_dt=0.0), ValueError, r"latent_dt"),
        BadInput("ModelSpec", "unknown kernel", lambda: _spec(kernel="rbf"), ValueError, r"kernel"),
        BadInput("ModelSpec", "unknown pooling", lambda: _spec(pooling="partial"), ValueError, r"pooling"),
        BadInput("ModelSpec", "lag bounds reversed", lambda: msrm.GaussianLag(width=1.0, lag_bounds=(5.0, 1.0)),
                 ValueError, r"lag_bounds must have low < high"),
        BadInput("ModelSpec", "width bounds equal",
                 lambda: msrm.GaussianWidthLag(lag_bounds=(0, 1), width_bounds=(2.0, 2.0)), ValueError,
                 r"width_bounds must have low < high"),
        BadInput("ModelSpec", "width non-positive", lambda: msrm.GaussianLag(width=0.0), ValueError, r"width"),
        BadInput(P, "missing loadings key", lambda: _params_change("loadings", lambda d: _dict_drop(d, "p1/brain")),
                 KeyError, r"loadings.*missing.*p1/brain"),
        BadInput(P, "unknown loadings key",
                 lambda: _params_change("loadings", lambda d: _dict_set(d, "p9/brain", np.ones((3, 3)))),
                 KeyError, r"loadings.*unknown.*p9/brain"),
        BadInput(P, "loadings wrong shape",
                 lambda: _params_change("loadings", lambda d: _dict_set(d, "p1/brain", np.ones((3, 5)))),
                 ValueError, r"loadings\['p1/brain'\].*shape"),
        BadInput(P, "intercepts wrong shape",
                 lambda: _params_change("intercepts", lambda d: _dict_set(d, "p3/rating", np.ones(2))),
                 ValueError, r"intercepts\['p3/rating'\].*shape"),
        BadInput(P, "noise non-positive",
                 lambda: _params_change("noise_sd", lambda d: _dict_set(d, "p2/brain", np.array([1.0, 0.0, 1.0]))),
                 ValueError, r"noise_sd\['p2/brain'\].*> 0"),
        BadInput(P, "lengthscale non-positive", lambda: _params_change("lengthscales", lambda v: -np.abs(v)),
                 ValueError, r"lengthscales.*> 0"),
        BadInput(P, "lengthscales wrong length", lambda: _params_change("lengthscales", lambda v: np.ones(5)),
                 ValueError, r"lengthscales.*shape"),
        BadInput(P, "lag outside bounds",
                 lambda: _params_change("response", lambda d: _dict_set(d, "rating", {"lag": 9.0})),
                 ValueError, r"response\['rating'\].*lag=9.0.*outside"),
        BadInput(P, "width outside bounds",
                 lambda: _params_change("response", lambda d: _dict_set(d, "physio", {"lag": 1.0, "width": 5.0})),
                 ValueError, r"response\['physio'\].*width=5.0.*outside"),
        BadInput(P, "unknown response key",
                 lambda: _params_change("response", lambda d: _dict_set(d, "p3/rating", {"lag": 1.0})),
                 KeyError, r"response.*unknown.*p3/rating"),
        BadInput(P, "missing response parameter",
                 lambda: _params_change("response", lambda d: _dict_set(d, "physio", {"lag": 1.0})),
                 KeyError, r"physio.*missing response parameter.*width"),
        BadInput(P, "non-finite loadings",
                 lambda: _params_change("loadings", lambda d: _dict_set(d, "p1/brain", np.full((3, 3), np.nan))),
                 ValueError, r"loadings\['p1/brain'\].*non-finite"),
    ]
    return cases


def _tiny_model():
    import msrm

    data, truth = _tiny()
    return msrm.GPMSRM(data, truth.spec)


def _fit(**kw):
    data, truth = _tiny()
    return msrm.fit_rmsrm(data, truth.spec, progress=False, **kw)


def _garbage_file(name: str) -> str:
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / name
    path.write_bytes(b"not an archive")
    return str(path)


def _load_rfit(path):
    from msrm.rmsrm import load_rfit

    return load_rfit(path)


def _load_map(path):
    from msrm.gp.map import load_map

    return load_map(path)


def _load_netcdf(path):
    from msrm.gp.idata import load_netcdf

    return load_netcdf(path)


def _run_notebooks(**kw):
    import tempfile

    from msrm_lab.notebooks.runner import run_notebooks

    return run_notebooks(results=tempfile.mkdtemp(), **kw)


def argument_cases() -> list[BadInput]:
    """Bad arguments to the fits and samplers, bad notebook parameters and unreadable archives."""
    return [
        BadInput("fit_rmsrm", "restarts zero", lambda: _fit(restarts=0), ValueError, r"restarts must be"),
        BadInput("fit_rmsrm", "max_iter negative", lambda: _fit(max_iter=-1), ValueError, r"max_iter must be"),
        BadInput("fit_rmsrm", "unknown objective", lambda: _fit(objective="fast"), ValueError, r"objective.*'fast'"),
        BadInput("fit_rmsrm", "unknown latent solver", lambda: _fit(latent_solver="lu"), ValueError,
                 r"latent_solver.*'lu'"),
        BadInput("fit_rmsrm", "unknown backend", lambda: _fit(backend="mpi"), ValueError, r"backend.*'mpi'"),
        BadInput("GPMSRM", "unknown linear algebra", lambda: msrm.GPMSRM(_tiny()[0], _tiny()[1].spec, linear_algebra="cholesky"), ValueError,
                 r"linear_algebra.*'cholesky'"),
        BadInput("GPMSRM", "unknown factorization method",
                 lambda: msrm.GPMSRM(_tiny()[0], _tiny()[1].spec, method="gpu"), ValueError, r"method.*'gpu'"),
        BadInput("GPMSRM", "parameter vector of the wrong length", lambda: _tiny_model().value_and_grad(np.zeros(3)),
                 ValueError, r"u must have shape"),
        BadInput("sample", "unknown chain method",
                 lambda: _tiny_model().sample(num_warmup=2, num_samples=2, chain_method="threads", progress=False),
                 ValueError, r"chain_method.*'threads'"),
        BadInput("sample", "zero draws", lambda: _tiny_model().sample(num_warmup=2, num_samples=0, progress=False),
                 ValueError, r"num_samples must be"),
        BadInput("sample", "unknown init", lambda: _tiny_model().sample(num_warmup=2, num_samples=2, init="median",
                                                                         progress=False),
                 ValueError, r"init must be"),
        BadInput("fit_map", "zero iterations", lambda: _tiny_model().fit_map(maxiter=0, progress=False), ValueError,
                 r"maxiter must be"),
        BadInput("fit_map", "unknown optimizer", lambda: _tiny_model().fit_map(method="adam", progress=False),
                 ValueError, r"method.*'adam'"),
        BadInput("archive", "R-MSRM archive that is not an npz", lambda: _load_rfit(_garbage_file("fit.npz")),
                 ValueError, r"load_rfit.*not a readable"),
        BadInput("archive", "R-MSRM archive that does not exist", lambda: _load_rfit("/nonexistent/fit.npz"),
                 ValueError, r"load_rfit: no archive"),
        BadInput("archive", "MAP archive without its JSON", lambda: _load_map(_garbage_file("map.npz")),
                 FileNotFoundError, r"MAP archive .*json not found"),
        BadInput("archive", "posterior archive that is not NetCDF", lambda: _load_netcdf(_garbage_file("post.nc")),
                 ValueError, r"posterior archive .*post.nc is not a readable NetCDF"),
        BadInput("notebooks", "unknown profile", lambda: _run_notebooks(profile="huge"), ValueError, r"profile"),
    ]


def all_cases() -> list[BadInput]:
    return foundation_cases() + argument_cases()


def run_catalogue(cases: list[BadInput]) -> list[dict]:
    """Run each case; report whether it raised the documented error with a matching message."""
    out = []
    for case in cases:
        rec = {"area": case.area, "name": case.name, "expected": case.error.__name__}
        try:
            case.build()
        except case.error as exc:  # noqa: PERF203
            msg = str(exc)
            rec.update(raised=type(exc).__name__, message=msg, ok=bool(re.search(case.match, msg)))
        except Exception as exc:  # a different error is a failure of the catalogue
            rec.update(raised=type(exc).__name__, message=str(exc), ok=False, traceback=traceback.format_exc())
        else:
            rec.update(raised=None, message="", ok=False)
        out.append(rec)
    return out
