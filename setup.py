"""Install sparsecomm, building its native kernels (``sparsecomm._C``) when possible.

Install torch first (``pip install torch==2.13.0`` on a CPU machine): a bare ``torch``
requirement resolved from scratch pulls a multi-GB CUDA build. Build without isolation so
the extension compiles against the installed torch::

    pip install --no-build-isolation -e ".[test]"

Switches (environment): ``SPARSECOMM_BUILD_EXT=0`` skips the extension, ``=1`` makes a
failed build an error (default: warn and install the pure-torch path); ``USE_CUDA=0|1``
never/always adds the CUDA sources (default: when nvcc and a CUDA torch are present);
``DEBUG=1`` builds with ``-O0 -g``.

The CPU kernels are compiled for several instruction-set levels (x86-64 with GCC: the
baseline, AVX2 and AVX-512; elsewhere the baseline only) and choose one at run time, so the
package runs on any CPU of its architecture, whichever machine built it (csrc/README.md,
"CPU levels").
"""
import glob
import os
from pathlib import Path

from setuptools import find_packages, setup

BUILD_EXT = os.environ.get("SPARSECOMM_BUILD_EXT", "")
LAB_REQUIRES = ["scipy", "matplotlib", "scikit-learn", "submitit>=1.5"]
TORCHTITAN_REQUIRES = ["torchtitan==0.3.0"]
METRICS_REQUIRES = ["tensorboard", "wandb"]


def _say(message: str) -> None:
    print(f"sparsecomm setup: {message}", flush=True)


# Every CPU kernel file (csrc/cpu/<op>.cpp) is compiled once per level, each time as a
# translation unit of its own that names the level and the file and includes
# csrc/cpu/isa/compile_level.h. The levels are csrc/cpu/cpu_levels.h's, lowest first.
CPU_LEVELS = ("default", "avx2", "avx512")
CPU_LEVEL_UNITS = "cpu_levels"  # the folder of those units, inside the build's temporary folder


def cpu_kernel_files() -> list[str]:
    """The CPU kernel files: every csrc/cpu/*.cpp (the operators, csrc/cpu/dispatch/, are not)."""
    return sorted(glob.glob("csrc/cpu/*.cpp"))


def write_cpu_level_units(folder: str) -> list[str]:
    """One translation unit per CPU kernel file and level, written into ``folder`` (a file is
    rewritten only when its text changes, so an incremental build recompiles nothing):
    their paths, to compile in place of the kernel files."""
    units = []
    Path(folder).mkdir(parents=True, exist_ok=True)
    for kernel in cpu_kernel_files():
        op = Path(kernel).stem
        for level in CPU_LEVELS:
            unit = Path(folder, f"{op}_{level}.cpp")
            text = (f"// {op} compiled for the CPU level {level}: written by setup.py (csrc/cpu/isa/compile_level.h).\n"
                    f"#define SPARSECOMM_CPU_LEVEL SPARSECOMM_CPU_{level.upper()}\n"
                    f'#define SPARSECOMM_CPU_KERNEL "../{op}.cpp"\n'
                    f'#include "compile_level.h"\n')
            if not unit.exists() or unit.read_text() != text:
                unit.write_text(text)
            units.append(str(unit))
    return units


