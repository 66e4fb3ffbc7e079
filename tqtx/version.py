"""tqtx's version, importable without the package face (servers use it)."""

__version__ = "0.3.0"
# The TransferQueue release whose KV and checkpoint API this one matches (docs/compatibility.md).
TRANSFERQUEUE_API_VERSION = "0.1.11"
