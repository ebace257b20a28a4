"""kopf handlers, one module per concern. Importing this package registers them all.

The validating webhook is not a kopf handler: ``liveshard.operator.admission`` serves it on every
replica, leader or not.
"""

from liveshard.operator.handlers import jobs, nodes, pods, setup

__all__ = ["jobs", "nodes", "pods", "setup"]
