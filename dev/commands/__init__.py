"""The ``liveshard`` subcommands that run development tooling (see ``liveshard.runtime.cli``)."""
