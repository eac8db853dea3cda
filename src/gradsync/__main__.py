"""``python -m gradsync ...`` (what torchrun runs with ``-m gradsync``)."""

import sys

from gradsync.cli import main

sys.exit(main())
