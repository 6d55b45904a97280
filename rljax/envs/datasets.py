"""Dataset files -> :class:`~rljax.envs.base.Task` lists (SkyRL and verl row formats).

Files: ``.jsonl`` / ``.ndjson`` (one row per line), ``.json`` (a list of rows, or JSON lines as
HF ``Dataset.to_json`` writes them), ``.parquet``, and directories written by HF datasets'
``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose ``train`` / ``test`` split is read).

Row formats (``format="auto"`` tells them apart row by row):

* SkyRL: ``{"prompt": [messages], "env_class": "gsm8k", "reward_spec": {"method": "rule",
  "ground_truth": "72"}, "data_source": "openai/gsm8k", "extra_info": {...}}``
* verl: ``{"prompt": [messages], "reward_model": {"style": "rule", "ground_truth": "72"},
  "data_source": ..., "ability": ..., "extra_info": {...}}``

A row becomes ``Task(id, data=<the whole row>, env=<env_class, or the env argument>,
messages=prompt, reward_spec={"method", "ground_truth"}, data_source, extra_info, split)``. The
whole row stays in ``Task.data`` (skyrl-gym environments receive it as their ``extras``, and a
dispatching adapter finds ``env_class`` there even when a trainer renames ``Task.env``).

Ids: an ``id`` column (also ``uid`` / ``instance_id``) when present, else a content hash of the
row (``<data_source>-<sha256[:16]>``; an identical row repeated gets ``~1``, ``~2``, ... in file
order). Duplicate explicit ids are an error. Held-out splits: ``eval_fraction`` assigns each row to
"train" or "test" by a stable hash of ``(seed, id)``, so the two never share a row.

Every malformed row raises ``ValueError("<file>: row <i> (line <n>): field '<f>': <what>")``;
no row is ever skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rljax.envs.base import Task, split_of

__all__ = [
    "ROW_FORMATS",
    "load_dataset_tasks",
    "read_rows",
    "task_to_row",
    "write_rows",
]

#: Row formats of dataset files: ``auto`` (detected per row), SkyRL's, verl's.
ROW_FORMATS = ("auto", "skyrl", "verl")
ID_COLUMNS = ("id", "uid", "instance_id")
SPLIT_ALIASES = {"train": "train", "test": "test", "eval": "test", "validation": "test", "val": "test"}


class _RowError(ValueError):
    pass


def _where(path: str, index: int, line: int | None) -> str:
    return f"{path}: row {index}" + (f" (line {line})" if line is not None else "")


def read_rows(source: str | os.PathLike, *, split: str = "train") -> Iterator[tuple[int, int | None, Any]]:
    """Yields ``(row index, line number or None, row)`` from a dataset file or directory.

    ``split`` picks the split of an HF ``DatasetDict`` directory ("test" also finds "validation",
    "eval", "val").
    """
    path = pathlib.Path(source)
    if not path.exists():
        raise FileNotFoundError(f"dataset {str(path)!r} does not exist")
    if path.is_dir():
        yield from _read_hf_dir(path, split)
        return
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        yield from _read_jsonl(path)
    elif suffix == ".json":
        text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # not JSON lines either
                raise ValueError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
            yield from _read_jsonl(path)
            return
        if isinstance(data, Mapping) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json dataset is a list of rows, got {type(data).__name__}")
        for i, row in enumerate(data):
            yield i, None, row
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover
            raise ImportError("reading .parquet needs pyarrow (`pip install rljax[envs]`)") from e
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i, None, row
    else:
        raise ValueError(
            f"{path}: unknown dataset file type {suffix!r}; use .jsonl, .json, .parquet or an HF "
            "datasets save_to_disk directory"
        )


def _read_jsonl(path: pathlib.Path) -> Iterator[tuple[int, int | None, Any]]:
    index = 0
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{_where(str(path), index, lineno)}: not valid JSON: {e.msg}") from None
            yield index, lineno, row
            index += 1


def _read_hf_dir(path: pathlib.Path, split: str) -> Iterator[tuple[int, int | None, Any]]:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover
        raise ImportError(
            "reading a save_to_disk directory needs `datasets` (`pip install rljax[envs]`)"
        ) from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        wanted = [name for name, canon in SPLIT_ALIASES.items() if canon == SPLIT_ALIASES.get(split, split)]
        names = [n for n in ds if n in wanted]
        if not names:
            raise ValueError(
                f"{path}: DatasetDict has splits {sorted(ds)}, none of them is {split!r} ({wanted})"
            )
        ds = ds[names[0]]
    for i, row in enumerate(ds):
        yield i, None, row


def _messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value:
            raise _RowError("field 'prompt': empty string")
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)) and value:
        out = []
        for j, m in enumerate(value):
            if not isinstance(m, Mapping):
                raise _RowError(f"field 'prompt[{j}]': a message is a dict, got {type(m).__name__}")
            if not isinstance(m.get("role"), str) or not m.get("role"):
                raise _RowError(f"field 'prompt[{j}].role': missing or not a string ({m.get('role')!r:.40})")
            if not isinstance(m.get("content"), str):
                raise _RowError(
                    f"field 'prompt[{j}].content': missing or not a string ({m.get('content')!r:.40})"
                )
            out.append({k: v for k, v in m.items() if v is not None})
        return out
    raise _RowError(f"field 'prompt': a non-empty list of chat messages (or a string), got {value!r:.60}")


def _reward_spec(row: Mapping[str, Any], fmt: str) -> dict[str, Any] | None:
    key = "reward_spec" if fmt == "skyrl" else "reward_model"
    spec = row.get(key)
    if spec is None:
        if fmt == "verl":
            raise _RowError("field 'reward_model': missing (verl rows carry {style, ground_truth})")
        return None
    if not isinstance(spec, Mapping):
        raise _RowError(f"field {key!r}: a dict, got {type(spec).__name__}")
    method = spec.get("method") if fmt == "skyrl" else spec.get("style")
    method_key = "method" if fmt == "skyrl" else "style"
    if not isinstance(method, str) or not method:
        raise _RowError(f"field '{key}.{method_key}': missing or not a string ({method!r:.40})")
    out = {k: v for k, v in spec.items() if k not in ("method", "style")}
    out["method"] = method
    if ":" not in method and spec.get("ground_truth") is None:
        raise _RowError(f"field '{key}.ground_truth': missing (method {method!r} compares against it)")
    return out


def _detect(row: Mapping[str, Any], fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if "reward_spec" in row or "env_class" in row:
        return "skyrl"
    if "reward_model" in row:
        return "verl"
    raise _RowError(
        "field 'reward_spec': missing; a SkyRL row has env_class/reward_spec, a verl row reward_model "
        f"(row has {sorted(row)})"
    )


def _content_id(row: Mapping[str, Any], data_source: str | None) -> str:
    blob = json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return f"{data_source or 'row'}-{digest}"


def _parse_row(row: Any, fmt: str, env: str | None, split: str) -> tuple[Task, bool]:
    """The row's Task, and whether its id came from an id column."""
    if not isinstance(row, Mapping):
        raise _RowError(f"field '<row>': a row is a JSON object, got {type(row).__name__}")
    if "prompt" not in row:
        raise _RowError(f"field 'prompt': missing (row has {sorted(row)})")
    fmt = _detect(row, fmt)
    if fmt == "skyrl" and row.get("reward_spec") is None and not row.get("env_class"):
        raise _RowError("field 'reward_spec': missing (a SkyRL row has env_class and/or reward_spec)")
    messages = _messages(row["prompt"])
    spec = _reward_spec(row, fmt)
    env_class = row.get("env_class")
    if env_class is not None and (not isinstance(env_class, str) or not env_class):
        raise _RowError(f"field 'env_class': a non-empty string, got {env_class!r:.40}")
    data_source = row.get("data_source")
    if data_source is not None and not isinstance(data_source, str):
        raise _RowError(f"field 'data_source': a string, got {data_source!r:.40}")
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, Mapping):
        raise _RowError(f"field 'extra_info': a dict, got {type(extra_info).__name__}")
    explicit = next((c for c in ID_COLUMNS if row.get(c) is not None), None)
    if explicit is not None:
        value = row[explicit]
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
            raise _RowError(f"field {explicit!r}: a non-empty string or int, got {value!r:.40}")
        task_id = str(value)
    else:
        task_id = _content_id(row, data_source)
    demonstration = row.get("demonstration")
    if demonstration is not None and not isinstance(demonstration, str):
        raise _RowError(f"field 'demonstration': a string, got {type(demonstration).__name__}")
    task = Task(
        id=task_id,
        data=dict(row),
        env=env if env is not None else env_class,
        split=split,
        demonstration=demonstration,
        messages=messages,
        reward_spec=spec,
        data_source=data_source,
        extra_info=dict(extra_info or {}),
    )
    return task, explicit is not None


