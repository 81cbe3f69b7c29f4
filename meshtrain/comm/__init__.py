"""Communication layer: the collectives strategies call, and their byte accounting."""

from meshtrain.comm.communicator import (
    CommLog,
    CommRecord,
    Communicator,
    NodeAborted,
    ReduceOp,
    ring_all_reduce_bytes,
    ring_reduce,
)
from meshtrain.comm.threads import ThreadCommunicator, ThreadHub

__all__ = [
    "CommLog",
    "CommRecord",
    "Communicator",
    "NodeAborted",
    "ReduceOp",
    "ThreadCommunicator",
    "ThreadHub",
    "ring_all_reduce_bytes",
    "ring_reduce",
]
