"""Data: token stores and corpora, the data service, the plan-driven HDP loader.

The data path: ``python -m bytescale.data.prepare`` (:mod:`.prepare`) turns raw corpora into a
:class:`TokenStore`; a :class:`MixingSpec` declares sources, weights, filters and curriculum; a
:class:`DataService` (local processes or Ray actors) publishes global-batch metadata and serves
each rank only its token ranges through a :class:`BatchSource` client (:mod:`.source`); the
:class:`HDPLoader` plans each global batch and materialises this rank's micro-batches.
"""
from .dataset import InMemoryTokens, SyntheticTokens, TokenDataset
from .loader import GlobalBatchSampler, HDPLoader, materialize
from .oversize import DocumentView, OversizeError
from .mixing import CurriculumStage, MixingSampler, MixingSpec, SourceSpec
from .service import DataService, ServiceClient, connect, open_batch_source
from .source import BatchSource, DatasetSource, GlobalBatch
from .synthetic import corpus_stats, global_batch_lengths, sample_lengths
from .token_store import TokenStore, TokenStoreWriter
from .tokenizer import ByteTokenizer, load_tokenizer
from ..runtime.types import IGNORE_INDEX, MicroBatch, Step  # moved to bytescale.runtime; kept here

__all__ = [
    "InMemoryTokens", "SyntheticTokens", "TokenDataset", "GlobalBatchSampler", "HDPLoader",
    "MicroBatch", "Step", "IGNORE_INDEX", "materialize", "corpus_stats",
    "global_batch_lengths", "sample_lengths",
    "TokenStore", "TokenStoreWriter", "ByteTokenizer", "load_tokenizer",
    "GlobalBatch", "BatchSource", "DatasetSource",
    "MixingSpec", "SourceSpec", "CurriculumStage", "MixingSampler",
    "DataService", "ServiceClient", "connect", "open_batch_source", "DocumentView", "OversizeError",
]
