"""CRD validation for tests: re-exported from the product (``liveshard.dev.localcluster``)."""

from liveshard.dev.localcluster.crd_validation import CRDValidator, InvalidObject

__all__ = ["CRDValidator", "InvalidObject"]
