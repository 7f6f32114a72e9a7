"""Rank collapse (Daneshmand et al. 2020): rank measures, the paper's random chains, per-layer
measurement of any ``nn.Module``, rank-raising pre-training and gradient alignment.

See ``docs/rank.md``.
"""
from __future__ import annotations

from bnlab.rank.alignment import GradientAlignment, gradient_alignment
from bnlab.rank.chains import (
    CHAIN_ACTIVATIONS,
    CHAIN_INITS,
    CHAIN_NORMS,
    CHAIN_PLACEMENTS,
    MAX_CHAIN_SECONDS,
    ChainResult,
    chain_seconds,
    chain_step,
    default_record_layers,
    draw_weights,
    run_chain,
)
from bnlab.rank.hooks import (
    last_linear_name,
    layer_rank_measures,
    record_representations,
    representation_matrix,
    rescale_to_unit_trace,
)
from bnlab.rank.invariant import InvariantMoments, frobenius_drift, invariant_moments, regularity_terms
from bnlab.rank.measures import (
    RankMeasures,
    as_representation,
    effective_rank,
    numerical_rank,
    rank_lower_bound,
    rank_measures,
    soft_rank,
    stable_rank,
)
from bnlab.rank.pretrain import PRETRAIN_OBJECTIVES, PretrainResult, rank_pretrain

__all__ = [
    "RankMeasures",
    "as_representation",
    "soft_rank",
    "rank_lower_bound",
    "numerical_rank",
    "stable_rank",
    "effective_rank",
    "rank_measures",
    "CHAIN_NORMS",
    "CHAIN_ACTIVATIONS",
    "CHAIN_INITS",
    "CHAIN_PLACEMENTS",
    "ChainResult",
    "chain_step",
    "chain_seconds",
    "MAX_CHAIN_SECONDS",
    "draw_weights",
    "default_record_layers",
    "run_chain",
    "record_representations",
    "layer_rank_measures",
    "last_linear_name",
    "representation_matrix",
    "rescale_to_unit_trace",
    "PRETRAIN_OBJECTIVES",
    "PretrainResult",
    "rank_pretrain",
    "GradientAlignment",
    "gradient_alignment",
    "InvariantMoments",
    "frobenius_drift",
    "regularity_terms",
    "invariant_moments",
]
