"""Console setup shared by ``tqtx demo`` and the benchmarks."""
from __future__ import annotations

import os
import warnings


def quiet_console() -> None:
    """Keep warnings and torch's log lines off a command's console output."""
    os.environ.setdefault("TQTX_LOG_LEVEL", "WARNING")
    warnings.filterwarnings("ignore")
    import logging

    import torch  # noqa: F401  (configures torch's loggers; quiet them afterwards)

    for name in ("torch", "torch.fx", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)
