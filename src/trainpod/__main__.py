"""`python -m trainpod ...` is the `trainpod` command (torchrun launches it this way: `-m trainpod`)."""

import sys

from trainpod.cli import main
from trainpod.preemption import exit_now_when_preempted

code = main()
exit_now_when_preempted(code)  # the ranks of a stopped run end here: their commit is made
sys.exit(code)
