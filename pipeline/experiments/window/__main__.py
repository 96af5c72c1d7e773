"""`python -m pipeline.experiments.window`: the command; `command.py` holds it."""

import sys

from pipeline.experiments.window.command import main

if __name__ == "__main__":
    sys.exit(main())
