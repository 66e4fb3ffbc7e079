"""Where a deployment's processes run: Ray placement (:mod:`tqtx.placement.ray`, needs
``pip install 'tqtx[ray]'``) and the shared-filesystem probe (:mod:`tqtx.placement.probe`).

Nothing here imports Ray at import time; only :mod:`tqtx.placement.ray` does, and only
``tq.init`` with Ray placement (or inside a Ray job) imports that module.
"""
