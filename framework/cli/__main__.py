"""`python -m portaserve.framework.cli` is the `portaserve` command."""

import sys

from . import main

sys.exit(main())
