import os
import signal
import sys

# Make `tests.distributed` importable as `distributed` from spawned workers too.
sys.path.insert(0, os.path.dirname(__file__))

# A non-interactive shell starts a background job with SIGINT ignored, and a child process
# inherits an ignored signal across exec: the tests that stop a launcher or a server with
# Ctrl-C (SIGINT) would then send it to processes that cannot hear it. A handler, unlike an
# ignored signal, is reset to the default at exec, so every process the tests start can be
# interrupted again, wherever the suite runs.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
