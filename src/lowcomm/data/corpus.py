"""Tokenizer training, corpus tokenization, and the on-disk cache shared by all ranks.

Cache layout under the cache directory::

    tokenizers/<key>.json   byte-level BPE tokenizer (tokenizers' JSON format)
    corpora/<key>.tokens    token ids of every source, one after the other (raw uint16/uint32)
    corpora/<key>.json      what the token file holds: dtype, sources and their lengths,
                            vocabulary, end-of-text id (written last: the entry's commit)
    locks/<key>.lock        advisory lock so only one process tokenizes a given text
    digests/<hash>.json     a file's SHA-256 with the size and mtime it was computed for

``key`` is a SHA-256 over the format version, the vocabulary size (or the given tokenizer),
the end-of-text token, the text field, and every source file's name and content hash, so
changing any input file or the vocabulary gives a new key. A file's content hash is computed
once (streamed) and remembered for its size and modification time, so the ranks of a run find
the cache entry without reading the text. Every cache write goes to a temporary file in the same
directory followed by ``os.replace``, so a concurrent reader (another rank under torchrun) sees
either no file or a complete one. Every rank maps the token file (``numpy.memmap``): the corpus
is read from the page cache, which the ranks of a machine share, and no rank holds it in its
own memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lowcomm.atomic import atomic_path, atomic_write_bytes, atomic_write_text
from lowcomm.data.config import DataConfig, DataError
from lowcomm.data.documents import Document, iter_documents, list_source_files

CACHE_FORMAT_VERSION = 2
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
    token_file: Path | None = None
    """The file of token ids the streams are mapped from (None: streams in memory)."""

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
    sources: list[tuple[str, str]],
    vocab_size: int,
    tokenizer: bytes | None = None,
    end_of_text: str = END_OF_TEXT,
    text_field: str = "text",
) -> str:
    """Hash the inputs that determine the tokenizer and the token ids.

    Args:
        sources: ``(source_name, SHA-256 of the file's bytes)`` pairs in reading order.
        vocab_size: Requested vocabulary size (0 for a given tokenizer).
        tokenizer: A given tokenizer's JSON (``--tokenizer``), or None for a trained BPE.
        end_of_text: The token after every document.
        text_field: The JSONL field (parquet or Arrow column) holding the text.

    Returns:
        A hex SHA-256 digest.
    """
    digest = hashlib.sha256()
    digest.update(f"lowcomm-corpus-v{CACHE_FORMAT_VERSION}\0vocab={vocab_size}\0".encode())
    if tokenizer is not None:
        digest.update(b"tokenizer\0" + hashlib.sha256(tokenizer).digest())
    digest.update(b"end_of_text\0" + end_of_text.encode("utf-8") + b"\0")
    digest.update(b"text_field\0" + text_field.encode("utf-8") + b"\0")
    for source_name, content in sources:
        digest.update(source_name.encode("utf-8", errors="replace") + b"\0")
        digest.update(content.encode() + b"\0")
    return digest.hexdigest()


def file_digest(path: Path, cache_dir: Path) -> str:
    """The SHA-256 of ``path``'s bytes, read as a stream once and then remembered in the cache
    for the file's size, modification time and inode (a changed file is hashed again)."""
    status = path.stat()
    stamp = [status.st_size, status.st_mtime_ns, status.st_ino]
    memo = (
        cache_dir / "digests" / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()}.json"
    )
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        remembered = json.loads(memo.read_text())
        if remembered["stamp"] == stamp:
            return str(remembered["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    with contextlib.suppress(OSError):  # (a cache that cannot be written only costs time)
        atomic_write_text(memo, json.dumps({"stamp": stamp, "sha256": digest.hexdigest()}))
    return digest.hexdigest()


Waiting = Callable[[str], None]
"""Told, now and then, that this process waits for another one preparing the corpus."""

WAIT_REPORT_FIRST_S = 5.0
WAIT_REPORT_EVERY_S = 30.0


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, waiting: Waiting | None = None) -> Iterator[None]:
    """Hold an advisory lock so concurrent preparers tokenize only once; the others wait
    here, on a file lock (never inside a collective), saying so through ``waiting`` after
    :data:`WAIT_REPORT_FIRST_S` and every :data:`WAIT_REPORT_EVERY_S` after that.

    Atomic writes alone keep files whole; the lock additionally stops every rank from
    spending time tokenizing the same text. Where ``fcntl`` is unavailable the lock is a
    no-op and correctness still rests on the atomic writes.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a+b") as handle:
        started = time.monotonic()
        next_report = WAIT_REPORT_FIRST_S
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if waiting is not None and waited >= next_report:
                    waiting(
                        f"waiting {waited:.0f} s for another process preparing the corpus "
                        f"(lock {lock_path})"
                    )
                    next_report += WAIT_REPORT_EVERY_S
                time.sleep(0.1)
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
    documents: Iterable[Document], vocab_size: int, end_of_text: str = END_OF_TEXT
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


def token_dtype(vocab_size: int) -> type[np.unsignedinteger[Any]]:
    """The narrowest dtype the cache stores this vocabulary's ids in."""
    # uint16 halves the cache size and the pages read for the usual vocabularies (< 65536 ids).
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


TOKENIZE_BATCH_DOCUMENTS = 1024
TOKENIZE_BATCH_CHARACTERS = 1 << 24
"""Documents are tokenized (``encode_batch``) and written in batches of at most this many
documents or characters, so the tokenizing process holds one batch of text, not the corpus."""


def _batched(documents: Iterable[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    characters = 0
    for document in documents:
        batch.append(document)
        characters += len(document[1])
        if len(batch) >= TOKENIZE_BATCH_DOCUMENTS or characters >= TOKENIZE_BATCH_CHARACTERS:
            yield batch
            batch, characters = [], 0
    if batch:
        yield batch


def _write_tokens(
    tokenizer: Any, documents: Iterable[Document], eot_id: int, vocab_size: int, path: Path
) -> dict[str, Any]:
    """Tokenize ``documents`` into the raw token file ``path`` (each document followed by
    ``eot_id``), atomically; return the description :func:`_load_corpus` reads."""
    dtype = token_dtype(vocab_size)
    source_names: list[str] = []
    lengths: list[int] = []
    count = 0
    end_of_text = np.array([eot_id], dtype=dtype)
    with atomic_path(path) as temporary, open(temporary, "wb") as handle:
        for batch in _batched(documents):
            encodings = tokenizer.encode_batch([text for _, text in batch])
            for (source_name, _), encoding in zip(batch, encodings, strict=True):
                if not source_names or source_names[-1] != source_name:
                    source_names.append(source_name)
                    lengths.append(0)
                ids = np.asarray(encoding.ids, dtype=dtype)
                handle.write(ids.tobytes() + end_of_text.tobytes())
                lengths[-1] += len(ids) + 1
                count += 1
        handle.flush()
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "dtype": np.dtype(dtype).name,
        "vocab_size": vocab_size,
        "eot_id": eot_id,
        "source_names": source_names,
        "source_lengths": lengths,
        "num_documents": count,
    }


Loaded = tuple[list[str], list[TokenArray], int, int, int]
"""``(source names, token stream per source, vocabulary size, end-of-text id, documents)``."""


def map_tokens(path: Path, dtype: str, offset: int = 0) -> TokenArray:
    """``path``'s token ids from byte ``offset`` on, mapped read-only (not read into memory)."""
    mapped: TokenArray = np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=offset)
    return mapped


def _load_corpus(description_path: Path, tokens_path: Path) -> Loaded | None:
    """Map a cached corpus, or None if it is missing, unreadable or from another format."""
    try:
        description = json.loads(description_path.read_text())
        if description["format_version"] != CACHE_FORMAT_VERSION:
            return None
        lengths = [int(length) for length in description["source_lengths"]]
        names = [str(name) for name in description["source_names"]]
        dtype = np.dtype(str(description["dtype"]))
        if tokens_path.stat().st_size != sum(lengths) * dtype.itemsize or not lengths:
            return None
        flat = map_tokens(tokens_path, dtype.name)
    except (OSError, KeyError, ValueError, TypeError):
        # A corrupt or foreign entry is rebuilt rather than trusted.
        return None
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    streams = [flat[begin:stop] for begin, stop in itertools.pairwise(starts)]
    return (
        names, streams, int(description["vocab_size"]), int(description["eot_id"]),
        int(description["num_documents"]),
    )  # fmt: skip


def split_streams(
    streams: list[TokenArray], val_fraction: float
) -> tuple[list[TokenArray], list[TokenArray]]:
    """Each stream's first ``1 - val_fraction`` for training, the rest held out (views)."""
    train: list[TokenArray] = []
    validation: list[TokenArray] = []
    for stream in streams:
        # ceil so that every non-empty source contributes at least one held-out token.
        held_out = min(len(stream), math.ceil(len(stream) * val_fraction))
        boundary = len(stream) - held_out
        train.append(stream[:boundary])
        validation.append(stream[boundary:])
    return train, validation


def prepare_text_corpus(
    config: DataConfig,
    *,
    report: Callable[[str], None] | None = None,
    waiting: Waiting | None = None,
) -> PreparedCorpus:
    """Read, tokenize and split the configured text, reusing the cache when possible (a file
    of token ids goes to :func:`lowcomm.data.prepare.prepare_corpus` instead).

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
    files = list_source_files(config.data)
    given = _given_tokenizer(config)
    end_of_text, parsed = _end_of_text(config, given)
    cache_dir = config.resolved_cache_dir()
    key = cache_key(
        [(name, file_digest(path, cache_dir)) for name, path in files],
        0 if given is not None else config.vocab_size, given, end_of_text, config.text_field,
    )  # fmt: skip
    tokenizer_path, description_path, tokens_path = _cache_paths(cache_dir, key)

    def finish(loaded: Loaded, from_cache: bool) -> PreparedCorpus:
        return _prepared(config, key, end_of_text, loaded, from_cache)

    # Fast path without the lock: a complete cache entry is immutable once it exists.
    loaded = _load_corpus(description_path, tokens_path) if tokenizer_path.exists() else None
    if loaded is not None:
        return finish(loaded, from_cache=True)
    with exclusive_lock(cache_dir / "locks" / f"{key}.lock", waiting):
        # Another process may have finished while this one waited for the lock.
        loaded = _load_corpus(description_path, tokens_path) if tokenizer_path.exists() else None
        if loaded is not None:
            return finish(loaded, from_cache=True)
        _tokenize(config, files, (given, parsed, end_of_text), _cache_paths(cache_dir, key), report)
        loaded = _load_corpus(description_path, tokens_path)
    assert loaded is not None, f"the corpus just written to {tokens_path} does not load"
    return finish(loaded, from_cache=False)


def _prepared(
    config: DataConfig, key: str, end_of_text: str, loaded: Loaded, from_cache: bool
) -> PreparedCorpus:
    """The corpus of cache entry ``key``, split into train and validation streams."""
    source_names, streams, vocab_size, eot_id, documents = loaded
    train, validation = split_streams(streams, config.val_fraction)
    tokenizer_path, _, tokens_path = _cache_paths(config.resolved_cache_dir(), key)
    return PreparedCorpus(
        tokenizer_path=tokenizer_path, vocab_size=vocab_size, eot_id=eot_id,
        source_names=source_names, train_tokens=train, val_tokens=validation,
        cache_key=key, from_cache=from_cache, num_documents=documents,
        end_of_text=end_of_text, token_file=tokens_path,
    )  # fmt: skip


def _cache_paths(cache_dir: Path, key: str) -> tuple[Path, Path, Path]:
    """The cache entry ``key``: its tokenizer, its corpus description and its token file."""
    return (
        cache_dir / "tokenizers" / f"{key}.json",
        cache_dir / "corpora" / f"{key}.json",
        cache_dir / "corpora" / f"{key}.tokens",
    )


def _tokenize(
    config: DataConfig,
    files: list[tuple[str, Path]],
    tokenizer_choice: tuple[bytes | None, Any, str],
    paths: tuple[Path, Path, Path],
    report: Callable[[str], None] | None,
) -> None:
    """Train (or take) the tokenizer and write the cache entry's token file and description.

    Args:
        tokenizer_choice: the given tokenizer's bytes (None: train a BPE), its parse, and the
            end-of-text token placed after every document.
        paths: the entry's tokenizer, description and token file (:func:`_cache_paths`).
    """
    given, parsed, end_of_text = tokenizer_choice
    tokenizer_path, description_path, tokens_path = paths

    def documents() -> Iterator[Document]:
        return iter_documents(config.data, config.text_field, files)

    tokenizer = _tokenizer_for(config, tokenizer_path, given, parsed, documents, report)
    if report is not None:
        report(f"tokenizing {len(files):,} file{'s' if len(files) != 1 else ''} into {tokens_path}")
    description = _write_tokens(
        tokenizer, documents(), tokenizer.token_to_id(end_of_text),  # resolve_end_of_text checked it
        int(tokenizer.get_vocab_size()), tokens_path,
    )  # fmt: skip
    atomic_write_text(description_path, json.dumps(description))


def _tokenizer_for(
    config: DataConfig,
    tokenizer_path: Path,
    given: bytes | None,
    parsed: Any,
    documents: Callable[[], Iterator[Document]],
    report: Callable[[str], None] | None,
) -> Any:
    """The cached tokenizer, else the given one, else a BPE trained on ``documents`` (both
    written to ``tokenizer_path``)."""
    if tokenizer_path.exists():
        return _import_tokenizers().Tokenizer.from_file(str(tokenizer_path))
    if given is not None:
        atomic_write_bytes(tokenizer_path, given)
        return parsed
    if report is not None:
        report(
            f"training a {config.vocab_size}-token BPE tokenizer on the text (first use of "
            f"this text; cached in {config.resolved_cache_dir()})"
        )
    end_of_text = config.end_of_text or END_OF_TEXT
    tokenizer = _train_tokenizer(documents(), config.vocab_size, end_of_text)
    atomic_write_bytes(tokenizer_path, tokenizer.to_str().encode("utf-8"))
    return tokenizer


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
