"""CRD validation for tests: re-exported from the product (``liveshard.runtime.localcluster``)."""

from liveshard.runtime.localcluster.crd_validation import CRDValidator, InvalidObject

__all__ = ["CRDValidator", "InvalidObject"]
