"""First module a rank forkserver imports (:data:`megatron_rl.parallel.launch.FORKSERVER_PRELOAD`):
megatron-core warns on import that apex / Transformer Engine are absent, which is expected on
CPU; the ranks silence it themselves, and so does their server.

The server ends when its launcher does (EOF on its pipe, also after a SIGKILL of the launcher),
with ``SystemExit``: the interpreter's teardown of torch and megatron-core that follows took
more than 30 s on a loaded machine, so the server outlived the job it served. Once the
``atexit`` handlers have run, it leaves with ``os._exit`` instead (only in the forkserver: its
ranks leave through ``os._exit`` already)."""

import atexit
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


def _in_forkserver() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (the preload)."""
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(
                os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back
    return False


if _in_forkserver():
    atexit.register(os._exit, 0)  # registered first: runs after every other atexit handler
