import os
import sys

try:  # Ctrl-C while the libraries load is still one line and exit 130
    from pin_and_cite.cli import main

    code = main()
except KeyboardInterrupt:
    print("pin-and-cite: interrupted; nothing was written", file=sys.stderr, flush=True)
    os._exit(130)  # at once: an interrupt caught mid-import must not reach the interpreter's own exit (-SIGINT)
raise SystemExit(code)
