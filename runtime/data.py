"""A deterministic token source with a sample cursor.

Sample ``i`` is a pure function of ``(seed, i)``, so any rank can produce any sample and the
cursor (samples consumed) is the whole data position: after a reconfiguration the next step reads
``[cursor, cursor + global_batch)`` whatever the new DP degree, and no sample is repeated or
skipped. Sequences follow a learnable pattern (a seeded start and stride modulo the vocabulary,
with a little noise) so that loss visibly falls in short CPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SyntheticTokens:
    vocab_size: int
    seq_length: int
    seed: int = 1234
    noise: float = 0.05

    def sample(self, index: int) -> np.ndarray:
        """``seq_length + 1`` token ids for sample ``index`` (inputs and shifted labels)."""
        rng = np.random.default_rng((self.seed, index))
        start = int(rng.integers(self.vocab_size))
        stride = int(rng.integers(1, 8))
        tokens = (start + stride * np.arange(self.seq_length + 1)) % self.vocab_size
        flip = rng.random(self.seq_length + 1) < self.noise
        tokens[flip] = rng.integers(self.vocab_size, size=int(flip.sum()))
        return tokens.astype(np.int64)

    def batch(self, start: int, count: int) -> np.ndarray:
        return np.stack([self.sample(i) for i in range(start, start + count)])


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's fixed global batch splits over DP ranks and micro-batches."""

    global_batch: int
    micro_batch: int
    dp: int

    def __post_init__(self) -> None:
        from liveshard.runtime.errors import ConfigError

        if self.global_batch % (self.micro_batch * self.dp):
            raise ConfigError("global_batch", f"{self.global_batch} sequences do not split into "
                                              f"dp={self.dp} x micro_batch={self.micro_batch}",
                              "choose a global batch that is a multiple of dp * micro_batch")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def rank_samples(self, cursor: int, dp_rank: int) -> range:
        """Sample indices this DP rank trains on in the step that starts at ``cursor``."""
        per_rank = self.global_batch // self.dp
        first = cursor + dp_rank * per_rank
        return range(first, first + per_rank)
