"""Privacy accounting: Opacus' accountants for DP-SGD; zCDP tools for the feature heads."""
from .opacus_bridge import ACCOUNTANTS, calibrate_noise_multiplier, epsilon_for, make_accountant, steps_for

__all__ = ["ACCOUNTANTS", "calibrate_noise_multiplier", "epsilon_for", "make_accountant", "steps_for"]
