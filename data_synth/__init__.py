"""Seeded synthetic data shaped like the recorded study (no real data ever enters the repository)."""
from .designs import DESIGNS, Design, DesignTruth, design_names, make_design
from .study import PROFILES, Truth, StudyProfile, matern_kernel, synthetic_dataset

__all__ = ["synthetic_dataset", "Truth", "PROFILES", "StudyProfile", "matern_kernel", "make_design", "design_names",
           "DESIGNS", "Design", "DesignTruth"]
