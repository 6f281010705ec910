"""Reliability: the catalogue of bad inputs and the numerical faults the package must survive."""
from .catalogue import BadInput, all_cases, argument_cases, foundation_cases, run_catalogue

__all__ = ["BadInput", "all_cases", "argument_cases", "foundation_cases", "run_catalogue"]
