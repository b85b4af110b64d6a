import sys

from goose.tools.cli import main

sys.exit(main())
