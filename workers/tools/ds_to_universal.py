"""DeepSpeed's checkpoint converter (`deepspeed.checkpoint.ds_to_universal`), run as a command-line tool
with deepspeed imported the way a train worker imports it (workers/engine.py `import_deepspeed`, without
mlflow): `python -m deepspeed.checkpoint.ds_to_universal` spends ~2 s of its ~6 s on 2 cores importing
mlflow through DeepSpeed's autotuner, on every resume onto another world size.

    python -m workers.tools.ds_to_universal --input_folder ... --output_folder ... [converter flags]
"""

from __future__ import annotations

import runpy

from workers.engine import import_deepspeed

if __name__ == "__main__":
    import_deepspeed()
    runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__", alter_sys=True)
