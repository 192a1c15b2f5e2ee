import sys

from megatron_rl.cli.app import main

sys.exit(main())
