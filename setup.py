"""Install sparsecomm.

Install torch first (``pip install torch==2.13.0`` on a CPU machine): a bare ``torch``
requirement resolved from scratch pulls a multi-GB CUDA build.
"""
from setuptools import find_packages, setup

setup(
    name="sparsecomm",
    version="0.1.0",
    description="Top-k + error-feedback gradient sparsification for PyTorch DDP, with honest accounting",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["sparsecomm", "sparsecomm.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Tested on 2.13; torch.testing internals used by the tests are private, so pin a range.
        "torch>=2.4,<=2.14.1",
        "numpy",
        "scikit-learn",
        "scipy",
        "matplotlib",
    ],
    extras_require={"test": ["pytest", "pytest-timeout"]},
    entry_points={"console_scripts": ["sparsecomm=sparsecomm.cli:main"]},
)
