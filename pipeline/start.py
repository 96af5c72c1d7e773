"""`python -m pipeline.start`: the command; `pipeline.experiments.start` holds it."""

import sys

from pipeline.experiments.start import main

if __name__ == "__main__":
    sys.exit(main())
