"""What the daemon shows of itself: its counters (stats), ``/metrics``, the HTTP endpoint
and the operator's page."""
