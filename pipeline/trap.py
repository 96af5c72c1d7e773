"""`python -m pipeline.trap`: the command; `pipeline.experiments.trap` holds it."""

import sys

from pipeline.experiments.trap import main

if __name__ == "__main__":
    sys.exit(main())
