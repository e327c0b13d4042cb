"""``attnlab`` under torchrun, SIGKILLed right after the Nth torch.distributed.checkpoint save of its
process returns (``ATTNLAB_TEST_KILL_AT_SAVE=N``): a kill inside a sharded checkpoint save, for
tests/test_fsdp.py."""

import os
import signal
import sys

import torch.distributed.checkpoint as dcp

from attnlab.cli import main

_save, _calls = dcp.save, []


def _save_then_die(*args, **kwargs):
    result = _save(*args, **kwargs)
    _calls.append(1)
    if len(_calls) == int(os.environ["ATTNLAB_TEST_KILL_AT_SAVE"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return result


dcp.save = _save_then_die
sys.exit(main(sys.argv[1:]))
