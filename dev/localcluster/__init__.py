"""A Kubernetes cluster on one machine: the API emulator, the real operator and a node agent."""
