"""Moving training state between layouts over torch.distributed (gloo on CPU, NCCL on GPU)."""
