"""Finding and reading training text.

A *document* is ``(source_name, text)``. A *source* is one input file: a text file is one
document, a JSONL file holds one document per line, a parquet file or a dataset's Arrow file
(``datasets``' ``save_to_disk``) one per row. Sources matter for the validation split (held
out per source) and for non-IID sharding (workers get different sources). JSONL, parquet and
Arrow files are read as a stream (line by line, batch by batch): only the tokenizing process
reads the text, and never the whole of a large file at once.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from lowcomm.data.config import DataError

BUNDLED_CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
"""The six Jane Austen novels shipped as package data."""

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
"""A dataset saved by ``datasets``' ``save_to_disk`` (Arrow IPC stream files); read only
through the folder that holds its ``state.json``."""

PYARROW_MISSING = "install pyarrow (pip install 'lowcomm[data]')"

Document = tuple[str, str]
"""``(source_name, text)``."""


def _has_suffix(path: Path, suffixes: tuple[str, ...]) -> bool:
    return path.name.lower().endswith(suffixes)


MAX_BAD_BYTE_FRACTION = 0.001
"""Text may hold at most this fraction of bytes that are not UTF-8 (or NUL), at least one byte:
a stray invalid byte in a large scraped file becomes U+FFFD and training goes on, but a file
with more is not UTF-8 text (binary, an executable, another encoding) and is refused."""


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _decode_counting(raw: bytes) -> tuple[str, int, int]:
    """``raw`` as text (undecodable bytes as U+FFFD, NUL as U+FFFD), with the counts of NUL
    bytes and of bytes that are not UTF-8."""
    nul = raw.count(b"\x00")
    if not nul:
        try:
            return raw.decode("utf-8"), 0, 0
        except UnicodeDecodeError:
            pass
    # surrogateescape turns each undecodable byte into one lone surrogate we can count.
    text = raw.decode("utf-8", errors="surrogateescape")
    invalid = len(_ESCAPED_BYTE.findall(text))
    cleaned = (
        text.encode("utf-8", errors="surrogateescape")
        .decode("utf-8", errors="replace")
        .replace("\x00", "\ufffd")
    )
    return cleaned, nul, invalid


def _refuse_if_not_text(path: Path, nul: int, invalid: int, size: int) -> None:
    """Refuse ``path`` when its bad bytes exceed :data:`MAX_BAD_BYTE_FRACTION` of ``size``."""
    bad = invalid + nul
    if bad > max(1, MAX_BAD_BYTE_FRACTION * size):
        what = f"{nul:,} NUL bytes" if nul > invalid else f"{invalid:,} bytes that are not UTF-8"
        raise DataError(
            f"--data: {path} is not UTF-8 text ({what} in {size:,}, "
            f"{bad / size:.1%}; at most {MAX_BAD_BYTE_FRACTION:.1%} is tolerated); pass "
            f"text files only, or convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        )


def _decode(path: Path, raw: bytes) -> str:
    """``raw`` as text, refusing (naming ``path``) what is not UTF-8 text."""
    text, nul, invalid = _decode_counting(raw)
    _refuse_if_not_text(path, nul, invalid, len(raw))
    return text


def _read_text(path: Path) -> str:
    """The file's text: gzip-decompressed for ``.gz``; refused, naming the file, if it is not
    UTF-8 text beyond :data:`MAX_BAD_BYTE_FRACTION`."""
    try:
        if path.name.lower().endswith(".gz"):
            with gzip.open(path, "rb") as handle:
                raw = handle.read()
        else:
            raw = path.read_bytes()
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise DataError(
            f"--data: {path} is not a whole gzip file ({error}); pass a .txt.gz made by gzip, "
            f"or the uncompressed text"
        ) from None
    except OSError as error:
        raise DataError(f"--data: {path} cannot be read ({error.strerror or error})") from None
    return _decode(path, raw)


def _bad_gzip(path: Path, error: BaseException) -> DataError:
    return DataError(
        f"--data: {path} is not a whole gzip file ({error}); pass a .gz made by gzip, "
        f"or the uncompressed file"
    )


def _open_binary(path: Path) -> BinaryIO:
    """``path`` opened for reading bytes, gzip-decompressed for ``.gz``."""
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each non-blank line, read as a stream; the file is refused
    (naming it) when its bad bytes exceed :data:`MAX_BAD_BYTE_FRACTION`."""
    nul = invalid = size = 0
    try:
        with _open_binary(path) as handle:
            for line_number, raw in enumerate(handle, start=1):
                size += len(raw)
                text, line_nul, line_invalid = _decode_counting(raw)
                nul, invalid = nul + line_nul, invalid + line_invalid
                if line_nul or line_invalid:
                    _refuse_if_not_text(path, nul, invalid, max(size, 1000))
                if text.strip():
                    yield line_number, text
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise _bad_gzip(path, error) from None
    except OSError as error:
        raise DataError(f"--data: {path} cannot be read ({error.strerror or error})") from None
    if size:
        _refuse_if_not_text(path, nul, invalid, size)


