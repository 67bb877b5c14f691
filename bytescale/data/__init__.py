"""Data: token datasets, synthetic corpora, the plan-driven HDP loader and the static baseline."""
from .baselines import StaticPlan, static_cp_degree, static_cp_plan
from .dataset import InMemoryTokens, SyntheticTokens, TokenDataset
from .loader import GlobalBatchSampler, HDPLoader, materialize
from .synthetic import corpus_stats, global_batch_lengths, sample_lengths
from .types import IGNORE_INDEX, MicroBatch, Step

__all__ = [
    "InMemoryTokens", "SyntheticTokens", "TokenDataset", "GlobalBatchSampler", "HDPLoader",
    "MicroBatch", "Step", "IGNORE_INDEX", "materialize", "corpus_stats",
    "global_batch_lengths", "sample_lengths", "StaticPlan", "static_cp_plan", "static_cp_degree",
]