def load_dataset_tasks(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    format: str = "auto",  # noqa: A002 - the documented keyword
    split: str = "train",
    env: str | None = None,
    eval_fraction: float | None = None,
    seed: int = 0,
) -> list[Task]:
    """Tasks from dataset files (module docstring: file types, row formats, ids, errors).

    Args:
      source: a file or ``save_to_disk`` directory, or a list of them (read in order).
      format: row format, "auto" (per row: SkyRL when ``env_class``/``reward_spec`` is present,
        verl when ``reward_model`` is), "skyrl" or "verl" (then every row must be that format).
      split: the split the tasks get ("train" or "test"; "eval"/"validation" mean "test"). With
        ``eval_fraction``, only the rows that hash into this split are returned.
      env: when given, every task's ``env`` (the row's ``env_class`` stays in ``Task.data``);
        else each task's env is its row's ``env_class`` (None when the row has none).
      eval_fraction: hold out this fraction of rows (by a stable hash of ``(seed, id)``) as
        "test"; None = use every row, for files that are already split.
      seed: salt of the held-out hash (another seed, another deterministic partition).

    Returns:
      the tasks in file order.
    """
    if format not in ROW_FORMATS:
        raise ValueError(f"format must be one of {ROW_FORMATS}, got {format!r}")
    if split not in SPLIT_ALIASES:
        raise ValueError(f"split must be 'train' or 'test' (or eval/validation), got {split!r}")
    canon = SPLIT_ALIASES[split]
    if eval_fraction is not None and not 0.0 <= float(eval_fraction) <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    tasks: list[Task] = []
    explicit_ids: dict[str, str] = {}
    seen_hash: dict[str, int] = {}
    for src in sources:
        for index, line, row in read_rows(src, split=canon):
            where = _where(str(src), index, line)
            try:
                task, explicit = _parse_row(row, format, env, canon)
            except _RowError as e:
                raise ValueError(f"{where}: {e}") from None
            except ValueError as e:  # Task's own checks
                raise ValueError(f"{where}: {e}") from None
            if explicit:
                if task.id in explicit_ids or task.id in seen_hash:
                    first = explicit_ids.get(task.id, "an earlier row")
                    raise ValueError(f"{where}: field 'id': duplicate id {task.id!r} (first at {first})")
                explicit_ids[task.id] = where
            else:
                n = seen_hash.get(task.id, 0)
                seen_hash[task.id] = n + 1
                if n:
                    task = _with_id(task, f"{task.id}~{n}")
            tasks.append(task)
    if eval_fraction is not None:
        tasks = [
            t for t in tasks if split_of(f"{seed}\x00{t.id}", test_fraction=float(eval_fraction)) == canon
        ]
    return tasks


