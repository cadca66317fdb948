"""Privacy accounting: Opacus' accountants for DP-SGD; zCDP and analytic-Gaussian tools for the
heads."""
from .analytic_gaussian import (analytic_gaussian_sigma, classical_gaussian_sigma, gaussian_delta,
                                gaussian_epsilon)
from .budget import BudgetExceededError, PrivacyBudget, PrivacyReport
from .opacus_bridge import (ACCOUNTANTS, calibrate_noise_multiplier, epsilon_for, make_accountant,
                            steps_for)
from .sampling_check import SamplingRateCheck, SamplingRateError
from .zcdp import (CONVERSIONS, GaussianRelease, ZCDPLedger, compose_rho,
                   epsilon_for_noise_multiplier, epsilon_to_rho, gaussian_rho,
                   noise_multiplier_for_epsilon, rho_to_epsilon, rho_to_rdp)

__all__ = [
    "BudgetExceededError", "PrivacyBudget", "PrivacyReport", "SamplingRateCheck",
    "SamplingRateError",
    "ACCOUNTANTS", "calibrate_noise_multiplier", "epsilon_for", "make_accountant", "steps_for",
    "CONVERSIONS", "GaussianRelease", "ZCDPLedger", "compose_rho", "epsilon_for_noise_multiplier",
    "epsilon_to_rho",
    "gaussian_rho", "noise_multiplier_for_epsilon", "rho_to_epsilon", "rho_to_rdp",
    "analytic_gaussian_sigma", "classical_gaussian_sigma", "gaussian_delta", "gaussian_epsilon",
]
