"""Checkpoints of a run (design §5): orbax arrays + JSON host state, an atomic ``latest`` marker.

Layout of a checkpoint directory::

    directory/
      latest                  {"step": N}: written atomically, only after step_N/ is complete
      step_N/                 one orbax composite checkpoint
        params/  opt_state/   arrays (orbax StandardSave: tensorstore/OCDBT, sharding-aware)
        data_state/           JSON: data-iterator position and other host state (exact round trip)
        rng/                  JSON: PRNG keys (typed or raw uint32) / numpy Generator states, exact bits
        config/               JSON: the run's config (dict, dataclass or ml_collections ConfigDict)
        extra/                JSON: anything else (metrics, counters)
        meta/                 JSON: format version, step, name of the manifest
        commit_success.txt    orbax's completion file
        manifest.json         size + sha256 of every other file under step_N (written last)

Commit protocol (what makes a ``kill -9`` at any instant safe):

1. orbax writes every item into ``step_N.orbax-checkpoint-tmp/``, writes ``commit_success.txt`` and
   renames the directory to ``step_N/`` (one atomic ``rename(2)`` on POSIX file systems);
2. the primary process hashes every file under ``step_N/`` and writes ``manifest.json`` (tmp +
   ``fsync`` + rename), which *seals* the step; ``meta`` (written inside orbax's atomic commit)
   records that a manifest belongs to the step, so a step killed before its seal is incomplete;
3. only then the primary process writes ``latest`` as ``.latest.tmp-<pid>`` + ``fsync`` +
   ``os.replace`` + ``fsync(directory)``, so ``latest`` always holds a whole, committed step;
4. keep-last-k: older complete steps are first renamed to ``step_M.deleting-<pid>`` (atomic; the
   name no longer parses as a step) and then removed, so a half-deleted step is never "complete".

Integrity (what makes silent corruption impossible): :func:`restore` (and :func:`verify`) first
re-hash every file the manifest lists and raise :class:`CheckpointCorruptedError` (a ``ValueError``)
naming the step directory, each damaged file and why (``checksum mismatch``, ``missing``,
``truncated``, ``unreadable``), before TensorStore reads a byte. orbax 0.12 stores arrays as zarr v2
chunks (zstd, no checksum) in OCDBT files: a flipped bit in array data restores silently there, and
a truncated file fails with a bare ``Exception`` from TensorStore; orbax offers crc32c only on the
zarr v3 shard *index*, not on chunk data. :func:`latest_intact_step` walks the committed steps from
the newest down and returns the newest that verifies, with the reasons of the ones it skipped.
Checkpoints written before manifests existed (``meta`` promises none) are *legacy*: they restore
with a one-time :class:`UnverifiedCheckpointWarning`, and read errors while restoring them are
raised as :class:`CheckpointCorruptedError` too. SHA-256 runs at ~1.4 GB/s per core here and files
are hashed on a few threads.

:func:`latest_step` trusts the marker when the step it names is complete; without a marker (or
when its step was removed by hand) it falls back to the newest complete ``step_N`` (a directory
whose name parses, with orbax's completion file and our ``meta`` item). Leftover temporary
directories of a killed save are ignored and removed by the next save.

Resume is bit-for-bit: arrays come back with their stored dtype (a target whose dtype differs is a
``ValueError``, never a silent cast), PRNG keys are stored as their raw ``uint32`` words plus the
PRNG implementation name, numpy ``Generator`` states as their exact integer state. Targets that are
plain (uncommitted) default-device arrays get uncommitted arrays back, so a jitted train step is
not recompiled after a resume.

Fault injection (tests of what a crash at the commit leaves behind): the environment variable
``RLJAX_FAULT=<point>:<step>`` (several joined by ``,``) makes :func:`save` of that step SIGKILL its
own process (``os.kill(os.getpid(), SIGKILL)``: no handler, no ``finally``, no flush) at

* ``kill_before_checkpoint_commit``: ``step_N`` is written and sealed, ``latest`` does not name it
  yet. On the primary process this is right before the marker is written, so the step never
  commits; on the other processes of a multi-host run it is the same place in the code, after
  their share was written, and the primary may still move ``latest`` (only it writes the marker);
* ``kill_after_checkpoint_commit``: ``latest`` names ``step_N``. On the primary this is right after
  the marker's rename and directory ``fsync`` (before the older steps are collected and before the
  all-process barrier); on the other processes after that barrier, the first place where they know
  the step committed.

* ``kill_during_checkpoint_write``: orbax committed ``step_N/`` but the manifest does not seal it
  yet (the step is incomplete: never restored, removed by a later save);
* ``enospc_during_checkpoint_write``: not a kill: writing the manifest of ``step_N`` fails with
  ``OSError(ENOSPC)``, as a full disk makes a write fail (see "Save errors" below);
* ``kill_during_weight_sync``: used by the run (:meth:`rljax.run.engines.EngineSet.serve`): the
  sync of weight version ``N`` to the policy engine has started (the weights are prepared), the
  engine has not taken them yet. :func:`fault_point` is the hook.

Only the process whose environment names a point dies, so a multi-host test can kill one chosen
process. An unknown point or a malformed value is a ``ValueError`` at the first save, never
ignored. The run is left exactly as a ``kill -9`` at that instant would leave it.

Save errors: an ``OSError`` while writing a step (a full disk, a quota, an I/O error) is raised as
:class:`CheckpointSaveError` naming the step, the cause and the step ``latest`` still names. The
marker is written last, so it still names an intact older step (or none); the failed step's
directory and orbax's temporary one are removed (best effort: they are incomplete, and space is
what is short). Whether the run stops or goes on is the caller's choice (``trainer.on_save_error``).

Reference: orbax-checkpoint ``Checkpointer`` / ``CompositeCheckpointHandler`` (atomic tmp-dir
rename); the marker follows the write-temp / fsync / rename idiom of durable file updates; the
manifest is a per-file digest list like ``sha256sum`` output (FIPS 180-4 SHA-256).
Only local (POSIX) directories are supported for the marker. The guarantee is against the
process dying (``kill -9``, OOM, preemption); orbax does not ``fsync`` the array files, so after a
power loss the file system's own ordering decides.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = [
    "FAULT_ENV",
    "FAULT_POINTS",
    "FORMAT",
    "MANIFEST",
    "CheckpointCorruptedError",
    "CheckpointSaveError",
    "Restored",
    "UnverifiedCheckpointWarning",
    "checkpoint_steps",
    "fault_point",
    "latest_intact_step",
    "latest_step",
    "read_config",
    "read_extra",
    "resolve_checkpoint",
    "restore",
    "restore_params",
    "save",
    "step_dir",
    "verify",
]

#: Format tag written into every checkpoint (a reader refuses another).
FORMAT = "rljax.checkpoint/1"
LATEST = "latest"
_COMMIT_FILE = "commit_success.txt"
_STEP_RE = re.compile(r"step_(\d+)")
_TMP_MARK = ".orbax-checkpoint-tmp"
_DELETING_MARK = ".deleting-"
_RNG_TAG = "__rljax_rng__"
_JSON_ITEMS = ("data_state", "rng", "config", "extra", "meta")
#: File of a checkpoint listing every file with its size and hash (see :func:`verify`).
MANIFEST = "manifest.json"
_MANIFEST_FORMAT = "rljax.manifest/1"
_HASH = "sha256"
_HASH_THREADS = 8

PathLike = str | os.PathLike

#: The environment variable of the fault-injection points (see the module docstring).
FAULT_ENV = "RLJAX_FAULT"
#: The fault points (see the module docstring): where :func:`save` (and the weight sync) can kill
#: its process, or make a write fail.
FAULT_POINTS = (
    "kill_before_checkpoint_commit",
    "kill_after_checkpoint_commit",
    "kill_during_checkpoint_write",
    "enospc_during_checkpoint_write",
    "kill_during_weight_sync",
)


class Restored(NamedTuple):
    """What :func:`restore` returns (a tuple: ``step, params, opt_state, data_state, rng, config``).

    Attributes:
      step: the restored step ``N``.
      params: parameters, with the target's structure, shardings and (equal) dtypes.
      opt_state: optimizer state, likewise.
      data_state: the JSON ``data_state`` given to :func:`save` (``{}`` if none was).
      rng: the ``rng`` given to :func:`save`, rebuilt exactly (``None`` if none was).
      config: the config as a ``dict``, or an ``ml_collections.ConfigDict`` if one was saved.
    """

    step: int
    params: Any
    opt_state: Any
    data_state: dict[str, Any]
    rng: Any
    config: Any


class CheckpointCorruptedError(ValueError):
    """A checkpoint's files differ from what was saved (or cannot be read).

    The message names the step directory and every damaged file with its reason; the same facts
    are attributes, for callers that fall back to an older step.

    Attributes:
      path: the ``step_N`` directory.
      problems: ``[(file relative to path, reason), ...]``; reasons start with ``checksum
        mismatch``, ``missing``, ``truncated``, ``size changed`` or ``unreadable``.
      reason: the problems as one line (what :func:`latest_intact_step` reports per skipped step).
    """

    def __init__(
        self, message: str, *, path: PathLike | None = None, problems: Iterable[tuple[str, str]] = ()
    ) -> None:
        super().__init__(message)
        self.path = None if path is None else pathlib.Path(path)
        self.problems = list(problems)
        self.reason = "; ".join(f"{name}: {why}" for name, why in self.problems) or message


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint step failed (e.g. the disk is full); ``latest`` was not moved to it.

    Attributes:
      step: the step that failed to save.
      latest: the step ``latest`` still names (``None``: no checkpoint committed yet).
      cause: the ``OSError`` that failed the write (also ``__cause__``).
    """

    def __init__(self, message: str, *, step: int, latest: int | None, cause: BaseException) -> None:
        super().__init__(message)
        self.step = step
        self.latest = latest
        self.cause = cause


