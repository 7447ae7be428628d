"""Hand a staged state dict to another process without copying it: ``export_shared``
in the stager's process, ``attach_shared`` in a writer process (shared memory; the
torch.multiprocessing reducers are registered on import).

The code lives in ``async_stager._share``; this module is its public face.
"""

from async_stager._share.handoff import (
    AttachedStateDict,
    SharedArenaRef,
    SharedHandle,
    attach_shared,
    export_shared,
)

__all__ = ["AttachedStateDict", "SharedArenaRef", "SharedHandle", "attach_shared", "export_shared"]
