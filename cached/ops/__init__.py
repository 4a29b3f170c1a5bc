"""The ops beside the core ``get``/``prefetch`` path, each a handler table the server
dispatches to: write-back leases and uploads, the autotune winners and the planned shapes
(certifications)."""
