"""Data augmentation of image batches on their device, vectorized over the batch.

:func:`random_crop_flip` is the CIFAR augmentation of He et al. 2016a (§4.2, "Deep Residual Learning
for Image Recognition"): "4 pixels are padded on each side, and a 32×32 crop is randomly sampled from
the padded image or its horizontal flip", as used by the ResNet experiments of Lange et al. (BNP, §5
and Appendix B).  :class:`RandomCropFlip` holds the generator so it can be passed as the ``transform``
of :func:`bnlab.nets.train`.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from bnlab._validation import check_int

__all__ = ["random_crop_flip", "RandomCropFlip"]


def random_crop_flip(x: torch.Tensor, *, padding: int = 4, flip: bool = True,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """A random crop of the zero-padded image and, with probability ½ each, its mirror image.

    ``x`` is (N, C, H, W).  Each image is padded with ``padding`` zeros on every side and an H×W
    window at an offset drawn uniformly from the (2·padding + 1)² positions is cut out; with ``flip``
    the window is mirrored left-right with probability ½ (He et al. 2016a, §4.2).  Offsets and flips
    are drawn on the CPU from ``generator`` (so the result does not depend on the device) and the
    crop is one gather on ``x``'s device: no Python loop over images.  Returns a new tensor.
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x of shape {shape} is not allowed: expected an (N, C, H, W) tensor")
    padding = check_int("padding", padding, minimum=0)
    if not isinstance(flip, bool):
        raise ValueError(f"flip={flip!r} is not allowed: expected True or False")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator={generator!r} is not allowed: expected a torch.Generator or None")
    n, c, h, w = x.shape
    oy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    ox = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    mirror = torch.rand(n, generator=generator) < 0.5
    rows = oy[:, None] + torch.arange(h)  # (n, h) rows of the padded image
    cols = ox[:, None] + torch.arange(w)  # (n, w)
    if flip:
        cols = torch.where(mirror[:, None], cols.flip(1), cols)
    dev = x.device
    xp = F.pad(x, (padding, padding, padding, padding)) if padding else x
    return xp[torch.arange(n, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None],
              rows.to(dev)[:, None, :, None], cols.to(dev)[:, None, None, :]]


class RandomCropFlip:
    """:func:`random_crop_flip` with its own generator seeded by ``seed``: a ``transform`` for
    :func:`bnlab.nets.train` (each call draws new crops and flips)."""

    def __init__(self, padding: int = 4, flip: bool = True, seed: int = 0):
        self.padding = check_int("padding", padding, minimum=0)
        if not isinstance(flip, bool):
            raise ValueError(f"flip={flip!r} is not allowed: expected True or False")
        self.flip = flip
        self.generator = torch.Generator().manual_seed(check_int("seed", seed, minimum=0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return random_crop_flip(x, padding=self.padding, flip=self.flip, generator=self.generator)

    def state_dict(self) -> dict:
        """The settings and the generator's state (``torch.nn.Module``'s convention: what a checkpoint of
        :func:`bnlab.nets.train` keeps, so a resumed run draws the crops it would have drawn)."""
        return {"padding": self.padding, "flip": self.flip, "generator": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` output (the same settings); a ``ValueError`` leaves this one as it was."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"padding", "flip", "generator"}:
            raise ValueError("state_dict is not allowed: expected the mapping returned by RandomCropFlip.state_dict() "
                             "(keys 'padding', 'flip', 'generator')")
        if state_dict["padding"] != self.padding or state_dict["flip"] is not self.flip:
            raise ValueError(f"state_dict has padding={state_dict['padding']!r}, flip={state_dict['flip']!r} but this "
                             f"transform uses padding={self.padding}, flip={self.flip}")
        state, own = state_dict["generator"], self.generator.get_state()
        if not (isinstance(state, torch.Tensor) and state.dtype == own.dtype and state.shape == own.shape):
            raise ValueError(f"state_dict['generator'] is not allowed: expected a {tuple(own.shape)} {own.dtype} "
                             "tensor (torch.Generator.get_state())")
        try:
            self.generator.set_state(state.cpu())
        except RuntimeError as exc:
            self.generator.set_state(own)
            raise ValueError(f"state_dict['generator'] is not allowed: {exc}") from None

    def __repr__(self) -> str:
        return f"RandomCropFlip(padding={self.padding}, flip={self.flip})"
