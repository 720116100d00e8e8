"""Committed checkpoints on the volume and the lease that makes one process their only writer."""

from trainpod.checkpoint.lease import Lease
from trainpod.checkpoint.store import CheckpointStore, CommittedCheckpoint, PendingCheckpoint

__all__ = ["CheckpointStore", "CommittedCheckpoint", "Lease", "PendingCheckpoint"]
