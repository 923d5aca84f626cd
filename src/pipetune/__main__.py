import sys

from pipetune.cli import main

sys.exit(main())
