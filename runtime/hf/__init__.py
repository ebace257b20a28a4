"""Hugging Face checkpoints as one more layout: config <-> ModelSpec, tensor names <-> logical
regions, import into and export from megatron-core in any parallel layout."""
