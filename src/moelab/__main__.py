"""``python -m moelab``: the ``moelab`` command."""

import sys

from moelab.cli import main

sys.exit(main())
