import sys

from harken.cli import main

sys.exit(main())
