"""Privacy accounting: Opacus' accountants and dp-accounting's PLD accountant for DP-SGD, the
accounting of an engine's steps as one object (:class:`StepAccountant`); zCDP and
analytic-Gaussian tools for the heads."""
from .analytic_gaussian import (
                                analytic_gaussian_sigma,
                                classical_gaussian_sigma,
                                gaussian_delta,
                                gaussian_epsilon,
)
from .budget import BudgetExceededError, PrivacyBudget, PrivacyReport
from .opacus_bridge import (
                                ACCOUNTANTS,
                                PRVAccountant,
                                RDPAccountant,
                                calibrate_noise_multiplier,
                                epsilon_for,
                                make_accountant,
                                steps_for,
)
from .pld import PLDAccountant, pld_epsilon, pld_noise_multiplier
from .sampling_check import SamplingRateCheck, SamplingRateError, check_loader
from .step_accounting import StepAccountant
from .zcdp import (
    CONVERSIONS,
    GaussianRelease,
    ZCDPLedger,
    compose_rho,
    epsilon_for_noise_multiplier,
    epsilon_to_rho,
    gaussian_rho,
    noise_multiplier_for_epsilon,
    rho_to_epsilon,
    rho_to_rdp,
)

__all__ = [
    "BudgetExceededError", "PrivacyBudget", "PrivacyReport", "SamplingRateCheck",
    "SamplingRateError", "StepAccountant", "check_loader",
    "ACCOUNTANTS", "PLDAccountant", "PRVAccountant", "RDPAccountant", "pld_epsilon",
    "pld_noise_multiplier",
    "calibrate_noise_multiplier", "epsilon_for", "make_accountant", "steps_for",
    "CONVERSIONS", "GaussianRelease", "ZCDPLedger", "compose_rho", "epsilon_for_noise_multiplier",
    "epsilon_to_rho",
    "gaussian_rho", "noise_multiplier_for_epsilon", "rho_to_epsilon", "rho_to_rdp",
    "analytic_gaussian_sigma", "classical_gaussian_sigma", "gaussian_delta", "gaussian_epsilon",
]
