"""`python -m trainpod ...` is the `trainpod` command (torchrun launches it this way: `-m trainpod`)."""

import sys

from trainpod.cli import main

sys.exit(main())
