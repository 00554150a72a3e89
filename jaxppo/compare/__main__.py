"""`python -m jaxppo.compare`."""

import sys

from jaxppo.compare.cli import main

sys.exit(main())
