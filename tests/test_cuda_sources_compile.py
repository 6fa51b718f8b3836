"""Every CUDA source (``csrc/cuda/*.cu``) compiles with nvcc against the running torch's headers.

No GPU and no CUDA build of torch are needed, only ``nvcc`` on PATH: a CPU torch wheel ships
the ATen/c10 CUDA headers. It lacks one generated header, ``c10/cuda/impl/cuda_cmake_macros.h``
(its only content, ``C10_CUDA_BUILD_SHARED_LIBS``, matters for Windows dllexport); when it is
missing, ``-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE`` (c10's own switch) skips the include. The
sources avoid ``ATen/cuda/CUDAContext.h`` on purpose: it includes cuBLAS/cuSPARSE headers,
which a bare nvcc toolkit does not have.

Flags mirror what ``setup.py`` builds with (a CUDAExtension under torch's BuildExtension):
setup.py's own nvcc flags (``-O3 --expt-relaxed-constexpr -lineinfo``, kept in sync by
``test_nvcc_flags_match_setup_py``), BuildExtension's ``COMMON_NVCC_FLAGS``
(``-D__CUDA_NO_HALF_OPERATORS__`` ...), ``-fPIC``, ``-DTORCH_API_INCLUDE_EXTENSION_H``,
``-DTORCH_EXTENSION_NAME=_C``, ``-std=c++20`` (what BuildExtension adds when setup.py names
no standard), setup.py's ``csrc/cpu`` include directory and the running torch's
``_GLIBCXX_USE_CXX11_ABI``; the target is ``sm_90`` (H100/H200).

Besides the exit status, the sm_90 device code is checked: nvcc keeps its intermediate
files (``--keep``, no extra compile), and every ``__global__`` kernel a source defines must
be a function in its ``.sm_90.cubin`` (an ELF file, read here without CUDA's binutils). A
kernel template that no launch instantiates, or one compiled out by a preprocessor guard,
compiles "fine" but ships no device code.

Two ways: every source on its own, in parallel (``-m slow``: about 50 s of CPU per source,
nearly all of it the torch headers; ``scripts/gpu_check.sh``'s CUDA build compiles each on its
own too), and, in the default run, all of them as one translation unit that includes each
source (the headers parsed once: about a third of the time), whose cubin must hold every
source's kernels. Objects go to ``tmp_path``. The default run skips nvcc when everything the
compile depends on (csrc/cuda, csrc/cpu, flags, nvcc's and torch's versions) hashes as it did
in the last one-unit compile that passed, recorded in ``tests/golden/cuda-compiled.json`` by
``SPARSECOMM_UPDATE_CUDA_STAMP=1 pytest tests/test_cuda_sources_compile.py``; any change compiles.
"""
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
NVCC = shutil.which("nvcc")
STD = "c++20"
ARCH = "sm_90"
SETUP_NVCC_FLAGS = ("-O3", "--expt-relaxed-constexpr", "-lineinfo")  # setup.py's extra["nvcc"] without DEBUG=1
KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
EM_CUDA = 190  # ELF e_machine of a cubin
COMPILED_STAMP = ROOT / "tests" / "golden" / "cuda-compiled.json"  # the inputs of the last one-unit compile that passed


def _nvcc_command(source: Path, obj: Path, keep_dir: Path | None = None) -> list[str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(ROOT / "csrc" / "cpu")]
    command = [NVCC, "-c", str(source), "-o", str(obj), f"-std={STD}", f"-arch={ARCH}",
               "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-Xcompiler", "-fPIC"]
    for flag in [*cpp_extension.COMMON_NVCC_FLAGS, *SETUP_NVCC_FLAGS]:
        if flag not in command:
            command.append(flag)
    if not any(Path(path, "c10", "cuda", "impl", "cuda_cmake_macros.h").exists() for path in includes):
        command.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")  # CPU wheel: the generated header is missing
    command += [f"-I{path}" for path in includes]
    if keep_dir is not None:
        command += ["--keep", "--keep-dir", str(keep_dir)]
    return command


