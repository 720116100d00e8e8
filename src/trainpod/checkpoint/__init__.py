"""Committed checkpoints on the volume and the lease that makes one process their only writer.

The writer that snapshots state and commits it (checkpoint/writer.py) imports torch, so it is
imported from its module, keeping `trainpod status` and the lease free of torch's start-up time.
"""

from trainpod.checkpoint.lease import Lease
from trainpod.checkpoint.store import CheckpointStore, CommitAbandoned, CommittedCheckpoint, PendingCheckpoint

__all__ = ["CheckpointStore", "CommitAbandoned", "CommittedCheckpoint", "Lease", "PendingCheckpoint"]
