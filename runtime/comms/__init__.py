"""torch.distributed process groups as the runtime uses them, below the worker and the model
builder alike: ``world`` (a generation's training world, ``World``, with every way one is made
and ended; transition groups, communicators built ahead and handed over, cutting a world off)
and ``release`` (freeing a retired world's objects off the switch's critical path).
Backend-specific lines (gloo, NCCL) live here."""
