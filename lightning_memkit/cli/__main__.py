import sys

from lightning_memkit.cli import main

sys.exit(main())