def _iter_jsonl(path: Path, source_name: str, text_field: str) -> Iterator[Document]:
    for line_number, line in _jsonl_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"--data: {path}:{line_number} is not valid JSON ({error.msg}); "
                f"each line of a .jsonl file must be one JSON object"
            ) from error
        if not isinstance(record, dict):
            raise DataError(
                f"--data: {path}:{line_number} is a JSON {type(record).__name__}, not a JSON "
                f"object; each line of a .jsonl file must be one object holding --text-field"
            )
        if text_field not in record:
            fields = ", ".join(repr(str(name)) for name in sorted(record)[:20]) or "none"
            more = f" and {len(record) - 20} more" if len(record) > 20 else ""
            raise DataError(
                f"--data: {path}:{line_number} has no field {text_field!r} (its fields: "
                f"{fields}{more}); pass --text-field with the field that holds the text"
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(
                f"--data: {path}:{line_number} field {text_field!r} is "
                f"{type(text).__name__}, not a string; pass the field that holds the text"
            )
        if text:
            yield source_name, text


def _import_pyarrow(path: Path) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"--data: reading {path} needs pyarrow; {PYARROW_MISSING}") from None
    return pyarrow


def _text_column(path: Path, schema: Any, text_field: str) -> None:
    """Refuse a table whose ``text_field`` is missing or not a string column."""
    pyarrow = _import_pyarrow(path)
    names = list(schema.names)
    if text_field not in names:
        fields = ", ".join(repr(name) for name in names[:20]) or "none"
        raise DataError(
            f"--data: {path} has no column {text_field!r} (its columns: {fields}); pass "
            f"--text-field with the column that holds the text"
        )
    kind = schema.field(text_field).type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
        raise DataError(
            f"--data: {path} column {text_field!r} is {kind}, not a string; pass "
            f"--text-field with the column that holds the text (token ids go in a .npy file)"
        )


def _table_batches(path: Path, text_field: str) -> Iterator[Any]:
    """The record batches of a parquet file or an Arrow stream file, ``text_field`` only."""
    pyarrow = _import_pyarrow(path)
    try:
        if _has_suffix(path, PARQUET_SUFFIXES):
            parquet = pyarrow.parquet.ParquetFile(path)
            _text_column(path, parquet.schema_arrow, text_field)
            yield from parquet.iter_batches(batch_size=1024, columns=[text_field])
            return
        with pyarrow.memory_map(str(path)) as source:
            reader = pyarrow.ipc.open_stream(source)
            _text_column(path, reader.schema, text_field)
            for batch in reader:
                yield batch.select([text_field])
    except (OSError, pyarrow.ArrowException) as error:
        raise DataError(
            f"--data: {path} cannot be read as {'parquet' if path.suffix == '.parquet' else 'an Arrow stream'} "
            f"({error}); pass a whole file"
        ) from None


def _iter_table(path: Path, source_name: str, text_field: str) -> Iterator[Document]:
    for batch in _table_batches(path, text_field):
        for text in batch.column(0).to_pylist():
            if text:
                yield source_name, text


def _iter_file(path: Path, source_name: str, text_field: str) -> Iterator[Document]:
    if _has_suffix(path, JSONL_SUFFIXES):
        yield from _iter_jsonl(path, source_name, text_field)
    elif _has_suffix(path, PARQUET_SUFFIXES + ARROW_SUFFIXES):
        yield from _iter_table(path, source_name, text_field)
    else:
        text = _read_text(path)
        if text:
            yield source_name, text


