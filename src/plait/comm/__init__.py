"""Communication: byte accounting of collectives (and, later, compression and collective algorithms)."""

from plait.comm.accounting import CommCounter, counting

__all__ = ["CommCounter", "counting"]
