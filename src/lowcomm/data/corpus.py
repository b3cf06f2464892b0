"""Tokenizer training, corpus tokenization, and the on-disk cache shared by all ranks.

Cache layout under the cache directory::

    tokenizers/<key>.json   byte-level BPE tokenizer (tokenizers' JSON format)
    corpora/<key>.npz       token ids per source, plus vocabulary metadata
    locks/<key>.lock        advisory lock so only one process trains a given tokenizer

``key`` is a SHA-256 over the format version, the vocabulary size, and every document's source
name and content hash, so changing any input text or the vocabulary gives a new key. Every
cache write goes to a temporary file in the same directory followed by ``os.replace``, so a
concurrent reader (another rank under torchrun) sees either no file or a complete one.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lowcomm.atomic import atomic_write_bytes
from lowcomm.data.config import DataConfig, DataError
from lowcomm.data.documents import Document, read_documents

CACHE_FORMAT_VERSION = 1
"""Bump when the tokenizer recipe or the cached array layout changes, to invalidate old files."""

END_OF_TEXT = "<|endoftext|>"
"""Special token appended after every document, so the model sees document boundaries."""

OTHER_ENDS = ("</s>", "<|end_of_text|>", "<eos>")
"""End-of-document tokens of other tokenizer families (Llama 2 and Mistral, Llama 3, Gemma),
tried after <|endoftext|> and the tokenizer's declared eos_token."""

TokenArray = npt.NDArray[np.unsignedinteger[Any] | np.signedinteger[Any]]


def _import_tokenizers() -> Any:
    # Imported lazily so that `import lowcomm.data` stays cheap for processes that only sample.
    import tokenizers

    return tokenizers


@dataclass
class PreparedCorpus:
    """A tokenized corpus, split into training and held-out validation token streams."""

    tokenizer_path: Path
    """The cached tokenizer JSON file (load with :meth:`load_tokenizer`)."""

    vocab_size: int
    """Vocabulary size actually produced (may be below the request for a tiny corpus)."""

    eot_id: int
    """Id of the end-of-text token placed after every document."""

    source_names: list[str]
    """One name per source (input file), in a fixed sorted order."""

    train_tokens: list[TokenArray]
    """Per source, the first ``1 - val_fraction`` of its token stream."""

    val_tokens: list[TokenArray]
    """Per source, the last ``val_fraction`` of its token stream; never used for training."""

    cache_key: str
    """Hash identifying the inputs and tokenizer settings."""

    from_cache: bool
    """Whether both the tokenizer and the token ids were loaded from the cache."""

    num_documents: int = 0
    """Documents read (a text file is one, a JSONL file one per non-empty record)."""
    end_of_text: str = END_OF_TEXT
    """The token after every document (``eot_id``'s text)."""

    @property
    def num_train_tokens(self) -> int:
        """Total training tokens over all sources."""
        return sum(int(tokens.size) for tokens in self.train_tokens)

    @property
    def num_val_tokens(self) -> int:
        """Total validation tokens over all sources."""
        return sum(int(tokens.size) for tokens in self.val_tokens)

    def load_tokenizer(self) -> Any:
        """Load the tokenizer.

        Returns:
            A ``tokenizers.Tokenizer`` (``encode(text).ids``, ``decode(ids)``).
        """
        return _import_tokenizers().Tokenizer.from_file(str(self.tokenizer_path))


def cache_key(
    documents: list[Document],
    vocab_size: int,
    tokenizer: bytes | None = None,
    end_of_text: str = END_OF_TEXT,
) -> str:
    """Hash the inputs that determine the tokenizer and the token ids.

    Args:
        documents: ``(source_name, text)`` pairs in reading order.
        vocab_size: Requested vocabulary size.
        tokenizer: A given tokenizer's JSON (``--tokenizer``), or None for a trained BPE.
        end_of_text: The token after every document.

    Returns:
        A hex SHA-256 digest.
    """
    digest = hashlib.sha256()
    digest.update(f"lowcomm-corpus-v{CACHE_FORMAT_VERSION}\0vocab={vocab_size}\0".encode())
    if tokenizer is not None:
        digest.update(b"tokenizer\0" + hashlib.sha256(tokenizer).digest())
    if end_of_text != END_OF_TEXT:  # (the default leaves the keys of older caches as they were)
        digest.update(b"end_of_text\0" + end_of_text.encode("utf-8") + b"\0")
    for source_name, text in documents:
        digest.update(source_name.encode("utf-8", errors="replace") + b"\0")
        digest.update(hashlib.sha256(text.encode("utf-8", errors="replace")).digest())
    return digest.hexdigest()


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an advisory lock so concurrent preparers train the tokenizer only once.

    Atomic writes alone keep files whole; the lock additionally stops every rank from
    spending time training the same tokenizer. Where ``fcntl`` is unavailable the lock is a
    no-op and correctness still rests on the atomic writes.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def resolve_end_of_text(config: DataConfig) -> str:
    """The token this configuration places after every document (see
    ``DataConfig.end_of_text``), checked against the given tokenizer.

    Raises:
        DataError: The tokenizer cannot be read, lacks the token asked for, or has none of
            the known end-of-document tokens.
    """
    return _end_of_text(config, _given_tokenizer(config))[0]


