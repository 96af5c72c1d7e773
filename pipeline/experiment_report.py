"""`python -m pipeline.experiment_report`: the command; `pipeline.experiments.report` holds it."""

import sys

from pipeline.experiments.report import main

if __name__ == "__main__":
    sys.exit(main())
