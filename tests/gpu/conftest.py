"""tests/gpu: every command on one CUDA GPU (local backend, hf engine), skipped without one.

Run on a GPU machine with ``python -m pytest -q -p no:cacheprovider tests/gpu`` (about 5
minutes on one H200 is the budget). Each module marks its tests ``gpu`` and skips them where
``torch.cuda.is_available()`` is false (``gpu_runs.GPU``), as tests/engines/test_cuda.py does.
"""

from __future__ import annotations

import os

# cuBLAS's deterministic workspace (read as CUDA starts): the resume test compares two runs
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