def _end_of_text(config: DataConfig, given: bytes | None) -> tuple[str, Any]:
    """:func:`resolve_end_of_text` for the given tokenizer's bytes, with the tokenizer parsed
    from them (None for a trained BPE)."""
    if given is None:
        return config.end_of_text or END_OF_TEXT, None
    try:
        tokenizer = _import_tokenizers().Tokenizer.from_str(given.decode("utf-8"))
    except Exception as error:  # the tokenizers library raises its own exception type
        raise DataError(
            f"--tokenizer: {config.tokenizer} is not a tokenizers JSON file ({error}); pass a "
            f"tokenizer.json"
        ) from None
    if config.end_of_text is not None:
        if tokenizer.token_to_id(config.end_of_text) is None:
            raise DataError(
                f"--end-of-text: {config.end_of_text!r} is not a token of {config.tokenizer}; "
                f"pass one of its special tokens, or omit --end-of-text to pick its own"
            )
        return config.end_of_text, tokenizer
    declared = _declared_eos(Path(str(config.tokenizer)).expanduser().parent)
    candidates = [END_OF_TEXT, *([declared] if declared else []), *OTHER_ENDS]
    for candidate in candidates:
        if tokenizer.token_to_id(candidate) is not None:
            return candidate, tokenizer
    raise DataError(
        f"--tokenizer: {config.tokenizer} has none of {', '.join(dict.fromkeys(candidates))}, "
        f"so lowcomm cannot mark where a document ends; pass --end-of-text TOKEN naming one "
        f"of its special tokens"
    )


def _declared_eos(directory: Path) -> str | None:
    """The eos_token of a Hugging Face tokenizer_config.json in ``directory`` (None: none)."""
    try:
        eos = json.loads((directory / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):  # an AddedToken written out: {"content": ..., ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def _train_tokenizer(
    documents: list[Document], vocab_size: int, end_of_text: str = END_OF_TEXT
) -> Any:
    tokenizers = _import_tokenizers()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    # add_prefix_space=False keeps decode(encode(text)) == text exactly.
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[end_of_text],
        # Seeding all 256 byte symbols guarantees any input text can be encoded later.
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((text for _, text in documents), trainer=trainer)
    return tokenizer


def _token_dtype(vocab_size: int) -> type[np.unsignedinteger[Any] | np.signedinteger[Any]]:
    # uint16 halves the cache size and memory for the usual vocabularies (< 65536 ids).
    return np.uint16 if vocab_size <= 1 << 16 else np.int32


def _tokenize(
    tokenizer: Any, documents: list[Document], eot_id: int, vocab_size: int
) -> tuple[list[str], list[TokenArray]]:
    encodings = tokenizer.encode_batch([text for _, text in documents])
    dtype = _token_dtype(vocab_size)
    source_names: list[str] = []
    pieces_per_source: list[list[TokenArray]] = []
    end_of_text = np.array([eot_id], dtype=dtype)
    for (source_name, _), encoding in zip(documents, encodings, strict=True):
        if not source_names or source_names[-1] != source_name:
            source_names.append(source_name)
            pieces_per_source.append([])
        pieces_per_source[-1].append(np.asarray(encoding.ids, dtype=dtype))
        pieces_per_source[-1].append(end_of_text)
    return source_names, [np.concatenate(pieces) for pieces in pieces_per_source]


def _save_corpus(
    path: Path, source_names: list[str], streams: list[TokenArray], vocab_size: int, eot_id: int
) -> None:
    arrays: dict[str, Any] = {
        "format_version": np.array(CACHE_FORMAT_VERSION),
        "vocab_size": np.array(vocab_size),
        "eot_id": np.array(eot_id),
        # A fixed-width unicode array loads without pickle (np.load's allow_pickle=False).
        "source_names": np.array(source_names, dtype=str),
    }
    for index, stream in enumerate(streams):
        arrays[f"tokens_{index:05d}"] = stream
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue())


