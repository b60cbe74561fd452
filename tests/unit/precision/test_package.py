"""miles.precision stands alone: GPU machines run it without Hydra / Ray / MLflow, and it never imports models."""

import subprocess
import sys


def test_imports_only_torch():
    code = ("import sys, miles.precision; "
            "bad = [m for m in ('miles.models', 'hydra', 'omegaconf', 'ray', 'mlflow') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
