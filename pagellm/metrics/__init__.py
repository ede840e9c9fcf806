"""Serving metrics: Prometheus exposition of engine gauges and per-request latencies."""
