"""Development tooling, not part of the product images.

The Kubernetes API emulator and local cluster (``localcluster``), the local run driver with its
fault injection (``localrun``), the reshard harness (``reshard``) and the commands that front
them (``liveshard demo``, ``local-cluster``, ``run-local``, ``reshard-local``). Only those
commands import this package; the operator and worker images install none of its extra
dependencies (``kmock``, ``aiohttp``, ``matplotlib``: the ``local`` extra).
"""
