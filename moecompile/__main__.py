import sys

from moecompile.cli import main

sys.exit(main())
