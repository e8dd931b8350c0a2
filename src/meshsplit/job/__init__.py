"""One job's processes: launched together, sharing a store and exit hooks, failing together
with one clear error (non-finite values, stop requests, stalls, bad input, desync)."""
