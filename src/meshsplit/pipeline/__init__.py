"""Layer split: consecutive layers as pipeline stages, micro-batches flowing through them."""
