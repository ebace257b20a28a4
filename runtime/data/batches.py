"""How one optimizer step's fixed global batch splits over DP ranks and micro-batches (pure).

The sample cursor (samples consumed) is the whole data position: the step that starts at
``cursor`` trains on samples ``[cursor, cursor + global_batch)`` of the train dataset, DP rank
``r`` on the ``r``-th slice, whatever the DP degree, so no sample is repeated or skipped
across a reconfiguration. The slices are equal, or with a split (``ParallelConfig.dp_split``,
micro-batches per DP rank) contiguous slices of those sizes in rank order: the union over the
ranks is the same global batch in the same order either way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's fixed global batch splits over DP ranks and micro-batches."""

    global_batch: int
    micro_batch: int
    dp: int
    split: tuple[int, ...] | None = None  # micro-batches per DP rank; None: equal shares

    def __post_init__(self) -> None:
        from liveshard.runtime.errors import ConfigError

        if self.split is None:
            if self.global_batch % (self.micro_batch * self.dp):
                raise ConfigError("global_batch", f"{self.global_batch} sequences do not split into "
                                                  f"dp={self.dp} x micro_batch={self.micro_batch}",
                                  "choose a global batch that is a multiple of dp * micro_batch")
            return
        split = tuple(self.split)
        text = "+".join(map(str, split))
        if len(split) != self.dp:
            raise ConfigError("dp_split", f"{len(split)} micro-batch counts ({text}) given for dp={self.dp}",
                              "give one micro-batch count per data-parallel replica")
        if any(n < 1 for n in split):
            raise ConfigError("dp_split", f"{text}: every data-parallel replica needs at least one micro-batch")
        if sum(split) * self.micro_batch != self.global_batch:
            total = self.global_batch / self.micro_batch
            fix = (f"make the counts add up to global_batch / micro_batch = {int(total)}" if total.is_integer()
                   else f"choose a global batch that is a multiple of micro_batch={self.micro_batch}")
            raise ConfigError("dp_split", f"dp_split={text} is {sum(split)} micro-batches of {self.micro_batch}: "
                                          f"{sum(split) * self.micro_batch} sequences, the global batch is "
                                          f"{self.global_batch}", fix)
        # An all-equal split is the even plan: one code path (and bit-identical training) for both.
        object.__setattr__(self, "split", None if len(set(split)) == 1 else split)

    def micro_batches(self, dp_rank: int) -> int:
        """Micro-batches DP rank ``dp_rank`` runs in one step."""
        if self.split is not None:
            return self.split[dp_rank]
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def total_micro_batches(self) -> int:
        """Micro-batches of one step over all DP ranks."""
        return self.global_batch // self.micro_batch

    def rank_samples(self, cursor: int, dp_rank: int) -> range:
        """Sample indices this DP rank trains on in the step that starts at ``cursor``."""
        if self.split is not None:
            first = cursor + sum(self.split[:dp_rank]) * self.micro_batch
            return range(first, first + self.split[dp_rank] * self.micro_batch)
        per_rank = self.global_batch // self.dp
        first = cursor + dp_rank * per_rank
        return range(first, first + per_rank)
