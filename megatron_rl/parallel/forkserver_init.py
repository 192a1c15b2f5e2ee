"""First module a rank forkserver imports (:data:`megatron_rl.parallel.launch.FORKSERVER_PRELOAD`):
megatron-core warns on import that apex / Transformer Engine are absent, which is expected on
CPU; the ranks silence it themselves, and so does their server."""

import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
