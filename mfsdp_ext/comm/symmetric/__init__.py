"""NCCL symmetric memory: the communicator and pool (comm), the collectives on it (collectives), and the choice
between them and the plain path at lazy init (choose)."""

from .comm import ALIGNMENT, MIN_NCCL_VERSION, SymmetricComm, format_nccl_version, is_available, nccl_version

__all__ = ["ALIGNMENT", "MIN_NCCL_VERSION", "SymmetricComm", "format_nccl_version", "is_available", "nccl_version"]
