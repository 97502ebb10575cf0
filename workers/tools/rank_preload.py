"""Imported once by the fork server of `run_workers` (workers/tools/launch.py): what a CPU rank needs.

torch, torch.distributed, transformers' model base and DeepSpeed (through workers.engine, which keeps
DeepSpeed's import from pulling in mlflow) are ~6-9 s of CPU per process on a 2-core machine; ranks forked
from a server that imported them once start with them loaded. Only hosts without CUDA use the server:
DeepSpeed picks its CPU accelerator here, as every rank would.
"""

from __future__ import annotations

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers.modeling_utils  # noqa: F401

from workers.engine import import_deepspeed
from workers.models import ModelSpec  # noqa: F401
from workers.tools import parity  # noqa: F401

import_deepspeed()
