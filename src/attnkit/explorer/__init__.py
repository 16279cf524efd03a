"""attnkit's attention explorer: a page that shows where each head looks, served or exported.

    contract.py   the JSON the page carries (`make_data`) and its rounding
    sources/      adapters from models to the contract: pretrained encoders, the date translator, the
                  causal language model (generation step by step)
    page.py       the page (page.html with the data inlined)
    export.py     one self-contained HTML file, written atomically
    server.py     the local server: the page and the JSON endpoint, on 127.0.0.1
"""

from attnkit.explorer.contract import Attention, Steps, make_data
from attnkit.explorer.export import export_page
from attnkit.explorer.page import render_page
from attnkit.explorer.server import ExplorerServer
from attnkit.explorer.sources import BadInput, open_model

__all__ = ["Attention", "BadInput", "ExplorerServer", "Steps", "export_page", "make_data", "open_model", "render_page"]