def _with_id(task: Task, new_id: str) -> Task:
    return dataclasses.replace(task, id=new_id)


def task_to_row(task: Task, *, format: str = "skyrl") -> dict[str, Any]:  # noqa: A002
    """A SkyRL (or verl) row for ``task``; :func:`load_dataset_tasks` reads it back to an equal task.

    The row carries the task's id, so ids survive the round trip; ``env_class`` is the task's env.
    """
    if format not in ("skyrl", "verl"):
        raise ValueError(f"format must be 'skyrl' or 'verl', got {format!r}")
    if task.messages is None:
        raise ValueError(f"task {task.id!r} has no messages; only prompt-carrying tasks export to rows")
    row: dict[str, Any] = {
        "id": task.id,
        "data_source": task.data_source,
        "prompt": [dict(m) for m in task.messages],
    }
    spec = dict(task.reward_spec) if task.reward_spec is not None else None
    if format == "skyrl":
        row["env_class"] = task.env
        row["reward_spec"] = spec
    else:
        if spec is None:
            raise ValueError(f"task {task.id!r} has no reward_spec; verl rows need reward_model")
        spec["style"] = spec.pop("method")
        row["reward_model"] = spec
    if task.extra_info:  # parquet cannot store an empty struct; a missing one reads back as {}
        row["extra_info"] = dict(task.extra_info)
    if task.demonstration is not None:
        row["demonstration"] = task.demonstration
    return row


def write_rows(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> pathlib.Path:
    """Writes rows as ``.jsonl``, ``.json`` or ``.parquet`` (by the extension).

    Parquet columns are typed: a column missing from some rows reads back as None there, and
    dict (struct) columns read back with the union of their keys (None where a row lacked one).
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(list(rows), ensure_ascii=False, indent=1))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # pyarrow infers the columns from the first row: give every row every column
        keys = list(dict.fromkeys(k for r in rows for k in r))
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    else:
        raise ValueError(f"{path}: write .jsonl, .json or .parquet")
    return path
