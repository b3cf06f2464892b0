"""Training text: reading, byte-level BPE tokenization with a shared cache, and sampling.

Typical use::

    corpus = prepare_corpus(DataConfig())
    shard = WorkerShard(corpus, rank, world_size, seq_len=128, micro_batch_size=8, seed=0)
    x, y = shard.next_batch()
    evaluation = validation_batches(corpus, seq_len=128, batch_size=8, num_batches=10)
"""

from __future__ import annotations

from lowcomm.data.config import DataConfig, DataError
from lowcomm.data.corpus import END_OF_TEXT, PreparedCorpus, resolve_end_of_text
from lowcomm.data.documents import BUNDLED_CORPUS_DIR, iter_documents, read_documents
from lowcomm.data.prepare import prepare_corpus
from lowcomm.data.sampling import WorkerShard, validation_batches

__all__ = [
    "BUNDLED_CORPUS_DIR",
    "END_OF_TEXT",
    "DataConfig",
    "DataError",
    "PreparedCorpus",
    "WorkerShard",
    "iter_documents",
    "prepare_corpus",
    "read_documents",
    "resolve_end_of_text",
    "validation_batches",
]
