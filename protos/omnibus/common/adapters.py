"""What a LoRA adapter may be called. Torch-free, so the router (which has no torch)
validates the x-adapter-id header with the very rule the engine uses."""

import re

# 1-128 ASCII letters, digits, '.', '_', '-', starting with a letter or digit: no path
# separators, no "..", no hidden files, no unicode look-alikes. Match with fullmatch.
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
