"""The API emulator for tests: re-exported from the product (``liveshard.runtime.localcluster``)."""

from liveshard.runtime.localcluster.emulator import Emulator, KubeEmulator, run_pod

__all__ = ["Emulator", "KubeEmulator", "run_pod"]