def kernels_defined(source: Path) -> set[str]:
    """Names of the ``__global__`` functions a source defines (comments stripped)."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source.read_text(), flags=re.S)
    return set(KERNEL.findall(text))


def elf_functions(path: Path) -> tuple[int, list[str]]:
    """(e_machine, names of the defined function symbols) of a little-endian ELF64 file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path} is not a little-endian ELF64 file"
    machine = struct.unpack_from("<H", data, 18)[0]
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strtab = sections[link]
        for i in range(size // entsize):
            name, info, _, shndx, _, sym_size = struct.unpack_from("<IBBHQQ", data, offset + i * entsize)
            if info & 0xF == 2 and shndx != 0 and sym_size > 0:  # STT_FUNC, defined, with code
                start = strtab[4] + name
                names.append(data[start:data.index(b"\0", start)].decode())
    return machine, names


def missing_kernels(kernels: set[str], functions: list[str]) -> list[str]:
    """Kernels with no function in the cubin; a mangled name holds ``<len><name>``."""
    return sorted(k for k in kernels if not any(f"{len(k)}{k}" in f for f in functions))


def _inspect(source: Path, keep: Path, result: subprocess.CompletedProcess, seconds: float, out_dir: Path,
             kernels: set[str] | None = None) -> str:
    """Why one compiled source fails the checks, or '' when it passes (``kernels``: those its
    cubin must hold; default: the ones it defines)."""
    name = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
    if result.returncode != 0:
        return (f"{name} (exit {result.returncode}, {seconds:.0f}s):\n{' '.join(result.args)}\n"
                f"{result.stderr[-6000:]}{result.stdout[-2000:]}")
    if not (out_dir / f"{source.stem}.o").stat().st_size > 0:
        return f"{name}: empty object file"
    cubins = sorted(keep.glob(f"*.{ARCH}.cubin"))
    if len(cubins) != 1:
        return f"{name}: expected one {ARCH} cubin among nvcc's kept files, got {cubins}"
    machine, functions = elf_functions(cubins[0])
    kernels = kernels_defined(source) if kernels is None else kernels
    missing = missing_kernels(kernels, functions)
    if machine != EM_CUDA or not kernels or missing:
        return (f"{name}: {ARCH} cubin (e_machine {machine}) lacks kernels {missing} of {sorted(kernels)};"
                f" its functions: {functions}")
    return ""


def compile_and_inspect(sources: list[Path], out_dir: Path) -> list[str]:
    """Compile every source in parallel; one message per source that fails a check."""

    def compile_one(source: Path):
        keep = out_dir / f"{source.stem}-keep"
        keep.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        result = subprocess.run(_nvcc_command(source, out_dir / f"{source.stem}.o", keep), capture_output=True,
                                text=True, cwd=ROOT)
        return source, keep, result, time.monotonic() - started

    workers = max(1, min(len(sources), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(compile_one, sources))
    failures = []
    for source, keep, result, seconds in results:
        try:
            failure = _inspect(source, keep, result, seconds, out_dir)
        finally:
            shutil.rmtree(keep, ignore_errors=True)  # nvcc's kept files: ~30 MB per source
        if failure:
            failures.append(failure)
    return failures


def test_cuda_sources_exist():
    names = {source.name for source in CUDA_SOURCES}
    assert {"ef_topk_pack.cu", "unpack_add.cu", "chunk_encode.cu", "chunk_decode_add.cu"} <= names, names


def test_nvcc_flags_match_setup_py():
    line = next(line for line in (ROOT / "setup.py").read_text().splitlines() if 'extra["nvcc"] =' in line)
    assert set(re.findall(r'"(-[^"]*)"', line)) - {"-O0", "-g"} == set(SETUP_NVCC_FLAGS), line  # -O0 -g: DEBUG=1


def test_kernel_and_symbol_matching():
    assert "unpack_row_kernel" in kernels_defined(ROOT / "csrc" / "cuda" / "unpack_add.cu")
    # A templated kernel in an anonymous namespace: the namespace's name ends in digits (8003)
    # right before the kernel's length prefix (17).
    mangled = ("_ZN15sparsecomm_cuda51_GLOBAL__N__c58f3e24_13_unpack_add_cu_c6f89d73_8003"
               "17unpack_row_kernelIffEEvPKilPKT0_llPT_l")
    assert missing_kernels({"unpack_row_kernel"}, [mangled]) == []
    assert missing_kernels({"row_kernel", "unpack_row"}, [mangled]) == ["row_kernel", "unpack_row"]


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.timeout(900)
def test_cuda_sources_compile(tmp_path):
    failures = compile_and_inspect(CUDA_SOURCES, tmp_path)
    assert not failures, "nvcc failed:\n\n" + "\n\n".join(failures)


def compile_inputs_digest() -> str:
    """SHA-256 of everything the compile check's outcome depends on: every file under csrc/cuda
    and csrc/cpu (the headers the .cu files include), the flags, nvcc's version and torch's."""
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "csrc" / "cuda").rglob("*"), *(ROOT / "csrc" / "cpu").rglob("*")]):
        if path.is_file():
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    nvcc_version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    from torch.utils import cpp_extension

    for part in (STD, ARCH, *SETUP_NVCC_FLAGS, *cpp_extension.COMMON_NVCC_FLAGS, nvcc_version, torch.__version__):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.timeout(900)
def test_cuda_sources_compile_as_one_unit(tmp_path):
    # A compile of these exact inputs that passed is recorded (COMPILED_STAMP, refreshed with
    # SPARSECOMM_UPDATE_CUDA_STAMP=1 after a change under csrc/); while nothing it depends on has
    # changed the result cannot differ, so the ~2 min of nvcc are skipped. Any change compiles.
    digest = compile_inputs_digest()
    if COMPILED_STAMP.exists() and json.loads(COMPILED_STAMP.read_text())["inputs_sha256"] == digest:
        return
    unit = tmp_path / "cuda_sources.cu"
    unit.write_text("".join(f'#include "{source}"\n' for source in CUDA_SOURCES))
    keep = tmp_path / "keep"
    keep.mkdir()
    started = time.monotonic()
    result = subprocess.run(_nvcc_command(unit, tmp_path / f"{unit.stem}.o", keep), capture_output=True, text=True,
                            cwd=ROOT)
    kernels = set().union(*(kernels_defined(source) for source in CUDA_SOURCES))
    failure = _inspect(unit, keep, result, time.monotonic() - started, tmp_path, kernels)
    assert not failure, "nvcc failed:\n\n" + failure
    if os.environ.get("SPARSECOMM_UPDATE_CUDA_STAMP") == "1":
        COMPILED_STAMP.write_text(json.dumps({"inputs_sha256": digest, "kernels": sorted(kernels)}, indent=1) + "\n")
