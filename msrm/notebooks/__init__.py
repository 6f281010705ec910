"""Run the parameterised notebooks per device and profile: ``python -m msrm.notebooks run --profile quick``.

See :mod:`msrm.notebooks.runner` for the results layout and the failure rules, :mod:`msrm.notebooks.device`
for device labels and :mod:`msrm.notebooks.check_book` for the rendered-book check.
"""
from .device import cpu_label, cuda_label, device_label, resolve_device, slug
from .runner import PROFILES, ROOT, NotebookResult, discover, notebook_stem, run_notebook, run_notebooks

__all__ = [
    "PROFILES", "ROOT", "NotebookResult", "discover", "notebook_stem", "run_notebook", "run_notebooks",
    "cpu_label", "cuda_label", "device_label", "resolve_device", "slug",
]
