import sys

from tensorstream.cli.main import main

sys.exit(main())
