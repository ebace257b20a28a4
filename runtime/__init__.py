"""liveshard's runtime. Importing it keeps known third-party noise off the console (``quiet``)."""

from liveshard.runtime import quiet as _quiet

_quiet.install()
