"""``torch.cuda.graph`` captures each public op as its first call, in a fresh process (``-m gpu``).

Plans are prepared (uploaded with their dtypes) and outputs preallocated, then the op's
first launch in the process happens inside the capture: a module load, a metadata upload,
an allocation or a host synchronisation inside the call would break it. The cases live in
``tests/capture_cases.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from capture_cases import CASES

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.torch
@pytest.mark.parametrize("case", CASES)
def test_first_call_captures_in_a_fresh_process(case):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join(HERE, "capture_cases.py"), case], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0 and f"OK {case}" in r.stdout, (r.stdout + r.stderr)[-3000:]
