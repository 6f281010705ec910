"""Reliability: the catalogue of bad inputs and the numerical faults the package must survive."""
from .catalogue import BadInput, foundation_cases, run_catalogue

__all__ = ["BadInput", "foundation_cases", "run_catalogue"]
