"""kopf handlers, one module per concern. Importing this package registers them all.

``admission`` is imported only when the operator serves its webhook (kopf refuses to run with
admission handlers but no webhook server).
"""

from liveshard.operator.handlers import jobs, nodes, pods, setup

__all__ = ["jobs", "nodes", "pods", "setup"]
