import sys

try:  # Ctrl-C while the libraries load is still one line and exit 130
    from pin_and_cite.cli import main

    code = main()
except KeyboardInterrupt:
    print("pin-and-cite: interrupted; nothing was written", file=sys.stderr, flush=True)
    code = 130
raise SystemExit(code)
