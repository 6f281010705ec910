"""Run the parameterised notebooks per device and profile: ``python -m msrm_lab.notebooks run --profile quick``.

See :mod:`msrm_lab.notebooks.runner` for the results layout and the failure rules, :mod:`msrm_lab.notebooks.device`
for device labels and :mod:`msrm_lab.notebooks.check_book` for the rendered-book check.
"""
from .device import cpu_label, cuda_label, device_label, resolve_device, slug
from .runner import PROFILES, NotebookResult, discover, notebook_stem, run_notebook, run_notebooks

__all__ = [
    "PROFILES", "NotebookResult", "discover", "notebook_stem", "run_notebook", "run_notebooks",
    "cpu_label", "cuda_label", "device_label", "resolve_device", "slug",
]