class UnverifiedCheckpointWarning(UserWarning):
    """A legacy checkpoint (written before manifests existed) is restored without verification."""


# ------------------------------------------------------------------------------------------------
# Directory bookkeeping
# ------------------------------------------------------------------------------------------------


def step_dir(directory: PathLike, step: int) -> pathlib.Path:
    """The directory of step ``step``: ``directory/step_<step>``.

    >>> step_dir("/runs/a", 12).as_posix()
    '/runs/a/step_12'
    """
    return pathlib.Path(directory) / f"step_{_check_step(step)}"


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or int(step) < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return int(step)


def _is_committed(path: pathlib.Path) -> bool:
    """orbax committed the step: its completion file and our ``meta`` item are there."""
    return (
        path.is_dir()
        and _STEP_RE.fullmatch(path.name) is not None
        and (path / _COMMIT_FILE).is_file()
        and (path / "meta").is_dir()
    )


def _promises_manifest(path: pathlib.Path) -> bool:
    """Whether the step's ``meta`` says a manifest belongs to it (False when unreadable: legacy)."""
    try:
        meta = json.loads((path / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and bool(meta.get("manifest"))


def _is_complete(path: pathlib.Path) -> bool:
    """Committed and sealed (its manifest is written), or a legacy step that promises no manifest."""
    return _is_committed(path) and ((path / MANIFEST).is_file() or not _promises_manifest(path))


def _committed_steps(root: pathlib.Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.fullmatch(p.name)) and _is_committed(p)
    )


def checkpoint_steps(directory: PathLike) -> list[int]:
    """Sorted steps of the COMPLETE ``step_N`` directories under ``directory`` (``[]`` if none).

    Temporary directories of a save in progress (or killed), steps killed before their manifest
    was written and partly deleted steps are skipped. Complete is not intact: see :func:`verify`.

    >>> import tempfile
    >>> checkpoint_steps(tempfile.mkdtemp())
    []
    """
    root = pathlib.Path(directory)
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = _STEP_RE.fullmatch(path.name)
        if match and _is_complete(path):
            steps.append(int(match.group(1)))
    return sorted(steps)


def _read_marker(directory: pathlib.Path) -> int | None:
    try:
        text = (directory / LATEST).read_text()
    except FileNotFoundError:
        return None
    try:
        step = json.loads(text)["step"]
        return _check_step(step)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f'{directory / LATEST} is corrupt ({text[:80]!r}); it must hold {{"step": N}}. Delete it '
            "to fall back to the newest complete step_N directory."
        ) from e


