"""Trainable networks: models, normalization layers and initializations by name, one training loop.

Every trainable network of bnlab lives here (the Fisher, rank-collapse and BNP parts and the
reproductions build on it; it imports none of them).  See ``docs/nets.md``.

* normalizations by name — :data:`NORMALIZATIONS`, :func:`make_norm` and the layers PyTorch lacks
  (:class:`BatchNormNoMean1d`, :class:`GhostBatchNorm1d`, :class:`BatchRenorm1d` and their 2d forms);
* initializations by name — :data:`INITS`, :func:`init_weights_` (seeded by a ``torch.Generator``);
* models — :class:`BNMLP` (Yang et al. 2019, Eq. 7), :class:`MLP` (any normalization, before or after
  φ), :class:`FisherCNN` (the Fisher paper's conv net), :class:`BNPCNN` (Lange et al.'s 5-layer CNN),
  :func:`feedforward` (the mean field ensemble's conv/FC networks, the Fisher paper's),
  :func:`vgg` and :func:`resnet` (paper scale);
* training — :func:`train` (any ``torch.optim`` optimizer or factory, hooks between ``backward()`` and
  ``step()``, callbacks, divergence detection, seeded data order, CPU/CUDA) → :class:`TrainResult`;
  :func:`train_classifier`, :func:`layer_norm_trajectory` (Yang et al. 2019 §4, Figs. 3–5);
  :func:`train_ensemble` (many networks of one architecture at once, network for network as
  :func:`train`: per-network learning rates, seeds, depths and BN constants, divergence masks,
  momentum / weight decay, cross-entropy or :func:`half_squared_error`, test loss on running or
  batch statistics — the trainability columns and the Fisher paper's learning-rate phase diagrams).
"""
from __future__ import annotations

from bnlab.nets.ensemble import (
    ENSEMBLE_LOSSES,
    ENSEMBLE_OPTIMIZERS,
    ENSEMBLE_STEP_MODES,
    auto_route_as_for,
    train_ensemble,
)
from bnlab.nets.init import INITS, init_weights_, initializable_layers
from bnlab.nets.models import (
    BNMLP,
    BNPCNN,
    MLP,
    PLACEMENTS,
    RESNET_DEPTHS,
    VGG_DEPTHS,
    ActivationModule,
    BasicBlock,
    Bottleneck,
    FisherCNN,
    PreActBlock,
    feedforward,
    resnet,
    vgg,
)
from bnlab.nets.norms import (
    NORMALIZATIONS,
    BatchNorm4Things1d,
    BatchNorm4Things2d,
    BatchNormNoMean1d,
    BatchNormNoMean2d,
    BatchRenorm1d,
    BatchRenorm2d,
    GhostBatchNorm1d,
    GhostBatchNorm2d,
    ghost_batch_norm,
    make_norm,
    norm_affine_parameters,
)
from bnlab.nets.train import (
    TEST_BN_MODES,
    TRAIN_STEP_MODES,
    StepInfo,
    TrainResult,
    half_squared_error,
    layer_norm_trajectory,
    resolve_device,
    train,
    train_classifier,
)

__all__ = [
    "NORMALIZATIONS",
    "make_norm",
    "BatchNormNoMean1d",
    "BatchNormNoMean2d",
    "GhostBatchNorm1d",
    "GhostBatchNorm2d",
    "BatchRenorm1d",
    "BatchRenorm2d",
    "BatchNorm4Things1d",
    "BatchNorm4Things2d",
    "norm_affine_parameters",
    "ghost_batch_norm",
    "INITS",
    "init_weights_",
    "initializable_layers",
    "BNMLP",
    "MLP",
    "PLACEMENTS",
    "ActivationModule",
    "FisherCNN",
    "BNPCNN",
    "feedforward",
    "vgg",
    "VGG_DEPTHS",
    "resnet",
    "RESNET_DEPTHS",
    "BasicBlock",
    "PreActBlock",
    "Bottleneck",
    "train",
    "TrainResult",
    "StepInfo",
    "train_classifier",
    "train_ensemble",
    "auto_route_as_for",
    "ENSEMBLE_OPTIMIZERS",
    "ENSEMBLE_LOSSES",
    "ENSEMBLE_STEP_MODES",
    "half_squared_error",
    "TEST_BN_MODES",
    "TRAIN_STEP_MODES",
    "layer_norm_trajectory",
    "resolve_device",
]
