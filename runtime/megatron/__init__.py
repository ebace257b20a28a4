"""megatron-core adapter: build live models from liveshard specs and read their layout back.

Importing this package imports nothing heavy; ``build`` and ``extract`` need torch and
megatron-core (the ``liveshard[runtime]`` extra).
"""
