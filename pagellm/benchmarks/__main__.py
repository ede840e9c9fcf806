"""``python -m pagellm.benchmarks ...`` (the same as ``pagellm bench ...``)."""

import sys

from pagellm.benchmarks.cli import main

sys.exit(main())
