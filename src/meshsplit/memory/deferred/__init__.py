"""Build a model without memory, then give real values to only the part a rank keeps.

A model too big for one process cannot be built whole on every rank only to keep a slice of
it. `record` runs the user's zero-argument factory once with every tensor on the meta device
(no data), logging the ops that create and initialise each tensor; `materialize` replays that
log for the parameters and buffers a rank owns, one module at a time if wanted. Values are
bit-identical to a plain ``factory()``'s from the same RNG state: while recording, each random
op also runs for real on a scratch tensor (so the RNG advances exactly as in a real run) after
the state it saw is saved, and replay restores that state before running the op again. This
is the idea of torchdistx's ``deferred_init``, written afresh.

graph: what a recording is; recorder: making one (`record`); replay: using one
(`materialize`, `borrowed`).
"""

from meshsplit.memory.deferred.graph import DeferredInitError
from meshsplit.memory.deferred.recorder import record
from meshsplit.memory.deferred.replay import borrowed, is_recorded, materialize

__all__ = ["DeferredInitError", "borrowed", "is_recorded", "materialize", "record"]
