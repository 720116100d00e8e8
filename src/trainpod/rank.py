"""One rank under torchrun on a cluster node: the `trainpod` CLI, then its exit code reported.

    torchrun ... -m trainpod.rank run pretrain        # what launch_cluster starts on every node

torchrun's agent reduces a rank's exit code to "failed"; the node's launcher (launch.py,
launch_cluster) needs the exact code (143, 3, 2, ...) to map the node's outcome back to the exit
code table, so each rank writes it into TRAINPOD_RANK_EXIT_DIR as it exits.
"""

import sys

from trainpod.cli import main
from trainpod.launch import report_rank_exit

code = 1  # an exception escaping the CLI is a crash: the failed-start path
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # argparse's usage errors and sys.exit inside a workload
    # As Python exits on it: sys.exit() is success, sys.exit("message") a failure (1).
    code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
finally:
    report_rank_exit(code)
sys.exit(code)
