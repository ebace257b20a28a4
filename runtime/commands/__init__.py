"""Subcommands of the ``liveshard`` CLI, one module each (see ``liveshard.runtime.cli``)."""
