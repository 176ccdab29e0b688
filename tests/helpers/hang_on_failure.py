"""``python -m tests.helpers.hang_on_failure fit ...``: the ``lightning-dta`` command, except that a rank other than 0
whose run fails stays alive (asleep) instead of exiting, like a rank stuck in teardown or a NCCL peer that never
notices: the other ranks must then stop by themselves."""

import os
import sys
import time

from lightning_dta.cli import main

if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BaseException:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            time.sleep(60)
        raise
