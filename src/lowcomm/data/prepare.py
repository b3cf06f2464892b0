"""The one entry to a run's corpus: text (tokenized once into the cache, :mod:`.corpus`) or a
file of token ids (mapped as it is, :mod:`.tokenfile`)."""

from __future__ import annotations

from collections.abc import Callable

from lowcomm.data.config import DataConfig
from lowcomm.data.corpus import PreparedCorpus, Waiting, prepare_text_corpus
from lowcomm.data.tokenfile import is_token_file, prepare_token_file


def prepare_corpus(
    config: DataConfig,
    *,
    report: Callable[[str], None] | None = None,
    waiting: Waiting | None = None,
) -> PreparedCorpus:
    """Read, tokenize and split the configured text, reusing the cache when possible; or map
    a file of token ids (``.npy``, ``.bin``).

    Safe to call concurrently from several processes sharing a cache directory: the first
    tokenizes while the others wait on a file lock, then all map the same files.

    Args:
        config: The data configuration.
        report: Called with a line to show the user before a slow step (training the
            tokenizer, tokenizing the text).
        waiting: Called now and then while this process waits for another one preparing the
            same corpus.

    Returns:
        The prepared corpus; its token streams are views of a memory-mapped file.

    Raises:
        DataError: If the input is missing, malformed or empty.
    """
    if is_token_file(config.data):
        return prepare_token_file(config, report=report, waiting=waiting)
    return prepare_text_corpus(config, report=report, waiting=waiting)
