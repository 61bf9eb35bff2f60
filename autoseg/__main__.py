import sys

from autoseg.cli import main

sys.exit(main())
