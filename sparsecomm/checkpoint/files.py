"""Durable, atomic files and directories: write, fsync, rename, fsync the parent.

A checkpoint directory becomes visible under its final name only after every file in it
is on disk; a crash at any point leaves either the previous checkpoint or a temporary
directory that readers ignore.
"""
import errno
import hashlib
import json
import os
from pathlib import Path

CHUNK = 1 << 20


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync the file. A symbolic link at ``path`` is refused
    (OSError naming it), never written through: someone else's file may be at its end."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link: checkpoint files are never written through "
                                       "one; remove it") from None
        raise
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_durably(path: Path, payload: dict) -> None:
    """Write JSON to a temporary name, fsync, rename into place, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    write_durably(tmp, json.dumps(payload, indent=1, sort_keys=True).encode())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def commit_directory(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a fully written directory into place; refuses to replace an existing one (or a
    symbolic link there, dangling or not)."""
    if os.path.lexists(final_dir):
        raise FileExistsError(f"{final_dir} already exists")
    os.rename(tmp_dir, final_dir)
    fsync_directory(final_dir.parent)
