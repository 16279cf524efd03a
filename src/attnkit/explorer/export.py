"""`export_page`: the explorer as one self-contained HTML file, written atomically."""

import os
import secrets

from attnkit._interrupts import raise_if_pressed
from attnkit.explorer.page import render_page


def export_page(path, source, text, *, force=False, decimals=4):
    """Writes the page of `text` for `source` to `path`.

    The file is written next to `path` under a temporary name and renamed over it, so an
    interrupted export leaves either the old file or the new one, never half a file.

    Args:
        path: the .html file to write.
        source: an explorer source (`attnkit.explorer.open_model`).
        text: the text to explore.
        force: replace an existing file. Default False.
        decimals: the weights' decimal places. Default 4.

    Returns:
        The data contract written into the page.

    Raises:
        FileExistsError: `path` exists and `force` is False.
        BadInput: empty text.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not force:
        raise FileExistsError(f"{path} already exists; pass --force to overwrite it")
    data = source.attention(text, decimals=decimals)
    html = render_page(source.describe(), data=data)
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    try:
        # O_EXCL: never write through a file or link that is already there; 0o666 less the umask.
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(html)
            f.flush()
            os.fsync(f.fileno())
        if not force and os.path.exists(path):  # created while the page was being computed
            raise FileExistsError(f"{path} already exists; pass --force to overwrite it")
        raise_if_pressed()  # a Ctrl-C whose KeyboardInterrupt was lost: the old page stays
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return data
