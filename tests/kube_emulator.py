"""The API emulator for tests: re-exported from the product (``liveshard.dev.localcluster``)."""

from liveshard.dev.localcluster.emulator import Emulator, KubeEmulator, run_pod

__all__ = ["Emulator", "KubeEmulator", "run_pod"]