def latest_step(directory: PathLike) -> int | None:
    """The step the ``latest`` marker names, if that step is complete; ``None`` if nothing is.

    Without a marker, or when the marked step is missing, the newest complete step (no newer than
    the marked one) is returned instead. Incomplete directories (a save killed mid-write) are
    never returned.

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> print(latest_step(d))
    None
    >>> _ = save(d, 7, params={"w": jnp.ones(2)}, opt_state={"count": jnp.int32(0)})
    >>> latest_step(d)
    7
    """
    root = pathlib.Path(directory)
    complete = checkpoint_steps(root)
    marked = _read_marker(root)
    if marked is None:
        return complete[-1] if complete else None
    if marked in complete:
        return marked
    older = [s for s in complete if s < marked]
    return older[-1] if older else None


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(target: pathlib.Path, text: str, *, fault: tuple[str, int] | None = None) -> None:
    """Atomically replaces ``target`` with ``text`` (``.<name>.tmp-<pid>`` + fsync + rename + fsync dir).

    A failed write (``fault``: the fault point that fails it after half the text) leaves ``target``
    as it was and removes the temporary file."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    half = len(text) // 2 if fault is not None else 0
    try:
        with open(tmp, "w") as f:
            if fault is not None:
                f.write(text[:half])
                f.flush()
                _fault_point(*fault)
            f.write(text[half:])
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
    _fsync_dir(target.parent)


def _write_marker(directory: pathlib.Path, step: int) -> None:
    """Atomically replaces ``directory/latest`` with ``{"step": step}``."""
    _write_atomic(directory / LATEST, json.dumps({"step": step}) + "\n")


def _remove(path: pathlib.Path) -> None:
    """Removes a step directory without ever leaving a partly deleted ``step_N`` behind."""
    doomed = path.with_name(f"{path.name}{_DELETING_MARK}{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _garbage_collect(directory: pathlib.Path, step: int, keep: int | None) -> None:
    """Deletes complete steps older than the ``keep`` newest (<= ``step``) and stale temporaries.

    Stale: a killed save's orbax temporary, a marker write killed before its rename, and an older
    step that orbax committed but that was killed before its manifest sealed it (never usable).
    """
    for path in directory.iterdir():
        name = path.name
        match = _STEP_RE.fullmatch(name)
        if name.startswith(f".{LATEST}.tmp-"):  # a marker write killed before its rename
            path.unlink(missing_ok=True)
        elif _DELETING_MARK in name:
            shutil.rmtree(path, ignore_errors=True)
        elif _TMP_MARK in name:
            match = _STEP_RE.fullmatch(name.split(_TMP_MARK)[0])
            if match and int(match.group(1)) < step:
                shutil.rmtree(path, ignore_errors=True)
        elif match and int(match.group(1)) < step and _is_committed(path) and not _is_complete(path):
            _remove(path)
    if keep is None:
        return
    older = [s for s in checkpoint_steps(directory) if s < step]
    for old in older[: max(len(older) - (keep - 1), 0)]:
        _remove(directory / f"step_{old}")


def _faults(value: str) -> set[tuple[str, int]]:
    """``{(point, step), ...}`` of an ``RLJAX_FAULT`` value such as ``"kill_after_checkpoint_commit:3"``.

    >>> sorted(_faults("kill_after_checkpoint_commit:3, kill_before_checkpoint_commit:0"))
    [('kill_after_checkpoint_commit', 3), ('kill_before_checkpoint_commit', 0)]
    >>> _faults("")
    set()
    """
    out = set()
    for item in filter(None, (part.strip() for part in value.split(","))):
        point, _, step = item.partition(":")
        if point not in FAULT_POINTS or not step.isdigit():
            raise ValueError(
                f"{FAULT_ENV}={value!r}: expected <point>:<step> items joined by ',', with point one of "
                f"{', '.join(FAULT_POINTS)} and step an int >= 0; got {item!r}"
            )
        out.add((point, int(step)))
    return out


def fault_point(point: str, step: int) -> None:
    """Acts when ``RLJAX_FAULT`` names ``point`` at ``step`` (module docstring): SIGKILLs this
    process (``kill_*`` points), or raises ``OSError(ENOSPC)`` (``enospc_*``); else does nothing."""
    if point not in FAULT_POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(FAULT_POINTS)}")
    if (point, step) not in _faults(os.environ.get(FAULT_ENV, "")):
        return
    if point.startswith("enospc_"):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({FAULT_ENV}={point}:{step})")
    os.kill(os.getpid(), signal.SIGKILL)


_fault_point = fault_point


# ------------------------------------------------------------------------------------------------
# Integrity: the manifest, verification, fallback to an intact step
# ------------------------------------------------------------------------------------------------


def _digest(path: pathlib.Path) -> tuple[int, str]:
    """``(bytes read, SHA-256 hex digest)`` of one file, read in 4 MiB blocks.

    hashlib and unbuffered reads release the GIL on large buffers, so files hash in parallel threads.
    """
    h = hashlib.new(_HASH)
    size = 0
    block = bytearray(1 << 22)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _in_threads(fn: Any, items: list[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` on up to ``_HASH_THREADS`` threads (exceptions are returned)."""

    def safe(x: Any) -> Any:
        try:
            return fn(x)
        except OSError as e:
            return e

    workers = max(1, min(_HASH_THREADS, os.cpu_count() or 1, len(items)))
    if workers == 1:
        return [safe(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(safe, items))


def _saved_files(path: pathlib.Path) -> list[str]:
    """Sorted POSIX paths (relative to ``path``) of every regular file under it but the manifest."""
    out = []
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            full = pathlib.Path(dirpath) / name
            rel = full.relative_to(path).as_posix()
            if rel != MANIFEST and not rel.startswith(f".{MANIFEST}.tmp-") and full.is_file():
                out.append(rel)
    return sorted(out)


def _seal(path: pathlib.Path, step: int) -> None:
    """Writes ``path/manifest.json``: size and SHA-256 of every file orbax committed under ``path``."""
    _fault_point("kill_during_checkpoint_write", step)
    files = _saved_files(path)
    digests = _in_threads(lambda rel: _digest(path / rel), files)
    entries = {}
    for rel, digest in zip(files, digests, strict=True):
        if isinstance(digest, OSError):
            raise digest
        entries[rel] = {"size": digest[0], _HASH: digest[1]}
    manifest = {"format": _MANIFEST_FORMAT, "step": step, "algorithm": _HASH, "files": entries}
    _write_atomic(
        path / MANIFEST,
        json.dumps(manifest, indent=1, sort_keys=True) + "\n",
        fault=("enospc_during_checkpoint_write", step),
    )


def _read_manifest(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    """The ``files`` table of ``path/manifest.json``; ``ValueError`` / ``OSError`` when unusable."""
    manifest = json.loads((path / MANIFEST).read_text())
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT:
        raise ValueError(f"not a {_MANIFEST_FORMAT} manifest")
    if manifest.get("algorithm") != _HASH:
        raise ValueError(f"unknown hash {manifest.get('algorithm')!r}")
    if f"step_{manifest.get('step')}" != path.name:
        raise ValueError(f"it is the manifest of step {manifest.get('step')!r}")
    files = manifest.get("files")
    valid = isinstance(files, dict) and all(
        isinstance(e, dict) and type(e.get("size")) is int and isinstance(e.get(_HASH), str)
        for e in files.values()
    )
    if not valid:
        raise ValueError("malformed file table")
    return files


def _problems(path: pathlib.Path, items: Iterable[str] | None = None) -> list[tuple[str, str]] | None:
    """Damaged files of the step at ``path`` as ``(relative path, reason)`` (``[]``: intact).

    ``None`` for a legacy step (no manifest, and ``meta`` promises none): nothing to check against.
    ``items``: only check the files under these item directories (e.g. ``("extra",)``).
    Sizes are compared first (a truncated file is named without reading it), then every file of
    the right size is re-hashed.
    """
    if not (path / MANIFEST).exists():
        if not _promises_manifest(path):
            return None
        why = "missing: no manifest (the save was killed before sealing the step, or it was deleted)"
        return [(MANIFEST, why)]
    try:
        files = _read_manifest(path)
    except (OSError, ValueError) as e:
        return [(MANIFEST, f"unreadable ({e})")]
    wanted = set(items) if items is not None else None
    problems = []
    to_hash = []
    for rel, entry in sorted(files.items()):
        if wanted is not None and rel.split("/", 1)[0] not in wanted:
            continue
        full = path / rel
        try:
            size = full.stat().st_size
        except FileNotFoundError:
            problems.append((rel, "missing"))
            continue
        except OSError as e:
            problems.append((rel, f"unreadable ({e.strerror or e})"))
            continue
        if not full.is_file():
            problems.append((rel, "unreadable (not a regular file)"))
        elif size < entry["size"]:
            problems.append((rel, f"truncated: {size} of {entry['size']} bytes"))
        elif size > entry["size"]:
            problems.append((rel, f"size changed: {size} bytes, {entry['size']} saved"))
        else:
            to_hash.append(rel)
    digests = _in_threads(lambda rel: _digest(path / rel), to_hash)
    for rel, digest in zip(to_hash, digests, strict=True):
        if isinstance(digest, OSError):
            problems.append((rel, f"unreadable ({digest.strerror or digest})"))
        elif digest[0] != files[rel]["size"]:  # changed while it was read
            problems.append((rel, f"size changed: {digest[0]} bytes, {files[rel]['size']} saved"))
        elif digest[1] != files[rel][_HASH]:
            saved = files[rel][_HASH]
            problems.append((rel, f"checksum mismatch ({_HASH} {digest[1][:16]}..., saved {saved[:16]}...)"))
    return sorted(problems)


def _corrupted(
    path: pathlib.Path, problems: list[tuple[str, str]], what: str = ""
) -> CheckpointCorruptedError:
    shown = "; ".join(f"{rel}: {why}" for rel, why in problems[:8])
    more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
    return CheckpointCorruptedError(
        f"checkpoint {path} is damaged{what}: {shown}{more}. Do not use it; "
        f"rljax.training.checkpoint.latest_intact_step({str(path.parent)!r}) finds the newest intact step.",
        path=path,
        problems=problems,
    )


_WARNED_UNVERIFIED: set[str] = set()


def _verify_path(path: pathlib.Path, items: Iterable[str] | None = None) -> bool:
    """True: ``path`` matches its manifest; False: a legacy step (warned once per path); raises
    :class:`CheckpointCorruptedError` otherwise."""
    problems = _problems(path, items)
    if problems is None:
        if str(path) not in _WARNED_UNVERIFIED:
            _WARNED_UNVERIFIED.add(str(path))
            warnings.warn(
                f"{path} has no {MANIFEST} (it was written before rljax checkpoints carried checksums), "
                "so it cannot be verified and is restored as it is; checkpoints saved from now on carry one",
                UnverifiedCheckpointWarning,
                stacklevel=3,
            )
        return False
    if problems:
        raise _corrupted(path, problems)
    return True


def _committed_path(root: pathlib.Path, step: int | None) -> pathlib.Path:
    """``root/step_N`` of ``step`` (default: :func:`latest_step`); FileNotFoundError if not committed."""
    if step is None:
        step = latest_step(root)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint (step_N with a commit file) in {root}")
    path = root / f"step_{_check_step(step)}"
    if not _is_committed(path):
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint; complete steps in {root}: {checkpoint_steps(root)}"
        )
    return path


def verify(directory: PathLike, step: int | None = None) -> bool:
    """Checks step ``step`` (default: :func:`latest_step`) against its manifest.

    Every file the manifest lists must exist with its saved size and SHA-256 digest (the whole
    step is read once). Files added later are ignored: orbax reads only what it wrote.

    Returns:
      ``True`` when every file matches; ``False`` for a legacy checkpoint (saved before manifests
      existed; nothing to check it against; an :class:`UnverifiedCheckpointWarning` is issued once).

    Raises:
      CheckpointCorruptedError: a file is missing, truncated, resized, unreadable or has another
        digest, or the manifest is missing / unreadable while ``meta`` promises one.
      FileNotFoundError: no such committed step.

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> _ = save(d, 3, params={"w": jnp.arange(4.0)}, opt_state={})
    >>> verify(d, 3)
    True
    >>> with open(step_dir(d, 3) / "meta" / "metadata", "a") as f:
    ...     _ = f.write(" ")
    >>> verify(d, 3)
    Traceback (most recent call last):
    ...
    rljax.training.checkpoint.CheckpointCorruptedError: checkpoint .../step_3 is damaged: meta/metadata: ...
    """
    return _verify_path(_committed_path(pathlib.Path(directory).absolute(), step))


def latest_intact_step(directory: PathLike) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest step that verifies, and the newer ones skipped because they are damaged.

    Walks the committed steps from the newest down (only steps up to the one ``latest`` marks, as
    :func:`latest_step` does; all of them without a marker), verifies each (:func:`verify`) and
    returns the first that passes, so a resume can say "step_20 is damaged (...), resuming from
    step_10". A damaged step is never returned. A legacy step (no manifest) cannot be checked and
    is returned as intact (with an :class:`UnverifiedCheckpointWarning`); :func:`restore` still
    raises :class:`CheckpointCorruptedError` if its files cannot be read.

    Returns:
      ``(step or None, [(skipped step, reason), ...])``, skipped steps newest first.

    Raises:
      ValueError: the ``latest`` marker itself is corrupt (see :func:`latest_step`).

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> for s in (10, 20):
    ...     _ = save(d, s, params={"w": jnp.full(3, float(s))}, opt_state={})
    >>> latest_intact_step(d)
    (20, [])
    >>> (step_dir(d, 20) / "meta" / "metadata").unlink()
    >>> latest_intact_step(d)
    (10, [(20, 'meta/metadata: missing')])
    """
    root = pathlib.Path(directory).absolute()
    marked = _read_marker(root) if root.is_dir() else None
    skipped = []
    for step in reversed(_committed_steps(root)):
        if marked is not None and step > marked:
            continue
        try:
            _verify_path(root / f"step_{step}")
        except CheckpointCorruptedError as e:
            skipped.append((step, e.reason))
            continue
        return step, skipped
    return None, skipped


# ------------------------------------------------------------------------------------------------
# JSON encodings of host state
# ------------------------------------------------------------------------------------------------


def _encode_rng(rng: Any, where: str = "rng") -> Any:
    """JSON form of a PRNG key / numpy Generator, or of a dict / list / tuple of them."""
    if rng is None:
        return None
    if isinstance(rng, np.random.Generator):
        return {_RNG_TAG: "numpy_generator", "state": _encode_numpy_state(rng.bit_generator.state)}
    if isinstance(rng, jax.Array | np.ndarray):
        if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            data = np.asarray(_host_value(jax.random.key_data(rng)))
            return {
                _RNG_TAG: "jax_key",
                "impl": str(jax.random.key_impl(rng)),
                "shape": list(data.shape),
                "data": data.reshape(-1).tolist(),
            }
        if rng.dtype == np.uint32:
            data = np.asarray(_host_value(rng))
            return {
                _RNG_TAG: "jax_raw_key" if isinstance(rng, jax.Array) else "numpy_uint32",
                "shape": list(data.shape),
                "data": data.reshape(-1).tolist(),
            }
        raise ValueError(
            f"{where}: a raw PRNG key must be a uint32 array, got dtype {rng.dtype}; pass a typed key "
            "(jax.random.key) or the uint32 array of jax.random.PRNGKey"
        )
    if isinstance(rng, Mapping):
        if not all(isinstance(k, str) for k in rng):
            raise ValueError(f"{where}: dict keys must be str, got {sorted(map(repr, rng))}")
        return {k: _encode_rng(v, f"{where}[{k!r}]") for k, v in rng.items()}
    if isinstance(rng, list | tuple):
        items = [_encode_rng(v, f"{where}[{i}]") for i, v in enumerate(rng)]
        return {_RNG_TAG: "tuple", "items": items} if isinstance(rng, tuple) else items
    raise ValueError(
        f"{where}: unsupported RNG {type(rng).__name__}; pass a jax PRNG key (typed or raw uint32), a "
        "numpy Generator, or a dict / list / tuple of those"
    )


def _decode_rng(obj: Any) -> Any:
    if obj is None:
        return None
    if isinstance(obj, list):
        return [_decode_rng(v) for v in obj]
    kind = obj.get(_RNG_TAG)
    if kind is None:
        return {k: _decode_rng(v) for k, v in obj.items()}
    if kind == "tuple":
        return tuple(_decode_rng(v) for v in obj["items"])
    if kind == "numpy_generator":
        state = _decode_numpy_state(obj["state"])
        generator = np.random.Generator(getattr(np.random, state["bit_generator"])())
        generator.bit_generator.state = state
        return generator
    data = np.asarray(obj["data"], dtype=np.uint32).reshape(obj["shape"])
    if kind == "jax_key":
        return jax.random.wrap_key_data(data, impl=obj["impl"])
    if kind == "jax_raw_key":
        return jax.numpy.asarray(data)
    if kind == "numpy_uint32":
        return data
    raise ValueError(f"unknown RNG encoding {kind!r} in checkpoint (written by a newer rljax?)")


def _encode_numpy_state(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _encode_numpy_state(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.dtype.str, "shape": list(value.shape), "data": value.ravel().tolist()}
    if isinstance(value, np.integer):
        return int(value)
    return value


def _decode_numpy_state(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return np.asarray(value["data"], dtype=np.dtype(value["__ndarray__"])).reshape(value["shape"])
        return {k: _decode_numpy_state(v) for k, v in value.items()}
    return value


def _host_value(x: Any) -> Any:
    """Host copy of a (possibly multi-process, fully replicated) array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise ValueError("RNG keys must be fully replicated across processes to be checkpointed")
        return x.addressable_data(0)
    return x


def _json_checked(value: Any, name: str) -> Any:
    """``value`` if JSON holds it exactly (str-keyed dicts, lists, str, int, float, bool, None)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{name}: dict keys must be str (JSON would turn {key!r} into a string)")
            _json_checked(item, f"{name}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _json_checked(item, f"{name}[{i}]")
    elif not (value is None or type(value) in (str, int, float, bool)):
        hint = "use a list" if isinstance(value, tuple) else "convert with int(), float() or .tolist()"
        raise ValueError(
            f"{name} is a {type(value).__name__}, which JSON cannot hold exactly; {hint} "
            "(allowed: dicts with str keys, lists, str, int, float, bool, None)"
        )
    return value


def _encode_config(config: Any) -> dict[str, Any]:
    """``{"kind": ..., "value": ...}``: configs are recorded best-effort (unknown leaves as repr)."""
    if config is None:
        return {"kind": "none", "value": None}
    kind = "dict"
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    elif hasattr(config, "to_dict") and type(config).__module__.startswith("ml_collections"):
        kind, config = "ConfigDict", config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(
            f"config must be a dict, a dataclass or an ml_collections ConfigDict, got {type(config).__name__}"
        )
    return {"kind": kind, "value": json.loads(json.dumps(config, default=_config_leaf, sort_keys=True))}


def _config_leaf(value: Any) -> Any:
    """JSON stand-in for a config value json cannot encode: nested configs as dicts, else ``repr``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "to_dict") and type(value).__module__.startswith("ml_collections"):
        return value.to_dict()
    return repr(value)


