"""The artifact store: blobs named by their sha256, the index that names them, the LRU that
picks eviction victims, the lock that keeps one process per store, and the export to
FlashInfer's own disk layout."""
