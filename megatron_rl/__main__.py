import sys

from megatron_rl.cli import main

sys.exit(main())