def _load_corpus(path: Path) -> tuple[list[str], list[TokenArray], int, int] | None:
    """Load a cached corpus, or None if it is missing, unreadable or from another format."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            if int(archive["format_version"]) != CACHE_FORMAT_VERSION:
                return None
            source_names = [str(name) for name in archive["source_names"]]
            streams = [archive[f"tokens_{index:05d}"] for index in range(len(source_names))]
            return source_names, streams, int(archive["vocab_size"]), int(archive["eot_id"])
    except (OSError, KeyError, ValueError):
        # A corrupt or foreign file is rebuilt rather than trusted.
        return None


def _split_streams(
    streams: list[TokenArray], val_fraction: float
) -> tuple[list[TokenArray], list[TokenArray]]:
    train: list[TokenArray] = []
    validation: list[TokenArray] = []
    for stream in streams:
        # ceil so that every non-empty source contributes at least one held-out token.
        held_out = min(len(stream), math.ceil(len(stream) * val_fraction))
        boundary = len(stream) - held_out
        train.append(stream[:boundary])
        validation.append(stream[boundary:])
    return train, validation


def prepare_corpus(
    config: DataConfig, *, report: Callable[[str], None] | None = None
) -> PreparedCorpus:
    """Read, tokenize and split the configured text, reusing the cache when possible.

    Safe to call concurrently from several processes sharing a cache directory: the first
    trains the tokenizer while the others wait, then all load the same files.

    Args:
        config: The data configuration.
        report: Called with a line to show the user before a slow step (training the
            tokenizer, tokenizing the text).

    Returns:
        The prepared corpus.

    Raises:
        DataError: If the input is missing, malformed or empty.
    """
    documents = read_documents(config.data, config.text_field)
    given = _given_tokenizer(config)
    end_of_text, parsed = _end_of_text(config, given)
    key = cache_key(documents, 0 if given is not None else config.vocab_size, given, end_of_text)
    cache_dir = config.resolved_cache_dir()
    tokenizer_path = cache_dir / "tokenizers" / f"{key}.json"
    corpus_path = cache_dir / "corpora" / f"{key}.npz"

    def finish(
        loaded: tuple[list[str], list[TokenArray], int, int], from_cache: bool
    ) -> PreparedCorpus:
        source_names, streams, vocab_size, eot_id = loaded
        train, validation = _split_streams(streams, config.val_fraction)
        return PreparedCorpus(
            tokenizer_path=tokenizer_path,
            vocab_size=vocab_size,
            eot_id=eot_id,
            source_names=source_names,
            train_tokens=train,
            val_tokens=validation,
            cache_key=key,
            from_cache=from_cache,
            num_documents=len(documents),
            end_of_text=end_of_text,
        )

    # Fast path without the lock: a complete cache entry is immutable once it exists.
    if tokenizer_path.exists():
        loaded = _load_corpus(corpus_path)
        if loaded is not None:
            return finish(loaded, from_cache=True)

    with _exclusive_lock(cache_dir / "locks" / f"{key}.lock"):
        # Another process may have finished while this one waited for the lock.
        if tokenizer_path.exists():
            loaded = _load_corpus(corpus_path)
            if loaded is not None:
                return finish(loaded, from_cache=True)
            tokenizer = _import_tokenizers().Tokenizer.from_file(str(tokenizer_path))
        elif given is not None:
            tokenizer = parsed
            atomic_write_bytes(tokenizer_path, given)
        else:
            if report is not None:
                report(
                    f"training a {config.vocab_size}-token BPE tokenizer on {len(documents):,} "
                    f"documents (first use of this text; cached in {cache_dir})"
                )
            tokenizer = _train_tokenizer(documents, config.vocab_size, end_of_text)
            atomic_write_bytes(tokenizer_path, tokenizer.to_str().encode("utf-8"))
        eot_id = tokenizer.token_to_id(end_of_text)  # resolve_end_of_text checked it
        vocab_size = int(tokenizer.get_vocab_size())
        source_names, streams = _tokenize(tokenizer, documents, eot_id, vocab_size)
        _save_corpus(corpus_path, source_names, streams, vocab_size, eot_id)
    return finish((source_names, streams, vocab_size, eot_id), from_cache=False)


def _given_tokenizer(config: DataConfig) -> bytes | None:
    """The bytes of ``--tokenizer`` (None: train a BPE)."""
    if config.tokenizer is None:
        return None
    try:
        return Path(config.tokenizer).expanduser().read_bytes()
    except OSError as error:
        raise DataError(
            f"--tokenizer: cannot read {config.tokenizer} ({error.strerror or error}); pass "
            f"an existing tokenizer.json"
        ) from None


def time_prepare(config: DataConfig) -> tuple[PreparedCorpus, float]:
    """Prepare the corpus and measure how long it took (for logs and benchmarks).

    Args:
        config: The data configuration.

    Returns:
        The prepared corpus and the elapsed wall-clock seconds.
    """
    start = time.perf_counter()
    corpus = prepare_corpus(config)
    return corpus, time.perf_counter() - start