def _saved_dataset_files(root: Path) -> list[tuple[str, Path]] | None:
    """The Arrow files of a dataset saved with ``datasets``' ``save_to_disk`` (a
    ``DatasetDict``: its ``train`` split, or its only one), or None if ``root`` is not one."""
    splits_file = root / "dataset_dict.json"
    if splits_file.is_file():
        try:
            splits = [str(split) for split in json.loads(splits_file.read_text())["splits"]]
        except (OSError, ValueError, KeyError, TypeError):
            raise DataError(
                f"--data: {splits_file} is not a datasets dataset_dict.json; pass a folder "
                f"written by save_to_disk"
            ) from None
        if "train" not in splits and len(splits) != 1:
            raise DataError(
                f"--data: {root} is a DatasetDict without a 'train' split (its splits: "
                f"{', '.join(splits)}); pass one split's folder, e.g. --data {root / splits[0]}"
            )
        root = root / ("train" if "train" in splits else splits[0])
    state_file = root / "state.json"
    if not state_file.is_file():
        return None
    try:
        names = [
            str(entry["filename"]) for entry in json.loads(state_file.read_text())["_data_files"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(
            f"--data: {state_file} is not a datasets state.json; pass a folder written by "
            f"save_to_disk"
        ) from None
    return [(f"{root.name}/{name}", root / name) for name in names]


def list_source_files(data: str | None) -> list[tuple[str, Path]]:
    """Resolve ``--data`` into the files to read.

    Args:
        data: None for the bundled corpus, a file, a dataset saved with ``datasets``'
            ``save_to_disk``, or a folder (searched recursively).

    Returns:
        ``(source_name, path)`` pairs in a deterministic (sorted) order. A folder's sources are
        named by their path relative to the folder.

    Raises:
        DataError: If the path does not exist or a folder holds no usable files.
    """
    root = BUNDLED_CORPUS_DIR if data is None else Path(data).expanduser()
    if not root.exists():
        raise DataError(
            f"--data: path {data!r} does not exist; pass a text file, a folder of .txt/.jsonl "
            f"files, or omit --data to use the bundled corpus"
        )
    if root.is_file():
        return [(root.name, root)]
    saved = _saved_dataset_files(root)
    if saved is not None:
        return saved
    files = sorted(
        path
        for path in root.rglob("*")
        if path.is_file() and _has_suffix(path, TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)
    )
    if not files:
        raise DataError(
            f"--data: folder {str(root)!r} holds no .txt, .txt.gz, .jsonl or .parquet files; "
            f"add some, pass a single file, or omit --data to use the bundled corpus"
        )
    return [(path.relative_to(root).as_posix(), path) for path in files]


def iter_documents(
    data: str | None, text_field: str = "text", files: list[tuple[str, Path]] | None = None
) -> Iterator[Document]:
    """Read every document of the configured input as a stream (see :func:`read_documents`).

    Args:
        data: None for the bundled corpus, a file, or a folder (see :func:`list_source_files`).
        text_field: JSONL field (parquet, Arrow column) that holds the text.
        files: The sources already listed by :func:`list_source_files` (None: list them).

    Raises:
        DataError: If the input is missing, malformed, or holds no text at all (raised when
            the stream ends).
    """
    count = 0
    for source_name, path in list_source_files(data) if files is None else files:
        for document in _iter_file(path, source_name, text_field):
            count += 1
            yield document
    if not count:
        raise DataError(
            f"--data: {data!r} holds no text (every file or record is empty); "
            f"pass a non-empty text file, or omit --data to use the bundled corpus"
        )


def read_documents(data: str | None, text_field: str = "text") -> list[Document]:
    """Read every document of the configured input.

    Args:
        data: None for the bundled corpus, a file, or a folder (see :func:`list_source_files`).
        text_field: JSONL field that holds the text.

    Returns:
        The non-empty documents, in source order then file order.

    Raises:
        DataError: If the input is missing, malformed, or holds no text at all.
    """
    return list(iter_documents(data, text_field))
