"""`python -m pipeline.experiment`: the command; `pipeline.experiments.run` holds it."""

import sys

from pipeline.experiments.run import main

if __name__ == "__main__":
    sys.exit(main())
