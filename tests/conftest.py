"""Import the tools (pin_and_cite, vendor_assets, record_traces) from this checkout's tools/ folder, ahead of
any installed copy, so the tests always exercise the code next to them."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
