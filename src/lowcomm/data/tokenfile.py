"""Files of token ids (``--data FILE.npy`` or ``FILE.bin``), mapped rather than read.

A nanoGPT-style pipeline writes a corpus as one flat array of token ids: ``train.bin``, raw
``uint16`` (or ``uint32`` for vocabularies above 65,536 ids), or a ``.npy`` file, whose header
carries the dtype. lowcomm maps such a file with ``numpy.memmap`` in every rank and never copies
it: a rank's memory holds the micro-batches it draws, and the file's pages sit in the page
cache that every rank of a machine shares.

The ids mean nothing without the tokenizer that wrote them, so a token file needs
``--tokenizer`` (or ``--init-from`` a model directory that has one). The file is checked once:
dtype, a whole number of ids, not empty, every id below the tokenizer's vocabulary. The check's
result is kept in the cache (keyed by the file's path, size, modification time and dtype, and
the tokenizer), so the ranks of a run, and later runs, do not read the whole file again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from lowcomm.atomic import atomic_write_bytes, atomic_write_text
from lowcomm.data.config import TOKEN_DTYPES, TOKEN_FILE_SUFFIXES, DataConfig, DataError
from lowcomm.data.corpus import (
    CACHE_FORMAT_VERSION,
    PreparedCorpus,
    TokenArray,
    Waiting,
    _end_of_text,
    _given_tokenizer,
    exclusive_lock,
    map_tokens,
    split_streams,
)

SCAN_CHUNK_TOKENS = 1 << 24
"""Ids checked per step of the one pass over a token file (32 MB of uint16)."""

CONVERT = "np.save('tokens.npy', ids.astype(np.uint32))"


def is_token_file(data: str | None) -> bool:
    """Whether ``--data`` names a file of token ids (by its suffix)."""
    return data is not None and str(data).lower().endswith(TOKEN_FILE_SUFFIXES)


def open_token_file(path: Path, data_dtype: str | None) -> TokenArray:
    """Map ``path``'s token ids read-only, refusing (one line naming the rule and the fix) a
    file of another dtype, of a size that is not a whole number of ids, or an empty one.

    Args:
        path: A ``.npy`` file (its header gives the dtype) or a raw ``.bin`` file.
        data_dtype: ``--data-dtype`` (required for ``.bin``; for ``.npy``, if given, it must
            agree with the header).
    """
    if not path.is_file():
        raise DataError(f"--data: {path} is not a file; pass a .npy or .bin file of token ids")
    if path.name.lower().endswith(".npy"):
        tokens = _open_npy(path)
        if data_dtype is not None and data_dtype != tokens.dtype.name:
            raise DataError(
                f"--data-dtype: {data_dtype} but {path}'s header says {tokens.dtype.name}; "
                f"omit --data-dtype for a .npy file (its header gives the dtype)"
            )
    else:
        tokens = _open_bin(path, data_dtype)
    if len(tokens) == 0:
        raise DataError(f"--data: {path} holds no token ids (it is empty); pass a non-empty file")
    return tokens


def _open_npy(path: Path) -> TokenArray:
    try:
        tokens: TokenArray = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise DataError(
            f"--data: {path} is not a .npy file ({error}); write it with np.save, or name a raw "
            f"file of ids .bin and pass --data-dtype"
        ) from None
    if tokens.dtype.name not in TOKEN_DTYPES:
        raise DataError(
            f"--data: {path} holds {tokens.dtype.name} values; token ids must be "
            f"{' or '.join(TOKEN_DTYPES)}; convert it, e.g. {CONVERT}"
        )
    if tokens.ndim != 1:
        raise DataError(
            f"--data: {path} is an array of shape {tokens.shape}; a token file is one flat "
            f"(1-D) stream of ids; save ids.reshape(-1)"
        )
    return tokens


def _open_bin(path: Path, data_dtype: str | None) -> TokenArray:
    if data_dtype is None:
        raise DataError(
            f"--data-dtype: not given, and {path} is a raw .bin file that does not say how wide "
            f"its ids are; pass --data-dtype uint16 (nanoGPT's) or --data-dtype uint32"
        )
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"--data: {path} holds no token ids (it is empty); pass a non-empty file")
    width = np.dtype(data_dtype).itemsize
    if size % width:
        raise DataError(
            f"--data: {path} is {size:,} bytes, not a whole number of {data_dtype} ids "
            f"({width} bytes each); pass the --data-dtype it was written with, or a whole file"
        )
    return map_tokens(path, data_dtype)


def _scan(path: Path, tokens: TokenArray, vocab_size: int, eot_id: int) -> int:
    """Check every id against the vocabulary in one chunked pass; return how many end-of-text
    ids (documents) the file holds."""
    documents = 0
    for begin in range(0, len(tokens), SCAN_CHUNK_TOKENS):
        chunk = np.asarray(tokens[begin : begin + SCAN_CHUNK_TOKENS])
        largest = int(chunk.max())
        if largest >= vocab_size:
            where = begin + int(np.argmax(chunk >= vocab_size))
            raise DataError(
                f"--data: {path} holds token id {largest} (first out-of-range id at position "
                f"{where:,}), but the tokenizer has {vocab_size:,} tokens, so ids must be below "
                f"{vocab_size:,}; pass the --tokenizer that wrote the file"
            )
        documents += int(np.count_nonzero(chunk == eot_id))
    return documents


def _key(path: Path, tokens: TokenArray, given: bytes, end_of_text: str) -> str:
    status = path.stat()
    digest = hashlib.sha256()
    digest.update(f"lowcomm-token-file-v{CACHE_FORMAT_VERSION}\0".encode())
    for part in (str(path.resolve()), status.st_size, status.st_mtime_ns, tokens.dtype.name):
        digest.update(f"{part}\0".encode())
    digest.update(hashlib.sha256(given).digest() + end_of_text.encode("utf-8"))
    return digest.hexdigest()


def prepare_token_file(
    config: DataConfig, *, report: Any = None, waiting: Waiting | None = None
) -> PreparedCorpus:
    """The corpus of a token file: one source (the file), its last ``val_fraction`` held out,
    mapped from the file itself (see the module docstring)."""
    path = Path(str(config.data)).expanduser()
    tokens = open_token_file(path, config.data_dtype)
    given = _given_tokenizer(config)
    if given is None:
        raise DataError(
            f"--tokenizer: not given, and {path} holds token ids, which mean nothing without the "
            f"tokenizer that wrote them; pass --tokenizer tokenizer.json (or --init-from a model "
            f"directory that has one)"
        )
    end_of_text, tokenizer = _end_of_text(config, given)
    cache_dir = config.resolved_cache_dir()
    key = _key(path, tokens, given, end_of_text)
    tokenizer_path = cache_dir / "tokenizers" / f"{key}.json"
    checked_path = cache_dir / "corpora" / f"{key}.json"
    from_cache = checked_path.exists()
    if not from_cache:
        with exclusive_lock(cache_dir / "locks" / f"{key}.lock", waiting):
            if not checked_path.exists():
                if report is not None:
                    report(f"checking the {len(tokens):,} token ids of {path} (once)")
                vocab_size = int(tokenizer.get_vocab_size())
                eot_id = int(tokenizer.token_to_id(end_of_text))
                documents = _scan(path, tokens, vocab_size, eot_id)
                atomic_write_bytes(tokenizer_path, given)
                checked = {"vocab_size": vocab_size, "eot_id": eot_id, "num_documents": documents}
                atomic_write_text(checked_path, json.dumps(checked))
    checked = json.loads(checked_path.read_text())
    train, validation = split_streams([tokens], config.val_fraction)
    return PreparedCorpus(
        tokenizer_path=tokenizer_path, vocab_size=int(checked["vocab_size"]),
        eot_id=int(checked["eot_id"]), source_names=[path.name], train_tokens=train,
        val_tokens=validation, cache_key=key, from_cache=from_cache,
        num_documents=int(checked["num_documents"]), end_of_text=end_of_text, token_file=path,
    )  # fmt: skip
