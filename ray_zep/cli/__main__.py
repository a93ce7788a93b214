"""`python -m ray_zep.cli`: the same as `ray-zep`."""

import sys

from ray_zep.cli import main

sys.exit(main())