def _decode_config(obj: dict[str, Any]) -> Any:
    if obj["kind"] == "ConfigDict":
        import ml_collections

        return ml_collections.ConfigDict(obj["value"])
    return obj["value"]


# ------------------------------------------------------------------------------------------------
# Save / restore
# ------------------------------------------------------------------------------------------------


class _UncompressedArrays(ocp.StandardCheckpointHandler):
    """orbax's handler of array trees, writing the arrays without zstd compression.

    Float weights and optimizer moments barely compress (a few percent), but compressing them holds
    a second, compressed copy of every array in memory while it is written: +1.4 GiB of peak RSS
    and three times the time for a 1.5 GiB state (measured on the CPU backend). Checkpoints
    written compressed (by earlier versions) restore unchanged: each array's codec is recorded
    with it."""

    def __init__(self) -> None:
        super().__init__()
        impl = getattr(self, "_impl", None)
        if not isinstance(impl, ocp.PyTreeCheckpointHandler):  # an orbax that is laid out otherwise
            raise RuntimeError("orbax's StandardCheckpointHandler no longer wraps a PyTreeCheckpointHandler")
        self._impl = ocp.PyTreeCheckpointHandler(use_compression=False)


def _checkpointer() -> ocp.Checkpointer:
    """A synchronous orbax checkpointer that knows the handler of every item (quiet partial reads)."""
    registry = ocp.DefaultCheckpointHandlerRegistry()
    for name in ("params", "opt_state"):
        handler = _UncompressedArrays()
        registry.add(name, ocp.args.StandardSave, handler)
        registry.add(name, ocp.args.StandardRestore, handler)
    for name in _JSON_ITEMS:
        registry.add(name, ocp.args.JsonSave)
        registry.add(name, ocp.args.JsonRestore)
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(handler_registry=registry))