def _native_extension() -> dict:
    """setup() arguments that build sparsecomm._C, or {} when it is skipped/impossible."""
    if BUILD_EXT == "0":
        _say("SPARSECOMM_BUILD_EXT=0: not building native kernels (pure-torch reference only)")
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as error:
        if BUILD_EXT == "1":
            raise
        _say(f"WARNING: cannot build native kernels ({error}); install torch first and build with "
             "--no-build-isolation. Installing the pure-torch reference path only.")
        return {}

    debug = os.environ.get("DEBUG", "0") == "1"
    use_cuda = os.environ.get("USE_CUDA")
    with_cuda = use_cuda == "1" or (use_cuda is None and torch.version.cuda is not None and CUDA_HOME is not None)
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    # No -march: each CPU kernel is compiled once per level (write_cpu_level_units) and the
    # running CPU picks one. No FMA contraction either: it would round differently at the
    # levels that have FMA, and the kernels are bit-exact at every level.
    cxx += ["-fopenmp", "-ffp-contract=off"]
    # The CPU kernel files are compiled through their per-level units only, which the build
    # writes (BuildOrFallBack.build_extensions) and adds to these sources.
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/dispatch/*.cpp"))
    extra = {"cxx": cxx}
    extension_class = CppExtension
    if with_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        extra["nvcc"] = (["-O0", "-g"] if debug else ["-O3"]) + ["--expt-relaxed-constexpr", "-lineinfo"]
        extension_class = CUDAExtension
    _say(f"building sparsecomm._C ({'CPU + CUDA' if with_cuda else 'CPU'}: {len(sources)} sources and "
         f"{len(cpu_kernel_files())} CPU kernels x {len(CPU_LEVELS)} levels)")

    class BuildOrFallBack(BuildExtension):
        """Build the extension; if that fails, say why and install without it (unless forced)."""

        def build_extensions(self):
            units = write_cpu_level_units(os.path.join(self.build_temp, CPU_LEVEL_UNITS))
            for extension in self.extensions:
                extension.sources = [*extension.sources, *units]
            super().build_extensions()

        def run(self):
            try:
                super().run()
            except Exception as error:  # compiler missing, compile error, ...
                if BUILD_EXT == "1":
                    raise
                _say(f"WARNING: native kernels failed to build ({type(error).__name__}: {error}). "
                     "Installing the pure-torch reference path; sparsecomm warns once at run time. "
                     "Set SPARSECOMM_BUILD_EXT=1 to make this an error.")

    module = extension_class(
        "sparsecomm._C", sources, extra_compile_args=extra, extra_link_args=["-fopenmp"],
        include_dirs=[os.path.abspath("csrc/cpu"), os.path.abspath("csrc/cpu/isa")],  # isa/: compile_level.h
    )
    return {"ext_modules": [module], "cmdclass": {"build_ext": BuildOrFallBack}}


setup(
    name="sparsecomm",
    version="0.1.0",
    description="Top-k + error-feedback gradient sparsification for PyTorch DDP, with honest accounting",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["sparsecomm", "sparsecomm.*"]),
    python_requires=">=3.10",
    # The library (the hook: hooks, ops, comm, compress, checkpoint, monitor, integrations)
    # needs torch and numpy alone; the lab (sparsecomm.lab: runner, ledger, verdicts, plots,
    # frontier, cost model, built-in tasks and the `sparsecomm` command) is the [lab] extra.
    install_requires=[
        # 2.11 is the oldest torch whose APIs the package was checked against (csrc/README.md,
        # "Supported torch"); torch.testing internals used by the tests are private, so pin a range.
        "torch>=2.11,<=2.14.1",
        "numpy",
    ],
    extras_require={
        "lab": LAB_REQUIRES,
        # Triton runs its kernels on GPUs, and on CPU in interpreter mode (tests).
        # The framework integrations (sparsecomm.integrations) are tested too, so CI installs
        # both. Neither caps torch, so pip keeps the torch installed first.
        "test": [*LAB_REQUIRES, "transformers>=4.40", "pytest", "pytest-timeout", "pytest-xdist", "triton; platform_system == 'Linux'", "lightning>=2.0", "accelerate>=1.0",
                 "mpi4py", "mpich", *TORCHTITAN_REQUIRES, *METRICS_REQUIRES],
        "triton": ["triton; platform_system == 'Linux'"],
        # transport="mpi" and mpiexec launches: mpi4py's wheel runs on the mpich wheel's MPI.
        "mpi": ["mpi4py", "mpich"],
        # lightning.pytorch (the unified package) appeared in 2.0.
        "lightning": ["lightning>=2.0"],
        # Accelerator.register_save_state_pre_hook/register_load_state_pre_hook keep per-rank hook state.
        "accelerate": ["accelerate>=1.0"],
        # SparseCommTrainerCallback (sparsecomm.integrations.transformers).
        "transformers": ["transformers>=4.40"],
        # sparsecomm.integrations.torchtitan: written against torchtitan 0.3.0's Trainer, config
        # registry and parallelize functions (its APIs change between releases).
        "torchtitan": TORCHTITAN_REQUIRES,
        # sparsecomm.metrics: the hook's and the averager's figures in TensorBoard and W&B.
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["sparsecomm=sparsecomm.lab.cli:main"]},
    **_native_extension(),
)
