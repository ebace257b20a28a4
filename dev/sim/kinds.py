"""The fault kinds a schedule injects (``sim.faults``), in a module that imports nothing, so the
command line can name them before a mutant is planted."""

FAULTS = ("kill", "restart", "coordinator", "forge", "replay", "delete", "slow", "freeze", "clock", "counter",
          "damage", "lose-write")
