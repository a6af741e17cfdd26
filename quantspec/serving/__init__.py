"""Serving measurements: a real engine's OpenAI-compatible server measured from outside.

``server`` starts and stops the engine process, ``workload`` builds the requests, ``client``
streams one request, ``load`` drives a rate or concurrency level, ``stats`` and ``slo`` turn
per-request timings into percentiles and goodput, ``metrics`` samples the engine's Prometheus
endpoint, ``accuracy`` takes perplexity through the same server, ``bench`` runs the sweep.
"""
