"""`python -m pipeline.diagnose`: the command; `pipeline.experiments.diagnose` holds it."""

import sys

from pipeline.experiments.diagnose import main

if __name__ == "__main__":
    sys.exit(main())
