"""random_crop_flip (He et al. 2016a §4.2): every output is one of the (2p+1)² crops of the zero-padded
image or its mirror, found by exhaustive search (an independent route), and all of them occur."""
import pytest
import torch
from torch.nn import functional as F

from bnlab.data import RandomCropFlip, random_crop_flip


def _which_crop(img, out, p):
    """(dy, dx, mirrored) of the crop of the padded ``img`` that equals ``out``, by trying all of them."""
    c, h, w = img.shape
    padded = F.pad(img, (p, p, p, p))
    hits = []
    for dy in range(2 * p + 1):
        for dx in range(2 * p + 1):
            win = padded[:, dy:dy + h, dx:dx + w]
            for mirrored, cand in ((False, win), (True, win.flip(2))):
                if torch.equal(cand, out):
                    hits.append((dy, dx, mirrored))
    return hits


def test_each_output_is_a_padded_crop_or_its_mirror_and_all_occur():
    n, p = 1500, 2
    # distinct values everywhere, so a crop is identified uniquely
    x = torch.arange(n * 2 * 6 * 6, dtype=torch.float64).reshape(n, 2, 6, 6) + 1.0
    out = random_crop_flip(x, padding=p, generator=torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    seen = set()
    for i in range(n):
        hits = _which_crop(x[i], out[i], p)
        assert len(hits) == 1, (i, hits)
        seen.add(hits[0])
    # 2·25 = 50 outcomes, 1500 draws: P(some outcome never drawn) ≤ 50·(49/50)^1500 ≈ 3e-12
    assert len(seen) == 2 * (2 * p + 1) ** 2


def test_no_padding_no_flip_is_identity_and_transform_draws_fresh_crops():
    x = torch.randn(5, 3, 8, 8)
    assert torch.equal(random_crop_flip(x, padding=0, flip=False), x)
    t = RandomCropFlip(padding=4, seed=3)
    a, b = t(x), t(x)
    assert not torch.equal(a, b)  # the generator advances between calls
    assert torch.equal(RandomCropFlip(padding=4, seed=3)(x), a)  # and is seeded


@pytest.mark.parametrize("kwargs, match", [
    (dict(x=torch.zeros(3, 8, 8)), "x of shape"),
    (dict(x=torch.zeros(1, 3, 8, 8), padding=-1), "padding"),
    (dict(x=torch.zeros(1, 3, 8, 8), flip=1), "flip"),
    (dict(x=torch.zeros(1, 3, 8, 8), generator=0), "generator"),
])
def test_bad_input(kwargs, match):
    x = kwargs.pop("x")
    with pytest.raises(ValueError, match=match):
        random_crop_flip(x, **kwargs)
