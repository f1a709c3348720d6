import sys

from dlrm_lab.cli import main

sys.exit(main())
