"""The system's Chromium for the browser tests (Debian's `chromium` package), and how to launch it."""

import shutil

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Headless in a container: no sandbox, no GPU, and none of Chromium's own calls home.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-default-apps", "--disable-extensions",
]
