"""Prompts from user data: JSONL, JSON, CSV and Parquet files, and `datasets` folders saved with
`save_to_disk`.

A prompt is a string, or a list of chat messages ({"role", "content"}: TRL's conversational
format). The answer column is optional (prompt-only data, as TRL's quickstart uses, trains on
reward functions alone): a string or a number is the reference a verifier reads; a null, a
list or any other value leaves the row without one. Every column but the prompt, the answer
column included, travels to the reward functions as the dataset gives it.

Bad data must fail early (before a model is loaded) with one line that names the
file and the row, or be skipped and counted when the user asks for that.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable

from covey.runtime.errors import first_line
from covey.tasks.base import Example, messages_text

ON_ERROR = ("raise", "skip")


class DataError(ValueError):
    """A one-line, user-facing problem with a dataset: '<file>:<line>: <problem>'."""


class _RowError(Exception):
    """A problem with one row; the caller adds the location."""


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


ROLES = ("system", "user", "assistant")


def check_messages(value: Any, key: str) -> tuple:
    """A conversational prompt: a non-empty list of {"role", "content"} messages ending with the user's."""
    if not value:
        raise _RowError(f"field {key!r} is an empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise _RowError(f"field {key!r} message {i} must be {{\"role\": one of {'/'.join(ROLES)}, "
                            f"\"content\": a string}}, got {str(m)[:60]}")
    if value[-1]["role"] != "user":
        raise _RowError(f"field {key!r}: the last message must be the user's, got {value[-1]['role']!r}")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


ANSWER_COLUMNS = ("answer", "answers", "solution", "target", "label", "ground_truth", "gold", "output",
                  "reference", "response", "completion")
"""Column names that often hold the reference answer (a missing task.answer_key names them)."""

PROMPT_COLUMNS = ("prompt", "question", "problem", "query", "instruction", "input", "text", "messages")
"""Column names that often hold the prompt (a missing task.prompt_key names them)."""


def key_hint(columns, key: str, setting: str, likely: tuple[str, ...]) -> str:
    """'; set task.answer_key=solution' when `key` is missing and a likely column is there; else ''."""
    found = [c for c in likely if c in columns and c != key]
    return f"; set {setting}={found[0]}" if found else ""


def row_to_example(row: Any, prompt_key: str = "prompt", answer_key: str = "answer") -> Example:
    """Validate one row. `answer` is the reference as a verifier reads it (a number as its text), None
    where the row has none (no answer field, null, a list, ...); `meta` holds every column but the
    prompt as the dataset gives it, the answer column included."""
    if not isinstance(row, dict):
        raise _RowError(f"expected a JSON object, got {_type_name(row)}")
    if prompt_key not in row:
        raise _RowError(f"missing field {prompt_key!r} (the row has: {', '.join(map(str, row)) or 'nothing'}"
                        f"{key_hint(row, prompt_key, 'task.prompt_key', PROMPT_COLUMNS)})")
    prompt = row[prompt_key]
    messages = check_messages(prompt, prompt_key) if isinstance(prompt, (list, tuple)) else None
    if messages is not None:
        prompt = messages_text(messages)
    if not isinstance(prompt, str):
        raise _RowError(f"field {prompt_key!r} must be a string or a list of chat messages, got {_type_name(prompt)}")
    if not prompt.strip():
        raise _RowError(f"field {prompt_key!r} is empty")
    meta = {k: v for k, v in row.items() if k != prompt_key}  # reward functions get each column as it is
    return Example(prompt=prompt, answer=reference_answer(row, answer_key), meta=meta, messages=messages)


def reference_answer(row: dict, answer_key: str) -> str | None:
    """The row's answer as a verifier reads it: a string (trimmed) or a number (as text); None for no
    answer field, null, a list or any other value (reward functions still get it as it is)."""
    answer = row.get(answer_key)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return None
    answer = str(answer).strip()
    if not answer:
        raise _RowError(f"field {answer_key!r} is empty")
    return answer


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


def _collect(rows: Iterable[tuple[str, Any]], prompt_key: str, answer_key: str,
             on_error: str) -> tuple[list[Example], int]:
    """Turn (location, row-or-_RowError) pairs into examples, raising or counting errors. The answer
    field is optional for a whole dataset, not for some of its rows: once one row has it, a row
    without it is a bad row (rows without it read before that one are reported, or skipped, then)."""
    examples, skipped = [], 0
    lacking: list[tuple[str, int]] = []  # (where, index) of rows without the answer field, while no row had it
    answered = False
    for where, row in rows:
        try:
            if isinstance(row, _RowError):
                raise row
            example = dataclasses.replace(row_to_example(row, prompt_key, answer_key), source=where)
            has_answer = answer_key in row
            if answered and not has_answer:
                raise _RowError(f"missing field {answer_key!r} (other rows have it)")
            if has_answer and not answered:
                answered = True
                if lacking and on_error == "raise":
                    raise DataError(f"{lacking[0][0]}: missing field {answer_key!r} (other rows have it, "
                                    f"such as {where})")
                drop = {i for _, i in lacking}
                examples, skipped = [ex for i, ex in enumerate(examples) if i not in drop], skipped + len(drop)
            if not answered:
                lacking.append((where, len(examples)))
            examples.append(example)
        except _RowError as err:
            if on_error == "raise":
                raise DataError(f"{where}: {err}") from None
            skipped += 1
    return examples, skipped


def _jsonl_rows(path: Path) -> Iterable[tuple[str, Any]]:
    """Yield ('file:line', parsed row or _RowError); blank lines are ignored."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark is not data
            except UnicodeDecodeError as err:
                yield where, _RowError(f"not valid UTF-8 ({err.reason} at byte {err.start})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                # json's own message may end in "at" ("Unterminated string starting at"): no second one
                at = "" if err.msg.endswith(" at") else " at"
                yield where, _RowError(f"invalid JSON: {err.msg}{at} column {err.colno}")


def _require_nonempty(examples: list[Example], skipped: int, where: str) -> None:
    if not examples:
        why = f"all {skipped} rows were invalid and skipped" if skipped else "no rows"
        raise DataError(f"{where}: empty dataset ({why})")


def load_jsonl(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
               on_error: str = "raise") -> tuple[list[Example], int]:
    """Read one JSON object per line -> (examples, number of rows skipped).

    on_error="raise" stops at the first bad row; "skip" drops bad rows and counts them.
    An empty result is always an error: training on nothing is never intended.
    """
    return _read_file(path, _jsonl_rows, prompt_key, answer_key, on_error)


def _read_file(path: str | Path, reader, prompt_key: str, answer_key: str, on_error: str) -> tuple[list[Example], int]:
    """`reader`'s rows of the file at `path` -> (examples, rows skipped); a missing file or no rows is a DataError."""
    _check_on_error(on_error)
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found" + (HUB_HINT if looks_like_hub_id(str(path)) else ""))
    examples, skipped = _collect(reader(path), prompt_key, answer_key, on_error)
    _require_nonempty(examples, skipped, str(path))
    return examples, skipped


def _import_datasets():
    try:
        import datasets  # noqa: PLC0415  (optional dependency, imported on use)
    except ImportError:
        raise ImportError("loading a Hugging Face dataset needs the 'datasets' package: "
                          "pip install 'covey[datasets]'") from None
    return datasets


def _pick_split(ds: Any, split: str | None, path: Path) -> Any:
    """A DatasetDict needs a split unless it has exactly one; a Dataset takes none."""
    if not hasattr(ds, "keys"):
        if split is not None:
            raise DataError(f"{path}: split {split!r} requested but the dataset has no splits")
        return ds
    names = list(ds.keys())
    if split is None:
        if len(names) != 1:
            raise DataError(f"{path}: the dataset has splits {', '.join(names)}: choose one with task.split "
                            "(and task.eval_split for the held-out one)")
        split = names[0]
    if split not in names:
        raise DataError(f"{path}: no split {split!r} (task.split / task.eval_split); available: {', '.join(names)}")
    return ds[split]


def load_hf_dataset(path: str | Path, split: str | None = None, prompt_key: str = "prompt",
                    answer_key: str = "answer", on_error: str = "raise") -> tuple[list[Example], int]:
    """Read a `datasets` Dataset/DatasetDict saved with `save_to_disk` -> (examples, skipped)."""
    _check_on_error(on_error)
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: dataset folder not found")
    datasets = _import_datasets()
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise DataError(f"{path}: not a dataset saved with save_to_disk ({first_line(err)})") from None
    ds = _pick_split(ds, split, path)
    where = f"{path}[{split}]" if split else str(path)
    if prompt_key not in ds.column_names:  # the answer column is optional (prompt-only data)
        raise DataError(f"{where}: missing column {prompt_key!r} (columns: {', '.join(ds.column_names)}"
                        f"{key_hint(ds.column_names, prompt_key, 'task.prompt_key', PROMPT_COLUMNS)})")
    rows = ((f"{where} row {i}", row) for i, row in enumerate(ds))
    examples, skipped = _collect(rows, prompt_key, answer_key, on_error)
    _require_nonempty(examples, skipped, where)
    return examples, skipped


def _csv_rows(path: Path) -> Iterable[tuple[str, Any]]:
    """Yield ('file:line', row dict) from a CSV file with a header row (every value a string); a
    byte-order mark (Excel's "CSV UTF-8") is not part of the first column's name."""
    import csv
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        try:
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if None in row or any(v is None for v in row.values()):
                    yield where, _RowError(f"the row's field count differs from the header's "
                                           f"({len(reader.fieldnames)} fields)")
                else:
                    yield where, row
        except (csv.Error, UnicodeDecodeError) as err:
            yield f"{path}:{reader.line_num}", _RowError(f"unreadable CSV: {first_line(err)}")


def json_rows(path: Path) -> Iterable[tuple[str, Any]]:
    """Yield ('file row i', row) from a JSON file holding one list of objects."""
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: invalid JSON: {first_line(err)}") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects (one per row), got {_type_name(data)}")
    return ((f"{path} row {i}", row) for i, row in enumerate(data))


def _parquet_rows(path: Path) -> Iterable[tuple[str, Any]]:
    """Yield ('file row i', row) from a Parquet file (pyarrow, installed with covey[datasets])."""
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415  (optional dependency, imported on use)
    except ImportError:
        raise ImportError("reading a Parquet file needs pyarrow: pip install 'covey[datasets]'") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({first_line(err)})") from None
    return ((f"{path} row {i}", row) for i, row in enumerate(rows))


FILE_READERS = {".jsonl": _jsonl_rows, ".json": json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}


def load_file(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
              on_error: str = "raise") -> tuple[list[Example], int]:
    """A JSONL, JSON (a list of objects), CSV (with a header) or Parquet file, by its suffix; any
    other suffix is read as JSONL. -> (examples, rows skipped)."""
    reader = FILE_READERS.get(Path(path).suffix.lower(), _jsonl_rows)
    return _read_file(path, reader, prompt_key, answer_key, on_error)


HUB_HINT = (": it looks like a Hugging Face hub id, and covey reads data from files only (no hub access at run "
            "time): save it first with datasets.load_dataset(...).save_to_disk(FOLDER), then task.path=FOLDER")


def looks_like_hub_id(text: str) -> bool:
    """'org/name' with no file suffix and nothing of it on disk: what a TRL script's dataset_name looks like."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not Path(text).suffix and not Path(parts[0]).exists()


def load_examples(source: str | Path, **kwargs) -> tuple[list[Example], int]:
    """Dispatch on the path: a folder -> `load_hf_dataset`, else `load_file` (`split` ignored)."""
    path = Path(source)
    if path.is_dir():
        return load_hf_dataset(path, **kwargs)
    kwargs.pop("split", None)
    return load_file(path, **kwargs)
