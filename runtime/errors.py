"""Errors a person can act on: each names the field at fault and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model spec, parallel config or job field is invalid.

    ``field`` names the offending setting; ``fix`` says what to change. ``str()`` is one line.
    """

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        text = f"{field}: {problem}"
        if fix:
            text += f" (fix: {fix})"
        super().__init__(text)


class UnsupportedModelError(ConfigError):
    """The model is valid but uses an architecture liveshard cannot lay out yet."""


class RunFailed(RuntimeError):
    """A run that did not finish: a worker died and nothing recovered, the coordinator failed the
    job or refused a change, the final checkpoint is missing. ``str()`` is one line saying why
    (and where the logs are); the CLI prints it and exits 1."""


class RunTimedOut(RunFailed, TimeoutError):
    """A run that waited too long for something that never happened."""
