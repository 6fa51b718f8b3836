"""The lab's files and directories under ``--out``: created and opened without following links.

Run directory names are deterministic (``<out>/<experiment>/runs/<arm>-seed<s>-<hash>``), so
whoever can write to a shared ``--out`` could plant a symbolic link where the lab will write
(``launch.log`` -> another user's file, truncated on the next launch) or a directory of their
own (where they could plant links later). So every directory the lab creates below ``--out``
must be a plain directory owned by this user (:func:`private_directory`), every file it opens
there is opened with ``O_NOFOLLOW`` (:func:`open_no_follow`), and files it replaces are
written to a fresh temporary name (``O_EXCL``) and renamed (a rename replaces a link, never
its target). What is refused raises :class:`RunDirectoryError` naming the path.

Whoever may write to a directory may rename its entries (unless it has the sticky bit, as
``/tmp`` has), and so swap a checked directory for one of their own after the check. So
``--out`` and every directory the lab checks below it must not be writable by others without
the sticky bit (:func:`_refuse_shared_writable`), and ``--out`` must be this user's or root's
(its owner may rename entries, sticky bit or not); the lab creates its own directories with
mode 0o755 at most, whatever the umask. Not covered: the directories above ``--out`` (the
user's choice, links included).
"""
import errno
import grp
import json
import os
import pwd
import stat
from pathlib import Path

DIRECTORY_MODE = 0o755
"""The mode the lab creates its directories with (less what the umask takes): no one else
may write to them, even where the umask would allow it (0o002)."""


class RunDirectoryError(ValueError):
    """A path under ``--out`` the lab refuses to use: a link, not a directory, or another user's."""


def _refuse(path: Path, why: str) -> RunDirectoryError:
    return RunDirectoryError(f"{path} {why}: refused. The lab creates its directories under --out itself and never "
                             "follows links there (whoever can write to --out could otherwise redirect this run's "
                             "files); remove it, or choose another --out or --name")


def _writable_by_others(info: os.stat_result) -> bool:
    """Whether users other than this one may write to the directory ``info`` describes:
    anyone (o+w), or its group (g+w), unless that group is this user's own private group
    (named after the user, no other member: the umask 0o002 of such systems makes every
    directory g+w)."""
    if info.st_mode & stat.S_IWOTH:
        return True
    if not info.st_mode & stat.S_IWGRP:
        return False
    try:
        group, user = grp.getgrgid(info.st_gid), pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a group or user without a name: its members cannot be told
        return True
    return group.gr_name != user or any(member != user for member in group.gr_mem)


def _refuse_shared_writable(path: Path, info: os.stat_result, role: str) -> None:
    """RunDirectoryError when others may write to ``path`` (``role``: ``--out`` or a directory
    under it) and it has no sticky bit: they may rename what the lab checked there and put a
    link or a directory of their own in its place."""
    if _writable_by_others(info) and not info.st_mode & stat.S_ISVTX:
        raise RunDirectoryError(
            f"{role} {path} may be written by other users (mode {stat.filemode(info.st_mode)}, "
            f"{oct(stat.S_IMODE(info.st_mode))}) and has no sticky bit: refused (whoever may write to it may "
            "swap the lab's directories in it for their own after the lab checked them); "
            f"chmod +t {path} (or chmod go-w {path}), or choose another --out")


def private_directory(path: Path, below: Path, *, create: bool = True) -> Path:
    """``path`` and each directory between ``below`` (``--out``) and it: created when missing
    (``create``) and checked to be a plain directory (not a link) owned by this user;
    RunDirectoryError naming the first that is not. ``below`` (this user's or root's) and each
    of them must not be writable by others without the sticky bit
    (:func:`_refuse_shared_writable`). Without ``create``, missing ones pass."""
    path, below = Path(path), Path(below)
    if create:
        below.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    try:
        out = os.stat(below)  # --out itself may be a link: the user's choice
    except FileNotFoundError:
        if create:
            raise
        return path
    if out.st_uid not in (os.geteuid(), 0):  # an owner may rename entries, sticky bit or not
        raise RunDirectoryError(f"--out {below} belongs to another user (uid {out.st_uid}), who may swap the lab's "
                                "directories in it for their own after the lab checked them: refused; choose an --out "
                                "of your own")
    _refuse_shared_writable(below, out, "--out")
    current = below
    for part in path.relative_to(below).parts:
        current = current / part
        if create:
            try:
                os.mkdir(current, DIRECTORY_MODE)
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
        _refuse_shared_writable(current, info, "a directory under --out:")
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
