import sys

from bnlab.cli import main

sys.exit(main())
