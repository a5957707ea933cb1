"""The fingerprint oracle, where users import it: it lives in `hicache.runtime.testing.oracle`."""

from .testing.oracle import FingerprintMismatchError, FingerprintOracle

__all__ = ["FingerprintMismatchError", "FingerprintOracle"]
