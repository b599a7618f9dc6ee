import sys

from turborlhf.cli import main

sys.exit(main())