def save(
    directory: PathLike,
    step: int,
    *,
    params: Any,
    opt_state: Any,
    data_state: Mapping[str, Any] | None = None,
    rng: Any = None,
    config: Any = None,
    extra: Mapping[str, Any] | None = None,
    keep: int | None = None,
    overwrite: bool = False,
) -> pathlib.Path:
    """Saves step ``step`` as ``directory/step_<step>/`` and then marks it ``latest`` atomically.

    Synchronous: when this returns, the step is complete, committed, sealed (``manifest.json``:
    size and SHA-256 of every file, for :func:`verify`) and marked, so the caller may
    donate or overwrite ``params`` / ``opt_state``. Every process of a multi-host run calls it;
    arrays may be sharded; the JSON items and the marker are written by the primary process.

    Args:
      directory: the run's checkpoint directory (created if needed).
      step: the step number ``N`` (an int >= 0).
      params: a pytree of arrays (e.g. an ``nnx.State``).
      opt_state: the optax state (a pytree of arrays; counts included).
      data_state: JSON-able host state needed to resume exactly (iterator position, epoch, ...).
      rng: a jax PRNG key (typed ``jax.random.key`` or raw ``uint32``), a numpy ``Generator``, or a
        dict / list / tuple of those; restored bit-for-bit.
      config: a dict, dataclass or ``ml_collections.ConfigDict`` (recorded as JSON; leaves JSON
        cannot hold are recorded as their ``repr``).
      extra: any other JSON-able state (metrics, counters); read back with :func:`read_extra`.
      keep: keep only the ``keep`` newest complete steps up to ``step`` (``None`` keeps all).
        Steps newer than ``step`` (left by an abandoned run) are never deleted here.
      overwrite: allow replacing ``step_N`` when it is the step ``latest`` points at. Any other
        existing ``step_N`` (e.g. complete but never marked, from a save killed before its marker)
        is replaced without asking.

    Returns:
      the path of the saved step.

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> for s in range(3):
    ...     _ = save(d, s, params={"w": jnp.full(2, s)}, opt_state=(), data_state={"pos": 10 * s},
    ...              keep=2)
    >>> checkpoint_steps(d), latest_step(d)
    ([1, 2], 2)
    """
    step = _check_step(step)
    _faults(os.environ.get(FAULT_ENV, ""))  # a malformed value fails before anything is written
    items = _json_items(step, keep=keep, data_state=data_state, rng=rng, config=config, extra=extra)
    # orbax refuses trees without arrays (e.g. the state of optax.sgd): such items are not written.
    pairs = (("params", params), ("opt_state", opt_state))
    arrays = {name: tree for name, tree in pairs if jax.tree.leaves(tree)}
    root = pathlib.Path(directory).absolute()
    primary = jax.process_index() == 0
    if primary:
        root.mkdir(parents=True, exist_ok=True)
    target = root / f"step_{step}"
    force = target.exists()
    if force and not overwrite and _read_marker(root) == step and _is_complete(target):
        raise ValueError(
            f"{target} already exists and is the latest checkpoint; pass overwrite=True to replace it "
            "or save under a new step"
        )
    _write_and_mark(root, step, arrays, items, force=force, primary=primary)
    if primary:
        _fault_point("kill_after_checkpoint_commit", step)
        _garbage_collect(root, step, keep)
    else:
        _fault_point("kill_before_checkpoint_commit", step)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"rljax_checkpoint_marked_{step}")
    if not primary:
        _fault_point("kill_after_checkpoint_commit", step)
    return target


