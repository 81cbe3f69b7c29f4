"""The digits task reads scikit-learn's bundled data file without importing scikit-learn
(its import, scipy with it, cost 1.6 s of CPU in every simulate command and launched rank),
and gets exactly what ``load_digits`` gives."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from sklearn.datasets import load_digits

from meshtrain.tasks.digits import digits_arrays


def test_the_digits_are_those_of_load_digits() -> None:
    pixels, labels = digits_arrays()
    expected = load_digits()
    assert pixels.shape == (1797, 64) and labels.shape == (1797,)
    assert np.array_equal(pixels, expected.data) and np.array_equal(labels, expected.target)
    assert labels.dtype == np.int64 and pixels.dtype == expected.data.dtype


def test_loading_the_digits_does_not_import_sklearn() -> None:
    code = ("import sys; from meshtrain.tasks.digits import load_digits_split; load_digits_split(); "
            "print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
