"""Recovery of a known truth by fitted latent-factor models: the metrics (:mod:`msrm_lab.recovery.metrics`).

The benchmark that uses them on designs not drawn from the model is :mod:`msrm_lab.bench.recovery`.
"""
from .metrics import (Z90, align_to_truth, aligned_band, aligned_r2, band_coverage, best_shift, binomial_sd,
                      central_interval, edge_mask, flat_response_errors, interval_coverage, response_errors,
                      subspace_error)

__all__ = ["subspace_error", "edge_mask", "aligned_r2", "align_to_truth", "response_errors", "flat_response_errors",
           "best_shift", "aligned_band", "band_coverage", "interval_coverage", "central_interval", "binomial_sd",
           "Z90"]
