"""The digits-mlp task (digits-quick, the tests' workhorse) in every rank of every run: it
reads scikit-learn's bundled digits without importing scikit-learn, whose import (scipy's
included) would cost each rank seconds of CPU, and gets exactly what ``load_digits()`` gives."""
import subprocess
import sys

import numpy as np

LOAD_IN_A_FRESH_PROCESS = """
import sys
from sparsecomm.lab.tasks.digits import DigitsMLP
task = DigitsMLP()
assert task.num_train_samples == 1797 - 360, task.num_train_samples
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"sklearn", "scipy"})
assert not loaded, f"loading the digits imported {loaded}"
print("digits ok")
"""


def test_a_rank_loads_the_digits_without_importing_scikit_learn():
    result = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "digits ok" in result.stdout, result.stderr[-3000:]


def test_the_digits_are_what_load_digits_gives():
    from sklearn.datasets import load_digits

    from sparsecomm.lab.tasks.digits import digits_arrays

    pixels, labels = digits_arrays()
    bunch = load_digits()
    assert pixels.dtype == bunch.data.dtype and labels.dtype == bunch.target.dtype
    assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)
