"""Datasets that work offline: scikit-learn's bundled digits, and synthetic tensors of any size."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["digits", "synthetic_images", "synthetic_tokens", "counting_tokens"]

_SPLIT_SEED = 0
_TEST_FRACTION = 0.2


def digits(split: str = "train", image_size: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 8x8 digits, scaled to [0, 1] and resized to image_size.

    Returns (images (N, 1, S, S) float32, labels (N,) int64); the train/test split is fixed.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}; use 'train' or 'test'")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.int64)
    if image_size != images.shape[-1]:
        images = F.interpolate(
            images, size=(image_size, image_size), mode="bilinear", align_corners=False
        )
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    n_test = int(len(labels) * _TEST_FRACTION)
    chosen = order[:n_test] if split == "test" else order[n_test:]
    return images[chosen].contiguous(), labels[chosen].contiguous()


def synthetic_images(
    samples: int, image_size: int = 28, classes: int = 10, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (N, 1, S, S) and labels, the same on every rank for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, 1, image_size, image_size, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return images, labels


def synthetic_tokens(
    samples: int, seq_len: int = 32, vocab_size: int = 256, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (N, T) and their next-token targets, for the transformer."""
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab_size, (samples, seq_len + 1), generator=generator)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def counting_tokens(
    samples: int, seq_len: int = 32, vocab_size: int = 256, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences x_t = (a + b*t) mod V with random a and b in 1..4, and next tokens.

    A model must read the stride off the context to predict the next token, so accuracy
    measures real learning (random tokens cannot be learned).
    """
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (samples, 1), generator=generator)
    stride = torch.randint(1, 5, (samples, 1), generator=generator)
    stream = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