def _json_items(
    step: int,
    *,
    keep: int | None,
    data_state: Mapping[str, Any] | None,
    rng: Any,
    config: Any,
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Checks :func:`save`'s host-side arguments; returns its JSON items (``data_state``, ``rng``,
    ``config``, ``extra`` and the step's ``meta``)."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None (keep all) or an int >= 1, got {keep!r}")
    if data_state is not None and not isinstance(data_state, Mapping):
        raise ValueError(f"data_state must be a dict (JSON), got {type(data_state).__name__}")
    if extra is not None and not isinstance(extra, Mapping):
        raise ValueError(f"extra must be a dict (JSON), got {type(extra).__name__}")
    return {
        "data_state": _json_checked(dict(data_state or {}), "data_state"),
        "rng": {"value": _encode_rng(rng)},
        "config": _encode_config(config),
        "extra": _json_checked(dict(extra or {}), "extra"),
        "meta": {"format": FORMAT, "step": step, "manifest": MANIFEST},
    }


def _write_and_mark(
    root: pathlib.Path,
    step: int,
    arrays: Mapping[str, Any],
    items: Mapping[str, Any],
    *,
    force: bool,
    primary: bool,
) -> None:
    """orbax writes ``root/step_<step>`` (every process its shards); then the primary process checks
    orbax committed it, seals it (manifest) and marks it ``latest``. A write that fails with an
    ``OSError`` leaves nothing behind (:func:`_save_failed`)."""
    target = root / f"step_{step}"
    try:
        _checkpointer().save(
            target,
            args=ocp.args.Composite(
                **{name: ocp.args.StandardSave(tree) for name, tree in arrays.items()},
                **{name: ocp.args.JsonSave(value) for name, value in items.items()},
            ),
            force=force,
        )
        if primary:
            if not _is_committed(target):  # orbax returned without committing: never mark it
                raise RuntimeError(f"orbax finished saving {target} but its completion file is missing")
            _seal(target, step)  # before the marker: a marked step always has its manifest
            _fault_point("kill_before_checkpoint_commit", step)
            _write_marker(root, step)
    except OSError as e:
        raise _save_failed(root, step, e) from e


def _save_failed(root: pathlib.Path, step: int, error: OSError) -> CheckpointSaveError:
    """The error of a failed save of ``step``, after removing what it left (unless ``latest`` names it)."""
    try:
        marked = _read_marker(root)
    except (OSError, ValueError):
        marked = None
    if marked != step:
        for path in root.glob(f"step_{step}*"):
            name = path.name
            if name == f"step_{step}" or name.startswith(f"step_{step}{_TMP_MARK}"):
                shutil.rmtree(path, ignore_errors=True)
    latest = latest_step(root)
    why = f"{type(error).__name__}: {error}"
    if error.errno == errno.ENOSPC:
        why += " (the disk is full: free space or point the run at a larger file system)"
    kept = f"`latest` still names step_{latest}" if latest is not None else "no checkpoint was committed yet"
    return CheckpointSaveError(
        f"saving checkpoint step_{step} in {root} failed: {why}; {kept}"
        + (f", and the partial step_{step} was removed" if marked != step else ""),
        step=step,
        latest=latest,
        cause=error,
    )


def _abstract(tree: Any) -> Any:
    """Arrays -> ``jax.ShapeDtypeStruct`` (with their sharding); abstract leaves pass through."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, np.ndarray | np.generic):
            return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
        raise ValueError(
            "restore targets must be pytrees of arrays or jax.ShapeDtypeStruct, got a "
            f"{type(x).__name__} leaf"
        )

    return jax.tree.map(leaf, tree)


def _match_commitment(restored: Any, target: Any) -> Any:
    """Uncommitted targets (plain default-device arrays) get uncommitted results.

    orbax returns committed arrays; a jitted step traced with uncommitted inputs would otherwise be
    compiled a second time after a resume.
    """

    def leaf(x: Any, t: Any) -> Any:
        if isinstance(t, jax.Array) and not t.committed and isinstance(x, jax.Array):
            return jax.device_put(np.asarray(x))
        return x

    return jax.tree.map(leaf, restored, target)


def _check_dtypes(target: Any, stored: Any, name: str, path: pathlib.Path) -> None:
    """Raises when a target leaf's dtype differs from the stored one (orbax would cast silently)."""
    stored_by_name = {
        leaf.name: leaf.dtype
        for leaf in jax.tree.leaves(stored)
        if hasattr(leaf, "name") and getattr(leaf, "dtype", None) is not None
    }
    mismatched = []
    for keypath, x in jax.tree_util.tree_flatten_with_path(target)[0]:
        n = ".".join(str(ocp.utils.get_key_name(k)) for k in keypath)  # orbax's name of the leaf
        if n in stored_by_name and np.dtype(stored_by_name[n]) != np.dtype(x.dtype):
            mismatched.append(f"{n}: stored {np.dtype(stored_by_name[n])}, target {np.dtype(x.dtype)}")
    if mismatched:
        more = f" (+{len(mismatched) - 5} more)" if len(mismatched) > 5 else ""
        raise ValueError(
            f"{path}/{name}: target dtypes differ from the checkpoint (a resume must not cast): "
            f"{'; '.join(mismatched[:5])}{more}. Build the target with the dtypes of the saved run."
        )


_TS_DATA_ERRORS = ("DATA_LOSS:", "OUT_OF_RANGE:", "NOT_FOUND:")
_ORBAX_READ_ERROR = "Encountered error while reading"


def _read_failure(error: BaseException) -> str | None:
    """The root cause's message if ``error`` is orbax / TensorStore failing to read files, else None.

    TensorStore reports damaged or missing data as ``ValueError`` s whose text starts with an
    absl status (``DATA_LOSS``, ``OUT_OF_RANGE``, ``NOT_FOUND``), which orbax wraps in a bare
    ``Exception``; JSON items fail with ``json.JSONDecodeError`` or ``OSError``. Target mismatches
    (shapes, structure) are none of these and pass through unchanged.
    """
    chain = []
    e: BaseException | None = error
    while e is not None and len(chain) < 16:
        chain.append(e)
        e = e.__cause__ or e.__context__
    hit = any(
        isinstance(x, OSError | json.JSONDecodeError)
        or str(x).lstrip().startswith(_TS_DATA_ERRORS)
        or (type(x) is Exception and str(x).startswith(_ORBAX_READ_ERROR))
        for x in chain
    )
    if not hit:
        return None
    text = " ".join(str(chain[-1]).split())
    return f"{type(chain[-1]).__name__}: {text[:400]}{'...' if len(text) > 400 else ''}"


@contextlib.contextmanager
def _reading(path: pathlib.Path, verified: bool) -> Iterator[None]:
    """Turns read failures of an unverified step into :class:`CheckpointCorruptedError`.

    A verified step's files are exactly the saved ones, so an error reading it is not damage and is
    re-raised as it is.
    """
    try:
        yield
    except Exception as e:
        failure = None if verified else _read_failure(e)
        if failure is None:
            raise
        what = " (it has no manifest, so the damaged file cannot be named)"
        if (path / MANIFEST).exists():
            what = " (read without verify; verify() names the damaged files)"
        raise _corrupted(path, [("(file unknown)", f"unreadable: {failure}")], what) from e


def restore(
    directory: PathLike,
    *,
    params: Any = None,
    opt_state: Any = None,
    step: int | None = None,
    verify: bool = True,
) -> Restored:
    """Verifies and restores step ``step`` (default: :func:`latest_step`) of ``directory``.

    Args:
      directory: the run's checkpoint directory.
      params: target pytree for the parameters: arrays or ``jax.ShapeDtypeStruct`` s with
        ``sharding`` (e.g. ``jax.eval_shape`` output with shardings attached). Arrays are restored
        straight into those shardings (sharded restore, no full host copy). ``None`` restores the
        stored tree as plain dicts / lists on the saved shardings. An item saved from a tree
        without arrays (e.g. the state of ``optax.sgd``) comes back as its target (``None``
        without one).
      opt_state: target pytree for the optimizer state, likewise.
      step: which step; must be complete.
      verify: first check every file against the step's manifest (:func:`verify`; reads the whole
        step once). ``False`` only right after :func:`verify` / :func:`latest_intact_step`
        checked this step, to read it once instead of twice.

    Raises:
      FileNotFoundError: no complete checkpoint (or not the requested one) in ``directory``.
      CheckpointCorruptedError: (a ``ValueError``) the step's files differ from its manifest, or,
        for a step not verified (legacy, or ``verify=False``), orbax / TensorStore could not read
        them. Never a raw TensorStore error for damaged files.
      ValueError: the target's structure, shapes or dtypes differ from the checkpoint.

    >>> import tempfile
    >>> import jax, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> key = jax.random.key(0)
    >>> _ = save(d, 5, params={"w": jnp.arange(3.0)}, opt_state={"count": jnp.int32(4)},
    ...          data_state={"pos": 40}, rng=key, config={"lr": 1e-6})
    >>> r = restore(d, params={"w": jnp.zeros(3)}, opt_state={"count": jnp.int32(0)})
    >>> r.step, r.params["w"].tolist(), int(r.opt_state["count"]), r.data_state, r.config
    (5, [0.0, 1.0, 2.0], 4, {'pos': 40}, {'lr': 1e-06})
    >>> bool(jax.random.key_data(r.rng).tolist() == jax.random.key_data(key).tolist())
    True
    """
    root = pathlib.Path(directory).absolute()
    path = _committed_path(root, step)
    step = int(path.name.removeprefix("step_"))
    verified = _verify_path(path) if verify else False
    targets = {"params": params, "opt_state": opt_state}
    args = {}
    empty = {}
    for name, target in targets.items():
        arg = _array_restore_arg(path, name, target, verified)
        if arg is None:
            empty[name] = target
        else:
            args[name] = arg
    args.update({name: ocp.args.JsonRestore() for name in _JSON_ITEMS})
    with _reading(path, verified):
        out = {**empty, **_checkpointer().restore(path, args=ocp.args.Composite(**args))}
    _check_meta(path, out["meta"], step)
    return Restored(
        step=step,
        params=out["params"] if params is None else _match_commitment(out["params"], params),
        opt_state=out["opt_state"] if opt_state is None else _match_commitment(out["opt_state"], opt_state),
        data_state=out["data_state"],
        rng=_decode_rng(out["rng"]["value"]),
        config=_decode_config(out["config"]),
    )


def restore_params(
    directory: PathLike, *, params: Any = None, step: int | None = None, verify: bool = True
) -> Any:
    """The parameters of step ``step`` (default: :func:`latest_step`) of ``directory``, and nothing else.

    What serving a checkpoint needs (``rljax eval``, ``rljax export``): only the ``params`` files
    and the step's metadata are verified (``verify``) and read, not the optimizer state (twice the
    parameters' bytes with Adam). ``params`` is the target as in :func:`restore` (``None``: the
    stored tree as host arrays); the exceptions are :func:`restore`'s, for these files.

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> _ = save(d, 2, params={"w": jnp.arange(3.0)}, opt_state={"mu": jnp.ones(3)})
    >>> restore_params(d, params={"w": jnp.zeros(3)})["w"].tolist()
    [0.0, 1.0, 2.0]
    """
    root = pathlib.Path(directory).absolute()
    path = _committed_path(root, step)
    step = int(path.name.removeprefix("step_"))
    verified = _verify_path(path, items=("params", "meta")) if verify else False
    arg = _array_restore_arg(path, "params", params, verified)
    if arg is None:
        return params
    with _reading(path, verified):
        out = _checkpointer().restore(path, args=ocp.args.Composite(params=arg, meta=ocp.args.JsonRestore()))
    _check_meta(path, out["meta"], step)
    return out["params"] if params is None else _match_commitment(out["params"], params)


def _array_restore_arg(path: pathlib.Path, name: str, target: Any, verified: bool) -> Any:
    """orbax's restore argument for array item ``name`` of the step at ``path`` into ``target``
    (``None``: as stored), after checking the target's dtypes against the stored ones; ``None``
    when the step holds no such item (it was saved from a tree without arrays, so the target must
    have none either)."""
    if not (path / name).is_dir():
        if target is not None and jax.tree.leaves(target):
            raise ValueError(
                f"{path} holds no {name} arrays (it was saved from an empty tree), but the {name} "
                f"target has {len(jax.tree.leaves(target))} leaves"
            )
        return None
    if target is None:
        return ocp.args.StandardRestore()
    abstract = _abstract(target)
    with _reading(path, verified):  # this item's metadata only
        stored = ocp.StandardCheckpointHandler().metadata(path / name)
    _check_dtypes(abstract, stored.tree if hasattr(stored, "tree") else stored, name, path)
    return ocp.args.StandardRestore(abstract)


def _check_meta(path: pathlib.Path, meta: dict[str, Any], step: int) -> None:
    if meta.get("format") != FORMAT or meta.get("step") != step:
        raise ValueError(
            f"{path}: unexpected checkpoint metadata {meta}; expected format {FORMAT!r}, step {step}"
        )


def read_extra(directory: PathLike, *, step: int | None = None) -> dict[str, Any]:
    """The ``extra`` JSON saved with step ``step`` (default: :func:`latest_step`).

    Only the ``extra`` files are verified (a :class:`CheckpointCorruptedError` if they are damaged).

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> _ = save(d, 1, params={"w": jnp.ones(1)}, opt_state=(), extra={"reward/mean": 0.25})
    >>> read_extra(d)
    {'reward/mean': 0.25}
    """
    return _read_json_item(directory, step, "extra")


def read_config(directory: PathLike, *, step: int | None = None) -> Any:
    """The config saved with step ``step`` (default: :func:`latest_step`), as :func:`restore` returns
    it; only the ``config`` files are read and verified.

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> _ = save(d, 1, params={"w": jnp.ones(1)}, opt_state=(), config={"seed": 3})
    >>> read_config(d)
    {'seed': 3}
    """
    return _decode_config(_read_json_item(directory, step, "config"))


def _read_json_item(directory: PathLike, step: int | None, item: str) -> Any:
    root = pathlib.Path(directory).absolute()
    step = latest_step(root) if step is None else _check_step(step)
    if step is None or not _is_committed(root / f"step_{step}"):
        raise FileNotFoundError(f"no complete checkpoint {'' if step is None else f'step_{step} '}in {root}")
    path = root / f"step_{step}"
    verified = _verify_path(path, items=(item,))
    with _reading(path, verified):
        out = _checkpointer().restore(path, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
    return out[item]


def resolve_checkpoint(path: str | os.PathLike, step: int | None = None) -> tuple[pathlib.Path, int]:
    """``(checkpoint directory, step)`` of a workdir, a checkpoint directory or a ``step_N`` directory.

    Raises ``FileNotFoundError`` when there is no complete checkpoint there (or not the asked step).
    """
    p = pathlib.Path(path).absolute()
    match = _STEP_RE.fullmatch(p.name)
    if match:
        if step is not None and step != int(match.group(1)):
            raise ValueError(f"--step={step} contradicts --checkpoint={p}")
        root, step = p.parent, int(match.group(1))
    else:
        root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        if step is None:
            step = latest_step(root)
    if step is None or step not in checkpoint_steps(root):
        what = "complete checkpoint" if step is None else f"complete step_{step}"
        raise FileNotFoundError(
            f"{p} holds no {what} (complete steps in {root}: {checkpoint_steps(root)}); pass a run's "
            "workdir, its checkpoints/ directory or a checkpoints/step_N directory"
        )
    return root, step
