"""Set-up shared by every test."""

import signal

# A test run started in the background (`nohup ... &`, a non-interactive shell's asynchronous job)
# inherits SIGINT ignored, and so would every process it starts: the CLI under test could not be
# stopped by Ctrl-C. The tests that interrupt it need what a terminal's foreground job has; it is
# restored here, before any test starts a process.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
