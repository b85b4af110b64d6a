import sys

from goose.cli import main

sys.exit(main())
