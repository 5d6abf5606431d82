"""examples/python/afd_numpy.py end to end: 2A2F processes, 3 stages, checked
bit for bit against the single-process numpy run (its exit status)."""
import os
import subprocess
import sys

ROOT = os.environ.get("PYTEST_STEPMESH_ROOT",
                      os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def test_afd_numpy_example_matches_reference():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "afd_numpy.py"),
                        "--steps", "6", "--layers", "3", "--timeout", "200"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "bit-identical" in p.stdout, p.stdout
    assert "tokens/s" in p.stdout and "stage 2:" in p.stdout
