"""hpo: hyper-parameter optimization of data-parallel PyTorch training scripts."""
from __future__ import annotations

__version__ = "0.1.0"
