"""The acceptance model of draft trees and the numerical checks of the GOOSE propositions.

See docs/theory.md. Run ``python -m goose.theory check`` (or ``goose theory check``).
"""

from goose.theory.allocation import (
    brute_force_allocation,
    harmonic_allocation,
    kkt_slope,
    optimal_allocation,
    spine_weights,
    uniform_allocation,
)
from goose.theory.calibrate import Record, calibration_report, compare_tau, estimate, load_records, record_from_step
from goose.theory.model import AcceptanceModel, greedy_walk, independent_ranks, simulate_tokens, simulate_walks
from goose.theory.trees import (
    SpineRule,
    brute_force_best,
    goose_tree,
    isotropic_tree,
    optimal_single_source,
    optimal_spine_tree,
)

__all__ = [
    "AcceptanceModel",
    "independent_ranks",
    "simulate_walks",
    "simulate_tokens",
    "greedy_walk",
    "SpineRule",
    "goose_tree",
    "isotropic_tree",
    "optimal_single_source",
    "optimal_spine_tree",
    "brute_force_best",
    "spine_weights",
    "optimal_allocation",
    "brute_force_allocation",
    "harmonic_allocation",
    "uniform_allocation",
    "kkt_slope",
    "Record",
    "estimate",
    "compare_tau",
    "calibration_report",
    "load_records",
    "record_from_step",
]
