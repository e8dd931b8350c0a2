"""Layer split: consecutive layers as pipeline stages, micro-batches flowing through them."""

from meshsplit.pipeline.grouping import split_point

__all__ = ["split_point"]
