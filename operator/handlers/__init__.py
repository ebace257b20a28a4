"""kopf handlers, one module per concern. Importing this package registers them all."""

from liveshard.operator.handlers import admission, jobs, nodes, pods, setup

__all__ = ["admission", "jobs", "nodes", "pods", "setup"]
