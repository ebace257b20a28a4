"""Development tooling: never imported by the product's code paths.

The Kubernetes API emulator and local cluster (``localcluster``), the local run driver with its
fault injection (``localrun``), the reshard harness and transition cases (``reshard``), a pool of
gloo processes for tests (``procpool``), and the commands that front them (``liveshard demo``,
``local-cluster``, ``run-local``, ``reshard-local``). No module of ``liveshard.runtime`` or
``liveshard.operator`` imports it; the CLI imports those commands only when they run. The
package ships in the distribution (so ``pip install 'liveshard[local]'`` gives the demo), but
the operator and worker images install none of its dependencies (``kmock``, ``matplotlib``, the
emulator's CEL and JSON-patch libraries: the ``local`` extra), and a test checks that they are
absent there.
"""
