"""Whether scripts/setup_env.sh must install sparsecomm into .venv again, or may skip it.

The editable install compiles the native kernels (minutes) and depends only on the inputs
listed here. After a successful install setup_env.sh records them in a stamp inside .venv;
the next set-up skips the install while they are unchanged and the installed package still
imports (with its native kernels, if they loaded after that install). Python files under
sparsecomm/ are no inputs: the editable install reads them in place.

    python scripts/setup_stamp.py check STAMP          exit 0: up to date; 1: prints why to install
    python scripts/setup_stamp.py digest               one line: the digest of the inputs now
    python scripts/setup_stamp.py write STAMP DIGEST   after an install: record the inputs, unless
                                                       they no longer have DIGEST (then record nothing)

Run it with the environment's interpreter (.venv/bin/python): the Python and torch versions
recorded are that interpreter's. Standard library only.
"""
import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The files the install is made from: the build script, packaging metadata if any, and the
# script that runs pip (its commands and the default torch pin). Every file under csrc/ too.
INSTALL_FILES = ("setup.py", "pyproject.toml", "setup.cfg", "scripts/setup_env.sh")
SOURCES = "csrc"
# Environment variables that change what the install builds: setup.py's switches
# (csrc/README.md, "Building"), what torch.utils.cpp_extension reads to pick compilers and
# CUDA targets, and setup_env.sh's torch pin. tests/test_setup_env.py checks that every
# variable setup.py reads is here.
ENV_SWITCHES = ("SPARSECOMM_BUILD_EXT", "USE_CUDA", "DEBUG", "CC", "CXX", "CUDA_HOME",
                "TORCH_CUDA_ARCH_LIST", "SPARSECOMM_TORCH")
NAMES_SHOWN = 3  # changed inputs named in the reason; the rest are counted


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def current_inputs(root: Path, environ, torch_version: str | None, python_version: str) -> dict:
    """Every input of the install, by name: a file's sha256 (None when absent), a variable's
    value (None when unset), the torch and Python versions, where nvcc is (setup.py adds the
    CUDA sources when it is found)."""
    inputs = {name: _file_digest(root / name) if (root / name).is_file() else None for name in INSTALL_FILES}
    for path in sorted((root / SOURCES).rglob("*")):
        try:
            inputs[path.relative_to(root).as_posix()] = _file_digest(path)
        except (FileNotFoundError, IsADirectoryError):
            continue  # a folder, or a file removed since the listing (an editor's temporary file)
    inputs.update({f"${name}": environ.get(name) for name in ENV_SWITCHES})
    inputs.update({"torch": torch_version, "python": python_version, "nvcc": shutil.which("nvcc", path=environ.get("PATH"))})
    return inputs


def digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def read_stamp(stamp: Path) -> dict | None:
    """The stamp's content, or None if it is missing or not one this script wrote."""
    try:
        content = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(content, dict) and isinstance(content.get("inputs"), dict)
            and isinstance(content.get("native"), bool)):
        return None
    return content


def write_stamp(stamp: Path, inputs: dict, native: bool) -> None:
    """Record ``inputs`` and whether the native kernels loaded after the install (atomically)."""
    partial = stamp.with_name(stamp.name + ".partial")
    partial.write_text(json.dumps({"inputs": inputs, "native": native}, indent=1, sort_keys=True) + "\n")
    partial.replace(stamp)


def reason_to_install(stamp: Path, inputs: dict) -> str | None:
    """Why the install must run again (missing or unreadable stamp, changed inputs), or None."""
    recorded = read_stamp(stamp)
    if recorded is None:
        state = "unreadable" if stamp.exists() else "missing"
        return f"no install recorded ({stamp} {state})"
    old = recorded["inputs"]
    changed = sorted(name for name in old.keys() | inputs.keys() if old.get(name) != inputs.get(name))
    if not changed:
        return None
    shown = ", ".join(changed[:NAMES_SHOWN]) + (f" and {len(changed) - NAMES_SHOWN} more" if len(changed) > NAMES_SHOWN else "")
    return f"changed since the last install: {shown}"


def load_native() -> tuple[bool, str]:
    """Import the installed package and its native kernels: (loaded, why not)."""
    from sparsecomm.ops import native

    return native.load()


def installed_problem(native_expected: bool) -> str | None:
    """What is wrong with the installed package (it does not import, or the native kernels that
    loaded after the install no longer do), or None."""
    try:
        loaded, why = load_native()
    except Exception as error:  # an import error, or codec tables that no longer match (native.load)
        return f"the installed sparsecomm no longer imports ({type(error).__name__}: {error})"
    if native_expected and not loaded:
        return f"the native kernels no longer load ({why})"
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("check", "digest", "write"))
    parser.add_argument("stamp", type=Path, nargs="?", help="the stamp file (check, write)")
    parser.add_argument("expected_digest", nargs="?", help="write: the digest printed before the install")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this script's)")
    args = parser.parse_args(argv)
    if args.command != "digest" and args.stamp is None:
        parser.error(f"{args.command} needs the stamp file's path")
    if args.command == "write" and args.expected_digest is None:
        parser.error("write needs the digest that `digest` printed before the install")
    inputs = current_inputs(args.root, os.environ, _torch_version(), platform.python_version())

    if args.command == "digest":
        print(digest(inputs))
        return 0
    if args.command == "check":
        reason = reason_to_install(args.stamp, inputs) or installed_problem(read_stamp(args.stamp)["native"])
        if reason:
            print(reason)
            return 1
        return 0
    # write
    if digest(inputs) != args.expected_digest:
        # A file under csrc/ (or another input) changed while pip built: the extension may hold
        # the old one, so record nothing and let the next set-up build again.
        print("setup: an input of the build changed while it ran; the next set-up installs again")
        return 0
    loaded, why = load_native()
    print("setup: native kernels", "built" if loaded else f"NOT available: {why}")
    write_stamp(args.stamp, inputs, loaded)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
