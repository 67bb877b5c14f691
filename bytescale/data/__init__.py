"""Data: synthetic corpora, token datasets and the plan-driven HDP loader."""
from .dataset import InMemoryTokens, SyntheticTokens, TokenDataset
from .loader import (GlobalBatchSampler, HDPLoader, MicroBatch, MicroBatchSpec, SequenceSpec, Step,
                     lockstep_schedule, materialize)
from .synthetic import corpus_stats, global_batch_lengths, sample_lengths

__all__ = [
    "InMemoryTokens", "SyntheticTokens", "TokenDataset", "GlobalBatchSampler", "HDPLoader",
    "MicroBatch", "MicroBatchSpec", "SequenceSpec", "Step", "lockstep_schedule", "materialize", "corpus_stats",
    "global_batch_lengths", "sample_lengths",
]
