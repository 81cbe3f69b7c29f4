"""The live web dashboard (``pip install 'meshtrain[dashboard]'``).

* :mod:`~meshtrain.dashboard.state`: what it shows, fed by observer calls
  (:mod:`meshtrain.observers`) and run directories; plain data, no server.
* :mod:`~meshtrain.dashboard.server`: the aiohttp server, 127.0.0.1 and a token by default.
* ``static/``: the page, its script (a small SVG plotter) and style, served inline.
"""
