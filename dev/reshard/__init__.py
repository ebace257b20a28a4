"""The reshard harness: run one transition on local gloo processes and check it bit for bit."""
