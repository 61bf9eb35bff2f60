import sys

from autoseg.cli.main import main

sys.exit(main())
