"""``mooncake``: KV pages in a Mooncake Store (``mooncake_master`` + client segments).

``kvconnect.connectors.mooncake.store.MooncakeStore`` is the ``PageStore``; importing this package
does not import ``mooncake`` (the registry loads ``store`` on first use).
"""
