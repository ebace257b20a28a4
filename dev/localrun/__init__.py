"""Local runs of a whole job (coordinator + workers as processes on one machine, gloo)."""
