"""How one optimizer step's fixed global batch splits over DP ranks and micro-batches (pure).

The sample cursor (samples consumed) is the whole data position: the step that starts at
``cursor`` trains on samples ``[cursor, cursor + global_batch)`` of the train dataset, DP rank
``r`` on the ``r``-th equal slice, whatever the DP degree, so no sample is repeated or skipped
across a reconfiguration.
"""

from __future__ import annotations

from dataclasses import dataclass


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
