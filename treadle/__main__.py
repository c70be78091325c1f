import sys

from treadle.cli import main

sys.exit(main())
