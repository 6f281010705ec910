"""Seeded synthetic data shaped like the recorded study (no real data ever enters the repository)."""
from .study import PROFILES, Truth, StudyProfile, matern_kernel, synthetic_dataset

__all__ = ["synthetic_dataset", "Truth", "PROFILES", "StudyProfile", "matern_kernel"]
