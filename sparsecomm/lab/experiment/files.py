"""The lab's files and directories under ``--out``: created and opened without following links.

Run directory names are deterministic (``<out>/<experiment>/runs/<arm>-seed<s>-<hash>``), so
whoever can write to a shared ``--out`` could plant a symbolic link where the lab will write
(``launch.log`` -> another user's file, truncated on the next launch) or a directory of their
own (where they could plant links later). So every directory the lab creates below ``--out``
must be a plain directory owned by this user (:func:`private_directory`), every file it opens
there is opened with ``O_NOFOLLOW`` (:func:`open_no_follow`), and files it replaces are
written to a fresh temporary name (``O_EXCL``) and renamed (a rename replaces a link, never
its target). What is refused raises :class:`RunDirectoryError` naming the path.

Not covered: ``--out`` itself and the directories above it (the user's choice, links
included), and a swap of a checked directory by someone who may rename entries of its parent
(a world-writable ``--out`` without the sticky bit).
"""
import errno
import json
import os
import stat
from pathlib import Path


class RunDirectoryError(ValueError):
    """A path under ``--out`` the lab refuses to use: a link, not a directory, or another user's."""


def _refuse(path: Path, why: str) -> RunDirectoryError:
    return RunDirectoryError(f"{path} {why}: refused. The lab creates its directories under --out itself and never "
                             "follows links there (whoever can write to --out could otherwise redirect this run's "
                             "files); remove it, or choose another --out or --name")


def private_directory(path: Path, below: Path, *, create: bool = True) -> Path:
    """``path`` and each directory between ``below`` (``--out``) and it: created when missing
    (``create``) and checked to be a plain directory (not a link) owned by this user;
    RunDirectoryError naming the first that is not. Without ``create``, missing ones pass."""
    path, below = Path(path), Path(below)
    if create:
        below.mkdir(parents=True, exist_ok=True)
    current = below
    for part in path.relative_to(below).parts:
        current = current / part
        if create:
            try:
                os.mkdir(current)
            except FileExistsError:
                pass
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            if create:
                raise
            return path
        if stat.S_ISLNK(info.st_mode):
            raise _refuse(current, f"is a symbolic link (to {os.readlink(current)})")
        if not stat.S_ISDIR(info.st_mode):
            raise _refuse(current, "is not a directory")
        if info.st_uid != os.geteuid():
            raise _refuse(current, f"belongs to another user (uid {info.st_uid}, not {os.geteuid()})")
    return path


def refuse_links_in(directory: Path) -> None:
    """RunDirectoryError naming a symbolic link directly inside ``directory`` (the lab makes
    none: one there was planted where the lab would write)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_symlink():
                raise _refuse(Path(entry.path), f"is a symbolic link (to {os.readlink(entry.path)})")


def open_no_follow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` (RunDirectoryError naming it)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _refuse(Path(path), "is a symbolic link") from None
        raise


def write_bytes_atomically(path: Path, data: bytes, *, sync: bool = False) -> None:
    """Write to a fresh temporary name (O_EXCL, never through a link) and rename: a reader
    sees the old file or the new one, never half; two writers never mix. ``sync``: fsync
    before the rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    try:
        with os.fdopen(open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomically(path: Path, payload: dict) -> None:
    """``payload`` as JSON, written atomically (:func:`write_bytes_atomically`)."""
    write_bytes_atomically(path, json.dumps(payload, indent=1).encode())
