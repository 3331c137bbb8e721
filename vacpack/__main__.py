import sys

from vacpack.cli import main

sys.exit(main())
