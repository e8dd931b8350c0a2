"""Where each byte lives: reports now; budgets, recomputation and offload build on them."""
